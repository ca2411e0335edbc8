"""One request's KV arriving at a decode worker, whatever carried it (a gRPC stream, with its
payload inline or in shared memory, or Ray's object store).

A transport parses its own framing and drives the session: ``open`` (the stream proves it holds
the reservation's token, UNAUTHENTICATED before anything else; its frames' MAC key follows from
that token and the deployment's cluster token), ``verify`` each frame's MAC before using any of
its bytes (DATA_LOSS: frames.py), ``announce`` each header (checked
by the connector before any byte is allocated or fetched), ``accept`` each block's bytes, then
``complete`` when the stream ends. A transport that reads a frame's payload straight into the
pool (the raw TCP plane) ``claim``s its blocks from the frame's headers before the frame's MAC
is in, and ``finish``es them once it is checked: until then the bytes sit in blocks reserved for
this request, which count as received only if it holds (and are freed, never cached, if not).
Every connector call goes through here, and so does the failure rule: a refusal fails the
request's transfer (its reserved blocks are freed), except one from a stream that never proved
it may speak for the request.

The frame intake (the functions after the session): the steps every stream-shaped KV receiver (the gRPC stream, the raw TCP data plane) takes
for one inline frame, in stream order: the first frame opens the session, the frame's MAC is
checked before any of its bytes are used, an empty frame is a heartbeat, its headers are
announced to the sink (checked before anything is allocated), and its payload is written into
the announced blocks. A frame that holds exactly its announced blocks, whole and uncompressed,
needs no allocation: its blocks are checked and written by the sink in one call. Shared-memory
frames are the gRPC receiver's own (grpc_receiver.py).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from pdserve.engine.kv.connector import ClaimedRun
from pdserve.engine.kv.handoff import BlockMeta, HandoffError, HandoffState
from pdserve.services.kv_transfer import frames
from pdserve.services.kv_transfer.base import KVSink, MAX_PENDING_HEADERS
from pdserve.services.kv_transfer.frames import Frame
from pdserve.services.kv_transfer.wire_codec import WireMeta, decode_payload, wire_meta
from pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)


def whole_run(wires: Sequence[WireMeta], payload_len: int) -> bool:
    """A frame's payload is exactly its announced blocks, whole and uncompressed (what the senders
    frame when they can): the receiver may store them at once."""
    return bool(wires) and all(w.codec == "off" for w in wires) and sum(w.nbytes for w in wires) == payload_len


class ReceiveSession:
    def __init__(self, sink: KVSink, cluster_token: str | bytes | None = None) -> None:
        """cluster_token: the deployment's, which keys the frames' MACs (None: the transfer
        token alone does; see frames.py)."""
        self.sink = sink
        self.cluster_token = cluster_token
        self.mac: frames.StreamMac | None = None
        self.request_id = ""
        self.token = b""
        self.blocks = 0
        self.bytes = 0

    def open(self, request_id: str, token: bytes, mac_algorithm: str = "") -> None:
        if self.request_id:
            raise HandoffError("INVALID_ARGUMENT", "a KV stream is opened once")
        if not request_id:
            raise HandoffError("INVALID_ARGUMENT", "the first KV frame must open the stream")
        self.request_id, self.token = request_id, token
        self.sink.authorize(request_id, token)
        self.mac = frames.StreamMac(frames.mac_key(token, self.cluster_token), mac_algorithm)

    def verify(self, parts: Iterable[bytes | bytearray | memoryview], mac: bytes) -> None:
        """The next frame's MAC (over parts) is right, or DATA_LOSS; nothing of a frame reaches
        the connector before this."""
        if self.mac is None:
            raise HandoffError("INVALID_ARGUMENT", "a KV frame before the stream was opened")
        self.mac.verify(parts, mac, f"KV of {self.request_id!r}")

    def verify_call(self, parts: Iterable[bytes | bytearray | memoryview], mac: bytes) -> None:
        """One uncounted MAC over parts (a Ray push_blocks call), or DATA_LOSS."""
        if self.mac is None:
            raise HandoffError("INVALID_ARGUMENT", "KV blocks before the stream was opened")
        frames.verify_once(self.mac.key, parts, mac, f"KV of {self.request_id!r}")

    def heartbeat(self) -> None:
        self.sink.heartbeat(self.request_id, self.token)

    def announce(self, header: kv_pb2.KVBlockHeader) -> WireMeta:
        """A block's header, checked against the reservation (and its wire size against its codec's
        bound); its bytes come later (accept)."""
        return self.announce_many([header])[0]

    def announce_many(self, headers: Sequence[kv_pb2.KVBlockHeader]) -> list[WireMeta]:
        """announce for a frame's headers, checked by the sink together (one lock) where it can."""
        wires = self.wire_metas(headers)
        self.check(wires)
        return wires

    def check(self, wires: Sequence[WireMeta]) -> None:
        """wire_metas' blocks checked against the reservation, together where the sink can."""
        if not wires:
            return
        check_many = getattr(self.sink, "check_many", None)
        if check_many is not None:
            check_many([w.meta for w in wires], self.token)
        else:
            for wire in wires:
                self.sink.check(wire.meta, self.token)

    def wire_metas(self, headers: Sequence[kv_pb2.KVBlockHeader]) -> list[WireMeta]:
        """The headers as the connector sees them, each checked on its own (this stream's request,
        a known codec, sizes that agree); not yet against the reservation."""
        for header in headers:
            if header.request_id != self.request_id:
                raise HandoffError("INVALID_ARGUMENT", f"block for {header.request_id!r} on the stream of "
                                                       f"{self.request_id!r}")
        return [wire_meta(header) for header in headers]

    def accept(self, wire: WireMeta | BlockMeta, payload: memoryview | bytes | bytearray) -> None:
        """A block's bytes as they came on the wire: decoded (into exactly its raw size) first."""
        if isinstance(wire, WireMeta):
            payload, meta = decode_payload(wire, payload), wire.meta
        else:
            meta = wire
        self.sink.accept(meta, self.token, payload)
        self.blocks += 1
        self.bytes += meta.nbytes

    def accept_run(self, wires: list[WireMeta], payload: memoryview | bytes | bytearray) -> None:
        """Uncompressed blocks whose bytes run back to back in payload: to the sink together when it
        takes runs (KVConnector.accept_many), else one by one."""
        metas = [w.meta for w in wires]
        accept_many = getattr(self.sink, "accept_many", None)
        if accept_many is not None:
            accept_many(metas, self.token, payload)
        else:
            view, at = memoryview(payload), 0
            for meta in metas:
                self.sink.accept(meta, self.token, view[at:at + meta.nbytes])
                at += meta.nbytes
        self.blocks += len(metas)
        self.bytes += sum(m.nbytes for m in metas)

    def claim(self, headers: Sequence[kv_pb2.KVBlockHeader], payload_len: int) -> ClaimedRun | None:
        """A frame's blocks claimed for its payload to be read straight into the pool, before its
        MAC is checked (KVConnector.claim_run: checked against the reservation, kept allocated until
        finish). None: its payload is not exactly its whole uncompressed blocks, or the sink cannot
        hand out its pool's bytes; the frame is then read and taken as any other."""
        claim_run = getattr(self.sink, "claim_run", None)
        if claim_run is None or not headers:
            return None
        wires = self.wire_metas(headers)
        return claim_run([w.meta for w in wires], self.token) if whole_run(wires, payload_len) else None

    def finish(self, run: ClaimedRun, written: bool) -> None:
        """A claimed run's end (KVConnector.finish_run); written: its frame's MAC held."""
        self.sink.finish_run(run, written)
        if written:
            self.blocks += len(run.metas)
            self.bytes += run.nbytes

    def complete(self) -> kv_pb2.PushAck:
        """The stream ended cleanly. READY, or already admitted: complete. Still waiting for
        blocks: they will never come."""
        if self.request_id and self.sink.state(self.request_id) in (HandoffState.RESERVED, HandoffState.RECEIVING):
            raise HandoffError("DATA_LOSS", f"the KV stream of {self.request_id!r} ended before every needed "
                                            f"block arrived")
        return self.ack()

    def ack(self) -> kv_pb2.PushAck:
        return kv_pb2.PushAck(blocks_received=self.blocks, bytes_received=self.bytes)

    def fail(self, exc: HandoffError) -> None:
        """A refusal ends the request's transfer; a stranger cannot end someone else's request.
        Logged: a block that fails its MAC or its chain hash may be an attack on the path."""
        log.warning("KV of %r refused: %s: %s", self.request_id or "an unopened stream", exc.code, exc)
        if self.request_id and exc.code != "UNAUTHENTICATED":
            self.sink.fail(self.request_id, exc.code, str(exc))

    def cancelled(self) -> None:
        """The sender gave up (its stream was cancelled, or it said so)."""
        if self.request_id:
            self.sink.fail(self.request_id, "ABORTED", f"the KV of {self.request_id!r} was cancelled by its sender")


# ---- the frame intake: one inline frame of a stream-shaped receiver, in stream order ----

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
