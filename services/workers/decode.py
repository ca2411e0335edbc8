"""Decode role: reserve blocks for a sequence whose KV arrives from a prefill worker, admit it
once the KV connector has every block verified, and decode it with continuous batching."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import grpc

from pdserve.engine import NoCapacity
from pdserve.engine.kv.handoff import HandoffError, HandoffState
from pdserve.services.common import tracing
from pdserve.services.common.proto_convert import decode_event_proto, params_from_proto
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.workers.colocated import generate_local
from pdserve.services.workers.lifecycle import WorkerState
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


log = logging.getLogger(__name__)


def status_code(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)


# DecodeMany: events waiting to be written before its control stream is read further (a caller
# that starts requests without reading their events holds at most this many in memory).
MAX_PENDING_EVENTS = 4096


class DecodeRefused(Exception):
    """A request's decode cannot start: the status Decode aborts with (DecodeMany: its last event)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class DecodeHandler(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, aengine: AsyncEngine, state: WorkerState, data_address: str = "") -> None:
        """data_address: this worker's raw TCP KV data plane, named in every reservation ("": none)."""
        self.aengine = aengine
        self.state = state
        self.data_address = data_address

    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.ReserveResponse:
        await self.state.refuse_if_draining(context)
        try:
            params = params_from_proto(request.params)
            await self.aengine.compile_grammar(params)
            res = self.aengine.reserve(request.request_id, request.prompt_token_ids, params,
                                       request.output_token_ids, lease_s=request.lease_ms / 1e3 or None)
        except NoCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker is full: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.ReserveResponse(needed_block_indices=res.needed_block_indices,
                                          held_block_hashes=res.held_block_hashes, num_blocks=res.num_blocks,
                                          transfer_token=res.transfer_token, lease_ms=int(res.lease_s * 1e3),
                                          data_address=self.data_address)

    async def FailTransfer(self, request: worker_pb2.FailTransferRequest, context: grpc.aio.ServicerContext
                           ) -> common_pb2.AbortResponse:
        found = self.aengine.connector.fail(request.request_id, "UNAVAILABLE",
                                            f"the prefill worker could not deliver the KV: {request.reason[:512]}")
        return common_pb2.AbortResponse(found=found)

    async def Generate(self, request: worker_pb2.GenerateLocalRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[worker_pb2.GenerateLocalEvent]:
        """Conditional disaggregation: prefill the prompt here, in the mixed steps, and decode it."""
        async with contextlib.aclosing(generate_local(self.aengine, self.state, request, context)) as events:
            async for event in events:
                yield event

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        try:
            async with contextlib.aclosing(self._events(request)) as events:
                async for event in events:
                    yield event
        except DecodeRefused as refused:
            await context.abort(refused.code, refused.message)

    async def DecodeMany(self, requests: AsyncIterator[worker_pb2.DecodeControl],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeEvents]:
        """Many requests' Decode over one stream: their events batched per wake-up of the loop."""
        pending: list[worker_pb2.DecodeEvent] = []
        wake, written = asyncio.Event(), asyncio.Event()
        running: dict[str, asyncio.Task] = {}

        def emit(event: worker_pb2.DecodeEvent) -> None:
            pending.append(event)
            wake.set()

        def failed(rid: str, code: grpc.StatusCode, message: str) -> worker_pb2.DecodeEvent:
            return worker_pb2.DecodeEvent(request_id=rid, finished=True, error_code=code.value[0],
                                          error_message=message)

        async def decode_one(request: worker_pb2.DecodeRequest) -> None:
            rid, error = request.request_id, None
            span = tracing.start_from_traceparent("pdserve.worker/Decode", request.traceparent, request_id=rid)
            try:
                async with contextlib.aclosing(self._events(request)) as events:
                    async for event in events:
                        event.request_id = rid
                        tracing.event(span, "DecodeEvent", tokens=len(event.token_ids))
                        emit(event)
            except DecodeRefused as refused:
                error = f"{refused.code.name}: {refused.message}"
                emit(failed(rid, refused.code, refused.message))
            except asyncio.CancelledError:
                error = "CANCELLED: the router stopped reading it"
                raise
            except Exception as exc:   # a fault of this request only: the others keep decoding
                log.exception("decoding %s failed", rid)
                error = f"INTERNAL: {exc}"
                emit(failed(rid, grpc.StatusCode.INTERNAL, f"decoding failed: {exc}"[:512]))
            finally:
                tracing.end(span, error)
                running.pop(rid, None)
                wake.set()

        async def read_controls() -> None:
            async for control in requests:
                while len(pending) >= MAX_PENDING_EVENTS:   # a caller that does not read stops being read
                    written.clear()
                    await written.wait()
                kind = control.WhichOneof("kind")
                if kind == "start":
                    rid = control.start.request_id
                    if rid in running:
                        emit(failed(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request {rid[:64]!r} is already "
                                                                            f"decoding on this stream"))
                    else:   # each start runs to its first wait before the next is read: one that
                        # ends at once (no reservation) is pending then, and counts against the bound
                        running[rid] = asyncio.create_task(decode_one(control.start))
                        await asyncio.sleep(0)
                elif kind == "cancel" and (task := running.get(control.cancel)) is not None:
                    task.cancel()

        reader = asyncio.create_task(read_controls())
        reader.add_done_callback(lambda _: wake.set())
        try:
            while True:
                await wake.wait()
                wake.clear()
                if pending:
                    batch = worker_pb2.DecodeEvents(events=pending)
                    pending.clear()
                    yield batch
                    written.set()
                if reader.done() and not running and not pending:
                    reader.result()   # the router's side failed: end with its error
                    return
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _events(self, request: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeEvent]:
        """A request's decode events once its KV is in place; DecodeRefused when it cannot start."""
        rid = request.request_id
        kv = self.aengine.connector
        t0 = time.perf_counter()
        wait_s = request.kv_wait_ms / 1e3 if request.kv_wait_ms else kv.max_lease_s
        state = await self.aengine.wait_kv(rid, wait_s)
        if state is not HandoffState.READY:
            failure = kv.failure(rid)
            if failure is not None:
                raise DecodeRefused(status_code(failure.code), f"KV of {rid!r}: {failure.message}")
            if state is None:
                raise DecodeRefused(grpc.StatusCode.NOT_FOUND, f"no reservation for request {rid!r}")
            self.aengine.abort(rid)   # still incomplete after kv_wait: give the blocks back
            raise DecodeRefused(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"KV of {rid!r} incomplete after waiting {wait_s:g}s")
        kv_wait_ms = (time.perf_counter() - t0) * 1e3
        try:
            stream, reason = self.aengine.admit(rid, request.first_token_id)
        except HandoffError as exc:
            raise DecodeRefused(status_code(exc.code), str(exc)) from None
        except ValueError as exc:
            raise DecodeRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        with self.state.track():
            async with stream:
                if reason is not None:
                    yield worker_pb2.DecodeEvent(finished=True, finish_reason=reason, kv_wait_ms=kv_wait_ms)
                    return
                t_admit, first = time.perf_counter(), True
                while True:
                    out = (await stream.get()).output
                    event = decode_event_proto(out)
                    if first:
                        event.kv_wait_ms = kv_wait_ms
                        event.first_decode_step_ms = (time.perf_counter() - t_admit) * 1e3
                        first = False
                    yield event
                    if out.finished:
                        return
