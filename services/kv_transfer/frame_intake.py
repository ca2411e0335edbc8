"""The steps every stream-shaped KV receiver (the gRPC stream, the raw TCP data plane) takes
for one inline frame, in stream order: the first frame opens the session, the frame's MAC is
checked before any of its bytes are used, an empty frame is a heartbeat, its headers are
announced to the sink (checked before anything is allocated), and its payload is written into
the announced blocks. A frame that holds exactly its announced blocks, whole and uncompressed,
needs no allocation: its blocks are checked and written by the sink in one call. Shared-memory
frames are the gRPC receiver's own (grpc_receiver.py)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.kv.handoff import HandoffError
from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer.base import MAX_PENDING_HEADERS
from pdserve.services.kv_transfer.frames import Frame
from pdserve.services.kv_transfer.receive_session import ReceiveSession, whole_run
from pdserve.services.kv_transfer.wire_codec import WireMeta


@dataclass(slots=True)
class Pending:
    meta: WireMeta           # nbytes: the block's size on the wire
    buf: bytearray | None = None
    filled: int = 0


def open_or_refuse(session: ReceiveSession, frame: Frame) -> None:
    """The first frame opens the session (UNAUTHENTICATED without the reservation's token); a
    later open is refused (a stream is opened once)."""
    if frame.error:
        raise HandoffError("INVALID_ARGUMENT", frame.error)
    opened = frame.open
    if not session.request_id:
        session.open(opened.request_id if opened is not None else "",
                     opened.transfer_token if opened is not None else b"",
                     opened.mac_algorithm if opened is not None else "")
    elif opened is not None:
        session.open(opened.request_id, opened.transfer_token)   # refused: opened once


def announce(session: ReceiveSession, pending: deque[Pending], headers: list[kv_pb2.KVBlockHeader]) -> None:
    _queue(session, pending, session.wire_metas(headers))


def _queue(session: ReceiveSession, pending: deque[Pending], wires: list[WireMeta]) -> None:
    """Blocks checked against the reservation, then waiting for their bytes."""
    if len(pending) + len(wires) > MAX_PENDING_HEADERS:
        raise HandoffError("INVALID_ARGUMENT", f"more than {MAX_PENDING_HEADERS} blocks announced ahead")
    session.check(wires)
    pending.extend(Pending(wire) for wire in wires)


def take_inline(session: ReceiveSession, pending: deque[Pending], frame: Frame) -> None:
    """One inline frame, all steps (see the module docstring). A frame that carries exactly its
    announced blocks, whole and uncompressed (what the senders frame when they can), is checked
    against the reservation and written by the sink in one call, nothing allocated (the payload
    is the received message's)."""
    open_or_refuse(session, frame)
    session.verify([frame.signed], frame.mac)   # before any of its bytes are used
    if not frame.headers and not frame.payload.nbytes:
        session.heartbeat()
        return
    wires = session.wire_metas(frame.headers)
    if not pending and whole_run(wires, frame.payload.nbytes):
        session.accept_run(wires, frame.payload)
        return
    _queue(session, pending, wires)
    deliver(frame.payload, pending, session)


def end(session: ReceiveSession, pending: deque[Pending]) -> kv_pb2.PushAck:
    """The stream ended cleanly: every announced block complete, every needed one received."""
    if pending:
        raise HandoffError("DATA_LOSS", f"stream ended with {len(pending)} block(s) incomplete")
    return session.complete()


def deliver(data: memoryview, pending: deque[Pending], session: ReceiveSession) -> None:
    """A verified frame's payload into its announced blocks, in order. Runs of whole uncompressed
    blocks go to the sink together, straight from the frame (one pool copy per run); a block
    spanning frames is gathered into a buffer first."""
    run: list[WireMeta] = []
    run_at = run_end = at = 0

    def flush() -> None:
        if run:
            session.accept_run(run, data[run_at:run_end])
            run.clear()

    while at < data.nbytes:
        if not pending:
            raise HandoffError("INVALID_ARGUMENT", "payload bytes beyond the announced blocks")
        p = pending[0]
        size = p.meta.nbytes
        if p.buf is None and data.nbytes - at >= size:   # the whole block is in this frame
            pending.popleft()
            if p.meta.codec == "off":
                if not run:
                    run_at = at
                run.append(p.meta)
                run_end = at + size
            else:
                flush()
                session.accept(p.meta, data[at:at + size])
            at += size
            continue
        flush()
        if p.buf is None:
            p.buf = bytearray(size)   # size was checked against the pool's block size (and its codec's bound)
        take = min(size - p.filled, data.nbytes - at)
        p.buf[p.filled:p.filled + take] = data[at:at + take]
        p.filled += take
        at += take
        if p.filled == size:
            pending.popleft()
            session.accept(p.meta, memoryview(p.buf))
    flush()
