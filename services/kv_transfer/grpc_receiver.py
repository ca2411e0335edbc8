"""The receiving end of the gRPC KV stream (``pdserve.v1.KVTransfer/PushBlocks``): frames
parsed without a protobuf copy of the payload (frames.parse_frame: a frame's payload is a view
of the received message), every frame's MAC checked before any of its bytes are used, each
header announced to the ``KVSink`` before anything is allocated, whole blocks written into the
pool straight from the message (a run of them per frame at once; a block spanning frames is
gathered first), and the call ended with the sink's status on the first refusal (that request's
blocks freed). The sender is grpc_transport.py.
"""
from __future__ import annotations

import asyncio
import mmap
from collections import deque
from typing import AsyncIterator

import grpc

from pdserve.engine.kv.handoff import HandoffError
from pdserve.services.kv_transfer import shared_memory
from pdserve.services.kv_transfer.base import KVSink
from pdserve.services.kv_transfer.frames import Frame, parse_frame
from pdserve.services.kv_transfer.receive_session import (Pending, ReceiveSession, announce, deliver, end,
    open_or_refuse, take_inline)
from pdserve.v1 import kv_pb2, kv_pb2_grpc

SERVICE = "pdserve.v1.KVTransfer"
SHM_PROBE_BYTES = 64                  # the segment that asks a peer whether it shares memory with us


# A refused stream is read to its end (frames discarded, for at most this long) before its status
# goes out: grpcio's asyncio client reports a write that meets an already-closed stream as
# INTERNAL "Internal error from Core" and loses the server's status (grpc/grpc#36066), so a sender
# still writing when the refusal came would see INTERNAL instead of NOT_FOUND / DATA_LOSS.
REFUSAL_DRAIN_S = 0.5


async def _drain(request_iterator: AsyncIterator[Frame], limit_s: float) -> None:
    async def read_all() -> None:
        async for _ in request_iterator:
            pass
    try:
        await asyncio.wait_for(read_all(), limit_s)
    except (asyncio.TimeoutError, grpc.RpcError, HandoffError, ValueError):
        pass   # a sender that keeps writing, or frames that do not parse: the status goes out anyway


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    """Reassembles blocks and hands them to the sink; the first refusal ends the call."""

    def __init__(self, sink: KVSink, shared_memory: bool = False,
                 shared_memory_dir: str = shared_memory.SHM_DIR, cluster_token: str | bytes | None = None) -> None:
        """shared_memory: accept frames whose payload is in a same-host shared-memory segment
        (in shared_memory_dir). cluster_token: the deployment's, which keys the frames' MACs (as
        the sender's; None: the transfer token alone)."""
        self.sink = sink
        self.cluster_token = cluster_token
        self.shared_memory = shared_memory
        self.shared_memory_dir = shared_memory_dir

    async def PushBlocks(self, request_iterator: AsyncIterator[Frame], context: grpc.aio.ServicerContext
                         ) -> kv_pb2.PushAck:
        # Frames are stored on the loop, as they come: measured (bench/kv_handoff_hosts.py, 10
        # Gbit/s, 32 MiB) storing large frames from a worker thread was slower (medians 109-113
        # against 80-81 ms): the thread and the loop pass the GIL back and forth.
        session = ReceiveSession(self.sink, self.cluster_token)
        pending: deque[Pending] = deque()
        try:
            async for frame in request_iterator:
                if (ack := self._frame(session, pending, frame)) is not None:
                    return ack   # a shared-memory probe
            if context.cancelled():
                raise asyncio.CancelledError()
            return end(session, pending)
        except HandoffError as exc:
            session.fail(exc)
            await _drain(request_iterator, REFUSAL_DRAIN_S)
            await context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL), str(exc))
        except asyncio.CancelledError:
            session.cancelled()
            raise

    def _frame(self, session: ReceiveSession, pending: deque[Pending], frame: Frame) -> kv_pb2.PushAck | None:
        """One frame, in stream order: its MAC checked before any of its bytes are used, its
        headers announced, its payload stored. Returns the answer to a shared-memory probe."""
        if frame.shm is None:
            take_inline(session, pending, frame)
            return None
        if frame.error:
            raise HandoffError("INVALID_ARGUMENT", frame.error)
        if not session.request_id and frame.open is not None and not frame.open.request_id:
            return self._probe(frame)   # an open without a request, naming a segment
        open_or_refuse(session, frame)
        if pending:
            raise HandoffError("INVALID_ARGUMENT", "a shared-memory frame must start at a block boundary")
        announce(session, pending, frame.headers)
        segment = self._map(frame, pending)
        try:
            session.verify([frame.signed, memoryview(segment)], frame.mac)
        except HandoffError:
            _close(segment)
            raise
        data = memoryview(segment)
        deliver(data, pending, session)
        del data
        _close(segment)
        return None

    def _probe(self, frame: Frame) -> kv_pb2.PushAck:
        """A sender asks whether we share its memory: take its small segment (unlinking it is the
        answer it checks). FAILED_PRECONDITION: no, send inline."""
        if not self.shared_memory:
            raise HandoffError("FAILED_PRECONDITION", "this worker takes no KV through shared memory")
        if frame.headers or frame.payload.nbytes or not 0 < frame.shm.size <= SHM_PROBE_BYTES:
            raise HandoffError("INVALID_ARGUMENT", f"a shared-memory probe names a segment of 1 to {SHM_PROBE_BYTES} "
                                                   f"bytes and nothing else")
        self._read_segment(frame.shm).close()
        return kv_pb2.PushAck(blocks_received=0, bytes_received=frame.shm.size)

    def _read_segment(self, shm: kv_pb2.KVSharedMemory) -> "mmap.mmap":
        try:
            return shared_memory.read_segment(shm.name, shm.size, self.shared_memory_dir)
        except shared_memory.SegmentUnavailable as exc:   # not shared with the sender: it resends inline
            raise HandoffError("FAILED_PRECONDITION", str(exc)) from None
        except ValueError as exc:
            raise HandoffError("DATA_LOSS", str(exc)) from None

    def _map(self, frame: Frame, pending: deque[Pending]) -> "mmap.mmap":
        """The frame's payload from its shared-memory segment, after checking its size against the
        headers (already checked against the reservation): nothing is mapped beyond them."""
        if not self.shared_memory:
            raise HandoffError("FAILED_PRECONDITION", "this worker takes no KV through shared memory")
        if frame.payload.nbytes:
            raise HandoffError("INVALID_ARGUMENT", "a frame carries its payload inline or in shared memory, not both")
        declared = sum(p.meta.nbytes for p in pending)
        if frame.shm.size != declared:
            raise HandoffError("INVALID_ARGUMENT", f"shared-memory segment of {frame.shm.size} bytes for blocks of "
                                                   f"{declared}")
        return self._read_segment(frame.shm)


def _close(segment: "mmap.mmap") -> None:
    try:
        segment.close()
    except BufferError:   # a view still alive: the mapping goes with it
        pass


def register_kv_servicer(servicer: KVTransferServicer, server: grpc.aio.Server) -> None:
    """Like ``kv_pb2_grpc.add_KVTransferServicer_to_server``, with the zero-copy frame parser."""
    handlers = {
        "PushBlocks": grpc.stream_unary_rpc_method_handler(
            servicer.PushBlocks, request_deserializer=parse_frame,
            response_serializer=kv_pb2.PushAck.SerializeToString)
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
