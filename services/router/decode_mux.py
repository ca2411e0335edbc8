"""One DecodeMany stream per decode worker, shared by every request the router decodes there.

A per-request Decode stream costs the worker's event loop (and the router's) one gRPC message per
token per request; DecodeMany carries an engine step's tokens for all its requests in one
message. Each request reads its own events through a ``MuxCall``, which looks to the progress
watchdog (migration.WorkerWatch) like the call it replaces: ``read()`` returns events, then
grpc.aio.EOF, and raises grpc.aio.AioRpcError with the status Decode would have failed with;
``cancel()`` stops the request on the worker. When the stream itself fails (the worker died,
the connection broke), every request on it fails with that error and moves, as separate calls
would; the next request opens a new stream. A worker that has no DecodeMany (an older pdserve)
answers UNIMPLEMENTED: its requests, and every later one there, take a Decode call each. grpcio
can lose that status: a control written while the refusal arrives fails the call locally with
INTERNAL. So a stream that fails with INTERNAL before it delivered anything leaves its requests
to a Decode call each too (none of them had an event; a worker that has DecodeMany serves Decode
as well), and the next request tries a stream again.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from pdserve.services.common import tracing
from pdserve.v1 import worker_pb2, worker_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Stream:
    """One DecodeMany call and the requests reading from it."""

    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub) -> None:
        self.controls: asyncio.Queue[worker_pb2.DecodeControl | None] = asyncio.Queue()
        self.controls.put_nowait(worker_pb2.DecodeControl())   # the first message, which the call's proof names
        self.readers: dict[str, asyncio.Queue] = {}
        self.failed: grpc.aio.AioRpcError | None = None
        self.delivered = False   # whether any batch came: before one, an INTERNAL may be a lost UNIMPLEMENTED
        self.stub = stub
        self.call = stub.DecodeMany(self._control_stream())
        self.task = asyncio.ensure_future(self._read())

    async def _control_stream(self) -> AsyncIterator[worker_pb2.DecodeControl]:
        while (control := await self.controls.get()) is not None:
            yield control

    async def _read(self) -> None:
        try:
            async for batch in self.call:
                self.delivered = True
                for event in batch.events:
                    queue = self.readers.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
            error = _error(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:   # the router is stopping
            self._fail(_error(grpc.StatusCode.CANCELLED, "the decode stream was closed"))
            raise
        self._fail(error)

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        self.failed = error
        self.controls.put_nowait(None)   # ends the request stream's writer
        for queue in self.readers.values():
            queue.put_nowait(error)
        self.readers.clear()

    def start(self, request: worker_pb2.DecodeRequest) -> MuxCall:
        queue: asyncio.Queue = asyncio.Queue()
        if self.failed is not None:
            queue.put_nowait(self.failed)
        else:
            self.readers[request.request_id] = queue
            self.controls.put_nowait(worker_pb2.DecodeControl(start=request))
        return MuxCall(self, request, queue)

    def refused_before_use(self) -> bool:
        """Whether the stream ended in a way that leaves its requests to Decode calls: the worker
        has no DecodeMany, or (grpcio having lost that status) INTERNAL before any batch came."""
        code = self.failed.code() if self.failed is not None else None
        return code == grpc.StatusCode.UNIMPLEMENTED or (code == grpc.StatusCode.INTERNAL and not self.delivered)

    def stop(self, request_id: str, finished: bool) -> None:
        if self.readers.pop(request_id, None) is not None and not finished and self.failed is None:
            self.controls.put_nowait(worker_pb2.DecodeControl(cancel=request_id))


def single_decode(stub: worker_pb2_grpc.DecodeWorkerStub, request: worker_pb2.DecodeRequest):
    """The request's own Decode call (a worker without DecodeMany), traced as the stream's start would be."""
    metadata = ((tracing.TRACEPARENT, request.traceparent),) if request.traceparent else None
    return stub.Decode(request, metadata=metadata)


class MuxCall:
    """One request's events on a shared stream, read like its own Decode call."""

    def __init__(self, stream: _Stream, request: worker_pb2.DecodeRequest, queue: asyncio.Queue) -> None:
        self._stream, self._request, self._queue = stream, request, queue
        self._finished = False
        self._single = None   # its own Decode call, once the worker said it has no DecodeMany

    async def read(self):
        if self._single is not None:
            return await self._single.read()
        if self._finished:
            return grpc.aio.EOF
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError) and self._stream.refused_before_use():
            self._single = single_decode(self._stream.stub, self._request)
            return await self._single.read()
        if isinstance(item, grpc.aio.AioRpcError):
            self._finished = True
            raise item
        if item.error_code:
            self._finished = True
            raise _error(_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
        if item.finished:
            self._finished = True
        return item

    def cancel(self) -> None:
        if self._single is not None:
            self._single.cancel()
        self._stream.stop(self._request.request_id, self._finished)
        self._finished = True


class DecodeMux:
    """The router's DecodeMany stream to one decode worker, opened on first use and again after
    it failed (a worker handle's channel closing ends it); Decode calls instead, for as long as the
    handle lasts, once the worker answered UNIMPLEMENTED."""

    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub) -> None:
        self._stub = stub
        self._stream: _Stream | None = None

    def decode(self, request: worker_pb2.DecodeRequest):
        """The request's events, read as from its own Decode call (MuxCall, or that call itself
        where the worker has no DecodeMany)."""
        if self._stream is not None and self._stream.failed is not None \
                and self._stream.failed.code() == grpc.StatusCode.UNIMPLEMENTED:
            return single_decode(self._stub, request)
        if self._stream is None or self._stream.failed is not None:
            self._stream = _Stream(self._stub)
        return self._stream.start(request)
