"""KV block transport over gRPC (``pdserve.v1.KVTransfer/PushBlocks``); wire format in kv.proto.

One client-streaming call per request. The sender packs whole blocks into frames (up to
``frame_target`` payload bytes of whole blocks, at most ``frame_bytes``: a larger block spans
several), encoded by hand so the payload is copied once (the header messages are ordinary
protobuf) and sealed one by one in a worker thread, each queued as soon as it is sealed: a
writer task sends them meanwhile, so building overlaps sending and ``send`` never waits for the
network (the prefill side streams its first token meanwhile).

The receiver (grpc_receiver.py) parses frames without a protobuf copy of the payload and writes
a frame's whole blocks into the pool straight from the message. Both sides interoperate with
plain generated stubs: the hand encoding is the standard protobuf wire format.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable, Sequence

import grpc

from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer import frames, shared_memory
from pdserve.services.kv_transfer.frames import (encode_heartbeat,
    encode_open,
    encode_probe,
    encode_shm_frames,
    iter_wire_frames)
from pdserve.services.kv_transfer.grpc_receiver import SERVICE, SHM_PROBE_BYTES
from pdserve.services.kv_transfer.wire_codec import CodecPolicy, encode_blocks
from pdserve.services.kv_transfer.shared_memory import SHARED_MEMORY_MAX_BYTES, available as shared_memory_available
from pdserve.services.kv_transfer.base import (
    DEFAULT_FRAME_BYTES, FRAME_TARGET_BYTES, MAX_FRAME_BYTES, KVBlock, KVSender, KVStream, KVTransferError, SendResult,
)

log = logging.getLogger(__name__)

METHOD = f"/{SERVICE}/PushBlocks"
FRAME_OVERHEAD_BYTES = 64 << 10    # room for headers and framing in one message

# Smaller sends stay in the stream: a segment's create/map/unlink costs more than it saves there
# (bench/kv_handoff.py on a 2-core AVX2 EPYC: 0.12 MiB 4.2 ms through a segment against 3.7 ms
# inline; 2 MiB 8.7 against 13.2 ms; 8 MiB 33 against 39 ms).
SHARED_MEMORY_MIN_BYTES = 1 << 20
SHM_PROBE_TIMEOUT_S = 5.0
SHM_SWEEP_INTERVAL_S = 30.0           # how often a sender removes segments older than any lease
# A send this large copies and MACs its frames in a thread (under the send lock, so MACs keep
# their counter order): the worker's event loop goes on serving its other streams meanwhile.
OFF_LOOP_BYTES = 1 << 20


def grpc_message_limit(frame_bytes: int = DEFAULT_FRAME_BYTES) -> int:
    """The gRPC message size that frames of ``frame_bytes`` need."""
    return frame_bytes + FRAME_OVERHEAD_BYTES


# ---- sender ------------------------------------------------------------------------------

class SharedMemoryRoute:
    """A sender's use of shared memory: which loopback peers share it with us (each probed once,
    on the first send big enough), and a cap on the payload bytes in live segments. Any failure
    means inline frames, never a failed send."""

    def __init__(self, directory: str = shared_memory.SHM_DIR, min_bytes: int = SHARED_MEMORY_MIN_BYTES,
                 max_bytes: int = SHARED_MEMORY_MAX_BYTES, sweep_after_s: float | None = None) -> None:
        if min_bytes < 0 or max_bytes < 0:
            raise ValueError(f"shared memory min_bytes and max_bytes must be >= 0, got {min_bytes}, {max_bytes}")
        self.directory, self.min_bytes, self.max_bytes = directory, min_bytes, max_bytes
        self.sweep_after_s = sweep_after_s
        self.in_flight = 0
        self._peers: dict[str, bool | asyncio.Task[bool]] = {}
        self._sweeper: asyncio.Task | None = None

    def reserve(self, nbytes: int) -> bool:
        if self.in_flight + nbytes > self.max_bytes:
            return False
        self.in_flight += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.in_flight = max(0, self.in_flight - nbytes)

    def disable(self, target: str, why: str) -> None:
        if self._peers.get(target) is not False:
            log.warning("KV to %s goes inline from now on: %s", target, why)
        self._peers[target] = False

    async def usable(self, target: str, method: Any, metadata: Callable[[], tuple[tuple[str, str], ...]]) -> bool:
        """Whether target shares our shared-memory directory: probed once, concurrent callers wait
        for the same probe."""
        self._start_sweeper()
        known = self._peers.get(target)
        if isinstance(known, bool):
            return known
        if known is None:
            known = self._peers[target] = asyncio.ensure_future(self._probe(target, method, metadata))
        ok = await asyncio.shield(known)
        if self._peers.get(target) is known:
            self._peers[target] = ok
        return ok

    async def _probe(self, target: str, method: Any, metadata: Callable[[bytes], tuple[tuple[str, str], ...]]) -> bool:
        """Write a small segment and have target take it: it shares our memory when the call
        succeeds and the segment is gone from our directory (the receiver unlinks what it maps).
        metadata: the probe call's, made when the call is (a proof is fresh for a while only) for
        its one message."""
        try:
            name = shared_memory.write_segment([memoryview(os.urandom(SHM_PROBE_BYTES))], self.directory)
        except OSError as exc:
            log.warning("KV to %s goes inline: shared memory not writable (%s)", target, exc)
            return False
        try:
            probe = encode_probe(name, SHM_PROBE_BYTES)
            await method(iter([probe]), timeout=SHM_PROBE_TIMEOUT_S, metadata=metadata(probe) or None,
                         wait_for_ready=True)
            taken = not os.path.exists(os.path.join(self.directory, name))
            if not taken:
                log.warning("KV to %s goes inline: it cannot see our shared memory", target)
            return taken
        except grpc.aio.AioRpcError as exc:
            log.warning("KV to %s goes inline: shared memory probe answered %s: %s", target, exc.code().name,
                        exc.details())
            return False
        finally:
            shared_memory.remove(name, self.directory)

    def _start_sweeper(self) -> None:
        if self.sweep_after_s is not None and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_loop(self.sweep_after_s))

    async def _sweep_loop(self, older_than_s: float) -> None:
        """Remove segments no live hand-off can own (a sender killed between write and take)."""
        while True:
            await asyncio.sleep(min(SHM_SWEEP_INTERVAL_S, max(1.0, older_than_s / 2)))
            try:
                shared_memory.sweep(older_than_s, self.directory)
            except OSError as exc:
                log.warning("shared memory sweep of %s: %s", self.directory, exc)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


class GrpcKVStream(KVStream):
    def __init__(self, start_call: "Callable[[bytes], Awaitable[tuple[grpc.aio.StreamUnaryCall, Any]]]",
                 request_id: str, token: bytes, frame_bytes: int,
                 shared: "tuple[SharedMemoryRoute, str, Any, Callable] | None" = None,
                 cluster_token: str | bytes | None = None, codecs: CodecPolicy | None = None,
                 target: str = "", frame_target: int = FRAME_TARGET_BYTES) -> None:
        """start_call(first frame): makes the call once its channel is connected, with a fresh proof
        of membership bound to that frame (a proof minted before a long wait, say this process
        frozen while connecting, would be refused as stale): (call, its
        services.common.security.CallProof, whose reply the receiver must send before any frame goes
        out; None: nothing to check).
        frame_target: frames hold whole blocks up to this many payload bytes (frames.iter_wire_frames).
        shared: (route, target, method, metadata maker) when sends to this loopback target may go
        through shared memory (None: never).
        cluster_token: keys every frame's MAC with the transfer token (frames.py). codecs: the
        inline frames' wire codec for target, chosen on the first send, and the link estimate this
        stream's send phase feeds (None: uncompressed)."""
        self._codecs, self._target = codecs, target
        self._codec: str | None = None if codecs is not None else "off"
        self._send_lock = asyncio.Lock()
        self._wire_bytes = self._inline_bytes = 0
        self._busy_s = 0.0                 # the writer's time in writes: the send phase (with the ack wait)
        self._closed_at: float | None = None
        self._mac = frames.StreamMac(frames.mac_key(token, cluster_token), frames.PREFERRED)
        self._start_call = start_call
        self._call: grpc.aio.StreamUnaryCall | None = None   # made by the writer (start_call)
        self._proof: Any = None
        self._call_made = asyncio.Event()
        self._frame_bytes = frame_bytes
        self._frame_target = frame_target
        self._abandoned = False            # cancelled: a send still building in its thread stops
        self._shared = shared
        self._used_shm = False
        self._segments: list[str] = []   # written, maybe not yet taken by the receiver
        self._segment_bytes = 0
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._open = encode_open(request_id, token, self._mac)   # the first frame: its proof names it
        self._queue.put_nowait(self._open)
        self._blocks = self._bytes = 0
        self._start = time.perf_counter()
        self._writer = asyncio.create_task(self._write_loop())

    async def _write_loop(self) -> None:
        self._call, self._proof = await self._start_call(self._open)
        self._call_made.set()
        if self._proof is not None and not self._proof.verify(await self._call.initial_metadata()):
            self._call.cancel()   # not a member of the deployment: it gets no KV
            return
        while True:
            frame = await self._queue.get()
            t0 = time.perf_counter()
            if frame is None:
                await self._call.done_writing()
                self._closed_at = time.perf_counter()
                return
            await self._call.write(frame)
            self._busy_s += time.perf_counter() - t0

    async def send(self, blocks: Sequence[KVBlock]) -> None:
        async with self._send_lock:   # frames leave in send order (encoding awaits a thread)
            await self._send(blocks)

    async def _send(self, blocks: Sequence[KVBlock]) -> None:
        nbytes = sum(b.data.numel() * b.data.element_size() for b in blocks)
        frames = await self._shm_frames(blocks, nbytes) if self._shared is not None else None
        if frames is not None:
            wire = nbytes
        else:
            if self._codec is None and blocks:   # auto may measure the codec's cost: off the loop
                self._codec = (self._codecs.mode if self._codecs.mode != "auto" else
                               await asyncio.to_thread(self._codecs.pick, self._target, blocks[0]))
            codec, frame_bytes, mac = self._codec, self._frame_bytes, self._mac
            target = min(self._frame_target, frame_bytes)
            loop = asyncio.get_running_loop()

            def build(put: Callable[[bytes], None]) -> int:
                encoded = ([b.encode() for b in blocks] if codec in (None, "off") else encode_blocks(blocks, codec))
                for frame in iter_wire_frames(encoded, frame_bytes, mac, target):
                    if self._abandoned:
                        break
                    put(frame)   # each frame leaves as soon as it is sealed: building overlaps sending
                return sum(memoryview(p).nbytes for _, p in encoded)

            def put_threadsafe(frame: bytes) -> None:
                try:
                    loop.call_soon_threadsafe(self._queue.put_nowait, frame)
                except RuntimeError:   # the loop closed under a cancelled send: nothing is waiting
                    self._abandoned = True
            # CPU work off the loop when it is large; sealed in counter order either way (the send
            # lock), queued in that order (call_soon_threadsafe keeps it)
            if nbytes < OFF_LOOP_BYTES and codec in (None, "off"):
                wire = build(self._queue.put_nowait)
            else:
                wire = await asyncio.to_thread(build, put_threadsafe)
            self._inline_bytes += wire
            frames = ()
        for frame in frames:
            self._queue.put_nowait(frame)
        self._blocks += len(blocks)
        self._bytes += nbytes
        self._wire_bytes += wire

    async def _shm_frames(self, blocks: Sequence[KVBlock], nbytes: int) -> list[bytes] | None:
        """The blocks' frames through shared memory, or None: inline (a small send, a peer that
        does not share our memory, the cap on bytes in segments reached, or a failed write)."""
        route, target, method, metadata = self._shared
        if nbytes < route.min_bytes or not await route.usable(target, method, metadata):
            return None
        if not route.reserve(nbytes):
            return None
        try:
            frames, names = encode_shm_frames(blocks, route.directory, self._mac)
        except OSError as exc:
            route.release(nbytes)
            log.warning("KV of %d bytes to %s goes inline: shared memory write failed (%s)", nbytes, target, exc)
            return None
        self._segments += names
        self._segment_bytes += nbytes
        self._used_shm = True
        return frames

    async def heartbeat(self) -> None:
        async with self._send_lock:   # its MAC takes the next counter: after a send being sealed
            if self._queue.empty():
                self._queue.put_nowait(encode_heartbeat(self._mac))

    async def _acknowledgement(self) -> kv_pb2.PushAck:
        """The receiver's answer, once the writer has made the call (its error if it failed first)."""
        if self._call is None:
            made = asyncio.ensure_future(self._call_made.wait())
            try:
                await asyncio.wait({made, self._writer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                made.cancel()
            if self._call is None:
                self._writer.result()   # raises what stopped it
                raise KVTransferError("UNAVAILABLE", "the KV stream ended before its call was made")
        return await asyncio.shield(self._call)

    async def finish(self, timeout: float | None = None) -> SendResult:
        self._queue.put_nowait(None)
        try:
            ack: kv_pb2.PushAck = await asyncio.wait_for(self._acknowledgement(), timeout)
        except grpc.aio.AioRpcError as exc:
            if self._used_shm and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._shared[0].disable(self._shared[1], exc.details() or "")   # the retry goes inline
            raise KVTransferError(exc.code().name, exc.details() or "") from exc
        except asyncio.TimeoutError as exc:
            await self.cancel()
            raise KVTransferError("DEADLINE_EXCEEDED", f"KV not acknowledged within {timeout}s") from exc
        except asyncio.CancelledError:
            if self._proof is None or self._proof.verify(await self._call.initial_metadata()):
                raise
        finally:
            self._reap_writer()
            self._remove_segments()
        if self._proof is not None and not self._proof.verify(await self._call.initial_metadata()):
            raise KVTransferError("UNAUTHENTICATED", "the KV receiver did not prove it is a member of the deployment")
        if ack.blocks_received != self._blocks:
            raise KVTransferError("DATA_LOSS", f"receiver acknowledged {ack.blocks_received} of {self._blocks} blocks")
        now = time.perf_counter()
        if self._codecs is not None and self._inline_bytes and not self._used_shm:   # the link, not /dev/shm
            self._codecs.observe(self._target, self._inline_bytes,
                                 self._busy_s + (now - self._closed_at if self._closed_at is not None else 0.0))
        return SendResult(ack.blocks_received, ack.bytes_received, now - self._start, self._wire_bytes,
                          self._codec or "off")

    async def cancel(self) -> None:
        self._abandoned = True
        self._reap_writer()
        if self._call is not None:
            self._call.cancel()
        self._remove_segments()

    def _remove_segments(self) -> None:
        """Segments the receiver did not take (it unlinks those it maps) must not outlive the stream."""
        segments, self._segments = self._segments, []
        if self._shared is not None:
            self._shared[0].release(self._segment_bytes)
            self._segment_bytes = 0
            for name in segments:
                shared_memory.remove(name, self._shared[0].directory)

    def _reap_writer(self) -> None:
        """Stop the writer; a write that failed because the receiver ended the call is expected
        (the call's status says why), so its exception is consumed here."""
        if not self._writer.done():
            self._writer.cancel()
        elif not self._writer.cancelled():
            self._writer.exception()


class GrpcKVSender(KVSender):
    """One channel per decode worker (made by ``channel_factory``, which adds credentials)."""

    def __init__(self, channel_factory: Callable[[str], grpc.aio.Channel], *,
                 frame_bytes: int = DEFAULT_FRAME_BYTES, metadata: tuple[tuple[str, str], ...] = (),
                 shared_memory: bool = False, shared_memory_min_bytes: int = SHARED_MEMORY_MIN_BYTES,
                 shared_memory_route: SharedMemoryRoute | None = None,
                 proof: Callable[[str, str, bytes], Any] | None = None, cluster_token: str | bytes | None = None,
                 kv_compression: str = "off", frame_target: int = FRAME_TARGET_BYTES) -> None:
        """frame_target: whole blocks per frame up to this many payload bytes (frames.iter_wire_frames).
        cluster_token: the deployment's (Credentials.cluster_token), which keys every frame's MAC
        with the reservation's transfer token; None (--insecure-no-auth) keys by the transfer token
        alone, which guards against accidents only (frames.py). metadata: sent on every stream.
        proof: (method, target, first frame) -> a fresh services.common.security.CallProof for each
        stream (when the factory's channels do not prove membership themselves); the receiver's
        reply is checked before any KV leaves. shared_memory: payloads to a loopback target that shares our
        memory, in sends of at least shared_memory_min_bytes, go through /dev/shm (or the route's
        directory and cap: shared_memory_route). kv_compression: the inline frames' wire codec,
        "auto" chosen per target (wire_codec.py); shared-memory frames are never encoded."""
        self.codecs = CodecPolicy(kv_compression)
        route = shared_memory_route or SharedMemoryRoute(min_bytes=shared_memory_min_bytes)
        self.shared_memory = shared_memory and shared_memory_available(route.directory)
        self.route = route if self.shared_memory else None
        if not 0 < frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"kv frame_bytes must be in (0, {MAX_FRAME_BYTES}], got {frame_bytes}")
        if not 0 < frame_target:
            raise ValueError(f"kv frame_target must be > 0, got {frame_target}")
        self.frame_bytes, self.frame_target = frame_bytes, frame_target
        self.metadata = metadata
        self.proof = proof
        self.cluster_token = cluster_token
        self._channel_factory = channel_factory
        self._channels: dict[str, tuple[grpc.aio.Channel, Any]] = {}

    def _channel(self, target: str) -> tuple[grpc.aio.Channel, Any]:
        """target's channel (made once) and its PushBlocks method."""
        entry = self._channels.get(target)
        if entry is None:
            channel = self._channel_factory(target)
            method = channel.stream_unary(METHOD, request_serializer=lambda b: b,
                                          response_deserializer=kv_pb2.PushAck.FromString)
            entry = self._channels[target] = (channel, method)
        return entry

    def open(self, target: str, request_id: str, transfer_token: bytes) -> KVStream:
        channel, method = self._channel(target)

        def metadata(first: bytes) -> tuple[tuple[str, str], ...]:   # a fresh proof for each call: each is used once
            return self.proof(METHOD, target, first).metadata if self.proof is not None else self.metadata

        async def start_call(first: bytes) -> tuple[grpc.aio.StreamUnaryCall, Any]:
            # The channel connected first, then the proof minted: it is fresh when the receiver
            # checks it. wait_for_ready: a connection lost meanwhile is waited for instead of
            # failing the stream; finish() bounds the whole transfer.
            await channel.channel_ready()
            proof = self.proof(METHOD, target, first) if self.proof is not None else None
            return method(wait_for_ready=True, metadata=(proof.metadata if proof else self.metadata) or None), proof

        shared = (self.route, target, method, metadata) if self.route is not None and shared_memory.is_local(target) \
            else None
        return GrpcKVStream(start_call, request_id, transfer_token, self.frame_bytes, shared, self.cluster_token,
                            self.codecs if self.codecs.mode != "off" else None, target, self.frame_target)

    async def close(self) -> None:
        if self.route is not None:
            await self.route.close()
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close()
