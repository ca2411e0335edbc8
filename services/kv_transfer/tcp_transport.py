"""The prefill side of the raw TCP KV data plane (wire: tcp_wire.py; receiver: tcp_receiver.py).

One stream per request, written by its own thread: ``send`` queues the blocks and returns at
once; the thread encodes them (frames.iter_frame_parts: the payload stays a view of the blocks'
bytes), seals each frame's MAC in order and writes it with one gather write (``sendmsg``; the
kernel copies the payload, nothing else does), so the event loop does no per-byte work. The
connection comes from a per-target pool of authenticated connections (connected, TLS-wrapped
when the deployment has TLS files, and proved both ways once; reused across requests, dropped
when broken). One connection per transfer (``SendResult.streams`` 1): the MAC's frame counter
is one sequence per stream, and one TCP stream already fills the link where it was measured (a
raw socket's one stream: 9.4 MiB in 8.2 ms at 10 Gbit/s, the link's own time 7.9 ms;
bench/kv_handoff_hosts.py). What the hand-off lacks there is CPU (two cores), which more
streams would spend more of, not bandwidth.

A stream takes its connection when its first blocks come. Before that (its request queued on
the prefill worker) its heartbeats go as BEAT records over the pool's one beat connection per
target: a backlog of queued requests keeps its reservations alive without holding any of the
decode worker's connections (it serves at most ``max_connections``; one held per queued
request, a backlog past that bound had its streams refused and its reservations lapse).

Opened with a ``fallback`` (the prefill worker's gRPC stream to the same reservation), a stream
that cannot have the data plane when it first needs it (a beat or a connection that the receiver
refuses, that nobody answers, or whose handshake fails or times out) goes over that fallback
instead, for the whole transfer: nothing was sent on the data plane, so every block sent so far
is sent again there. The choice is made once, by the writer thread, and taken up by the loop's
next call.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import select
import socket
import ssl
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer import frames, tcp_wire
from pdserve.services.kv_transfer.base import (
    DEFAULT_FRAME_BYTES, FRAME_TARGET_BYTES, MAX_FRAME_BYTES, KVBlock, KVSender, KVStream, KVTransferError, SendResult,
)
from pdserve.services.kv_transfer.frames import encode_heartbeat, encode_open, iter_frame_parts
from pdserve.services.kv_transfer.wire_codec import CodecPolicy, encode_blocks

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0       # connect, TLS handshake and the token proof, each at most
SEND_TIMEOUT_S = 30.0         # one write may block this long (a receiver that stopped reading)
STREAM_IDLE_S = 300.0         # a stream given nothing (no send, heartbeat, finish) this long ends
MAX_IDLE_PER_TARGET = 8       # pooled connections kept per decode worker
POOLED_IDLE_S = 60.0          # ... each at most this long: well inside the receiver's idle timeout
                              # (tcp_receiver.DataPlaneLimits.idle_timeout_s, 120 s), so a reused one
                              # is not being closed by its peer at that moment
BUSY_RETRY_S = 10.0           # a receiver serving all the connections it may is asked again this long
HANDSHAKE_ATTEMPTS = 3        # connections lost during their handshake before a transfer gives up
BEAT_TIMEOUT_S = 2.0          # one beat's write, at most (a lease outlasts several missed ones)
MAX_GATHER_PARTS = 512        # a frame of more parts is joined first (IOV_MAX is 1024)
FALLBACK_LOG_S = 60.0         # transfers gone over the fallback are logged at most this often per target

_END, _CANCEL, _HEARTBEAT = object(), object(), object()


class _FallBack(Exception):
    """The stream could not have the data plane: its transfer goes over its fallback stream."""


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"KV data address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def send_parts(sock: socket.socket, parts: list) -> None:
    """parts written in order: one gather write where it can (a plain socket), else joined."""
    if isinstance(sock, ssl.SSLSocket) or len(parts) > MAX_GATHER_PARTS:
        sock.sendall(b"".join(parts))
        return
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + MAX_GATHER_PARTS])
        while sent and i < len(views):
            if sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
        while i < len(views) and not views[i].nbytes:
            i += 1


class ConnectionPool:
    """Authenticated connections per target, reused across transfers."""

    def __init__(self, cluster_token: str | bytes | None, tls: ssl.SSLContext | None,
                 max_idle: int = MAX_IDLE_PER_TARGET, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.key = tcp_wire.auth_key(cluster_token)
        self.tls, self.max_idle, self.connect_timeout_s = tls, max_idle, connect_timeout_s
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()
        self._beats: dict[str, socket.socket] = {}   # one connection per target carries every stream's beats
        self._beat_locks: dict[str, threading.Lock] = {}
        self._handshakes: dict[str, threading.BoundedSemaphore] = {}   # per target, tcp_wire.UNPROVED_PER_PEER
        self.connects = 0   # connections made (the rest of the transfers reused one)

    def acquire(self, target: str) -> socket.socket:
        return self._pooled(target) or self._connect(target)

    def _pooled(self, target: str) -> socket.socket | None:
        """An idle connection to target still good for use, if the pool has one."""
        with self._lock:
            idle = self._idle.get(target, [])
            while idle:
                sock, since = idle.pop()
                if time.monotonic() - since < POOLED_IDLE_S and _alive(sock):
                    return sock
                sock.close()
        return None

    def release(self, target: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(target, [])
            if len(idle) < self.max_idle:
                idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _connect(self, target: str) -> socket.socket:
        """A new proved connection; at most tcp_wire.UNPROVED_PER_PEER handshakes with target at
        once (the listener's bound on one address), each waiting connect_timeout_s at most for its turn."""
        host, port = split_address(target)
        with self._lock:
            turn = self._handshakes.setdefault(target, threading.BoundedSemaphore(tcp_wire.UNPROVED_PER_PEER))
        if not turn.acquire(timeout=self.connect_timeout_s):
            raise TimeoutError(f"no handshake turn with {target} within {self.connect_timeout_s:g}s")
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_hostname=host)
                tcp_wire.client_handshake(sock, self.key, target)
            except BaseException:
                sock.close()
                raise
        finally:
            turn.release()
        self.connects += 1
        return sock

    def beat(self, target: str, open_frame: bytes) -> bool:
        """A BEAT record (a stream's open frame: its reservation's lease is extended) over the
        target's one beat connection, remade here when lost: from an idle pooled connection where
        there is one (the receiver takes beats between transfers on any connection, and an idle one
        must not hold the slot a receiver at its connection bound has left for beats), else a new
        one. A beat that fails is dropped: the lease may then lapse, and the stream learns of it
        when it sends (False)."""
        with self._lock:   # one lock per target: a target that does not answer holds up only its own beats
            lock = self._beat_locks.setdefault(target, threading.Lock())
        with lock:
            with self._lock:
                sock = self._beats.pop(target, None)
            try:
                if sock is None or not _alive(sock):
                    if sock is not None:
                        sock.close()
                    sock = self.acquire(target)
                sock.settimeout(BEAT_TIMEOUT_S)
                sock.sendall(tcp_wire.record(tcp_wire.BEAT, open_frame))
            except (OSError, tcp_wire.WireError, tcp_wire.Refused) as exc:
                log.debug("KV beat to %s dropped: %s", target, exc)
                if sock is not None:
                    sock.close()
                return False
            with self._lock:
                self._beats[target] = sock
            return True

    def close(self) -> None:
        with self._lock:
            pools, self._idle = list(self._idle.values()), {}
            beats, self._beats = list(self._beats.values()), {}
        for idle in pools:
            for sock, _ in idle:
                sock.close()
        for sock in beats:
            sock.close()


def _alive(sock: socket.socket) -> bool:
    """An idle pooled connection the peer has not closed: nothing may arrive between transfers,
    so a readable one (EOF, a TLS close) is gone."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable and not (isinstance(sock, ssl.SSLSocket) and sock.pending())


class TcpKVStream(KVStream):
    takes_views = True
    def __init__(self, sender: "TcpKVSender", target: str, request_id: str, token: bytes,
                 fallback: Callable[[], KVStream] | None = None) -> None:
        """fallback: opens the same transfer's stream over another transport (on the loop), used
        when this one cannot have the data plane (the module's docstring); None: such a stream fails."""
        self._sender, self._target = sender, target
        self._fallback = fallback
        self._via: KVStream | None = None                 # the fallback stream, once chosen
        self._held: list[list[KVBlock]] | None = [] if fallback is not None else None   # sent before the choice
        self._choice = threading.Lock()
        self._forwarding: asyncio.Future | None = None    # a send to the fallback stream under way
        self._mac = frames.StreamMac(frames.mac_key(token, sender.cluster_token), frames.PREFERRED)
        self._open = encode_open(request_id, token, self._mac)
        self._codecs = sender.codecs if sender.codecs.mode != "off" else None
        self._codec: str | None = None if self._codecs is not None else "off"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._result: concurrent.futures.Future = concurrent.futures.Future()
        self._sock: socket.socket | None = None
        self._cancelled = False
        self._reading = threading.Lock()   # held while the writer reads the blocks' bytes
        self._blocks = self._bytes = self._wire_bytes = 0
        self._start = time.perf_counter()
        self._send_s = 0.0
        self._acked_at = 0.0
        threading.Thread(target=self._run, name=f"kv-send-{request_id[:24]}", daemon=True).start()

    # ---- the loop's side -----------------------------------------------------------------
    async def send(self, blocks: Sequence[KVBlock]) -> None:
        if not blocks:
            return
        if await self._fallen_back():
            await self._forward(list(blocks))
            return
        with self._choice:
            if self._held is not None:
                self._held.append(list(blocks))
        self._blocks += len(blocks)
        self._bytes += sum(b.data.numel() * b.data.element_size() for b in blocks)
        self._queue.put(list(blocks))

    async def heartbeat(self) -> None:
        if await self._fallen_back():
            await self._via.heartbeat()
        elif self._queue.empty():
            self._queue.put(_HEARTBEAT)

    async def finish(self, timeout: float | None = None) -> SendResult:
        if await self._fallen_back():
            return await self._via.finish(timeout)
        self._queue.put((_END, timeout))
        result = asyncio.wrap_future(self._result)
        result.add_done_callback(lambda f: f.cancelled() or f.exception())   # consumed, if we stop waiting
        began = time.monotonic()
        try:
            ack: kv_pb2.PushAck = await asyncio.wait_for(asyncio.shield(result), timeout)
        except _FallBack:
            await self._fallen_back()
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
            return await self._via.finish(left)
        except asyncio.TimeoutError as exc:
            await self.cancel()
            raise KVTransferError("DEADLINE_EXCEEDED", f"KV not acknowledged within {timeout}s") from exc
        except asyncio.CancelledError:
            await self.cancel()
            raise
        if ack.blocks_received != self._blocks:
            raise KVTransferError("DATA_LOSS", f"receiver acknowledged {ack.blocks_received} of {self._blocks} blocks")
        if self._codecs is not None and self._wire_bytes:
            self._codecs.observe(self._target, self._wire_bytes, self._send_s)
        return SendResult(ack.blocks_received, ack.bytes_received, self._acked_at - self._start,
                          self._wire_bytes, self._codec or "off", streams=1, acked_at=self._acked_at)

    async def cancel(self) -> None:
        """The connection is closed (the receiver fails the request as cancelled), not pooled.
        Returns once no block's bytes are being read (the frame being built, if any, is done)."""
        self._cancelled = True
        self._queue.put(_CANCEL)
        sock = self._sock
        if sock is not None and not self._result.done():
            _shutdown(sock)
        if self._via is not None:
            if self._forwarding is not None:   # its blocks' bytes are read until it returns
                await asyncio.wait({self._forwarding})
            await self._via.cancel()
        await asyncio.to_thread(self._wait_not_reading)

    async def _fallen_back(self) -> bool:
        """Whether the transfer goes over the fallback stream: opened here, on the loop, the first
        time the writer thread's choice is seen, and every send so far replayed there."""
        if self._via is not None:
            return True
        if not (self._result.done() and isinstance(self._result.exception(), _FallBack)):
            return False
        with self._choice:
            held, self._held = self._held or [], None
        self._via = self._fallback()
        self._sender.fell_back(self._target, self._result.exception())
        for blocks in held:
            await self._forward(blocks)
        return True

    async def _forward(self, blocks: list[KVBlock]) -> None:
        """A send over the fallback stream, never left halfway (its blocks may be views of pinned
        pool blocks: takes_views; cancel waits for it)."""
        while self._forwarding is not None and not self._forwarding.done():
            await asyncio.wait({self._forwarding})
        task = self._forwarding = asyncio.ensure_future(self._via.send(blocks))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # consumed, if we stop waiting
        await asyncio.shield(task)

    def _wait_not_reading(self) -> None:
        with self._reading:
            pass

    # ---- the writer thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._result.set_result(self._transfer())
        except _FallBack as exc:
            self._result.set_exception(exc)
        except KVTransferError as exc:
            self._result.set_exception(exc)
        except tcp_wire.Refused as exc:
            self._result.set_exception(KVTransferError(exc.code, str(exc)))
        except (OSError, tcp_wire.WireError) as exc:
            code = "CANCELLED" if self._cancelled else "UNAVAILABLE"
            self._result.set_exception(KVTransferError(code, f"KV data plane {self._target}: {exc}"))
        except BaseException as exc:   # noqa: BLE001 - the awaiting loop gets it
            self._result.set_exception(exc)

    def _transfer(self) -> kv_pb2.PushAck:
        first = self._first_data()
        sock = self._connection()
        with self._choice:
            self._held = None   # the data plane it is: nothing is kept for a fallback
        self._sock = sock
        try:
            ack = self._write(sock, first)
        except tcp_wire.Refused:
            sock.close()
            raise
        except (OSError, tcp_wire.WireError):
            refusal = _refusal(sock)   # the receiver's ERROR, when it said why before closing
            sock.close()
            if refusal is not None and not self._cancelled:
                raise refusal from None
            raise
        except BaseException:
            sock.close()
            raise
        self._sender.pool.release(self._target, sock)
        return ack

    def _next(self) -> object:
        try:
            item = self._queue.get(timeout=STREAM_IDLE_S)
        except queue.Empty:
            raise KVTransferError("DEADLINE_EXCEEDED", f"KV stream idle for {STREAM_IDLE_S:g}s") from None
        if self._cancelled or item is _CANCEL:
            raise KVTransferError("CANCELLED", "the KV stream was cancelled")
        return item

    def _first_data(self) -> object:
        """The first blocks (or the end). Until they come the stream holds no connection: a
        request queued on its prefill worker keeps its reservation alive with beats alone."""
        while (item := self._next()) is _HEARTBEAT:
            if not self._sender.pool.beat(self._target, self._open) and self._fallback is not None:
                raise _FallBack("its beat could not go over the data plane")
        return item

    def _connection(self) -> socket.socket:
        """A pooled or new connection. A receiver at its connection bound (a refusal, not a
        fault) is asked again, the lease kept by beats meanwhile, for up to BUSY_RETRY_S. A
        connection lost during its handshake (this process frozen past the receiver's handshake
        timeout, say) is made again, up to HANDSHAKE_ATTEMPTS times: nothing was sent on it.
        Nobody listening (connection refused) fails at once. With a fallback, any of these
        sends the transfer over it at once (_FallBack)."""
        deadline, delay, lost = time.monotonic() + BUSY_RETRY_S, 0.02, 0
        while True:
            try:
                return self._sender.pool.acquire(self._target)
            except (OSError, tcp_wire.WireError, tcp_wire.Refused) as exc:
                if self._fallback is not None and not self._cancelled:
                    raise _FallBack(f"{type(exc).__name__}: {exc}") from exc
                if isinstance(exc, tcp_wire.Refused):
                    if exc.code != "RESOURCE_EXHAUSTED" or self._cancelled or time.monotonic() + delay > deadline:
                        raise
                elif isinstance(exc, ConnectionRefusedError):
                    raise
                else:
                    lost += 1
                    if lost >= HANDSHAKE_ATTEMPTS or self._cancelled:
                        raise
            self._sender.pool.beat(self._target, self._open)
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def _write(self, sock: socket.socket, first: object) -> kv_pb2.PushAck:
        sock.settimeout(SEND_TIMEOUT_S)
        self._frame(sock, [self._open])
        frame_bytes, target = self._sender.frame_bytes, min(self._sender.frame_target, self._sender.frame_bytes)
        item: object | None = first
        while True:
            if item is None:
                item = self._next()
            t0 = time.perf_counter()
            if item is _HEARTBEAT:
                self._frame(sock, [encode_heartbeat(self._mac)])
            elif isinstance(item, tuple):   # (_END, timeout)
                sock.sendall(tcp_wire.record(tcp_wire.END))
                self._send_s += time.perf_counter() - t0
                sock.settimeout(item[1])
                ack = kv_pb2.PushAck.FromString(tcp_wire.expect_ack(sock))
                self._acked_at = time.perf_counter()   # not when the loop wakes to it
                return ack
            else:
                if self._codec is None:
                    self._codec = self._codecs.mode if self._codecs.mode != "auto" else self._codecs.pick(
                        self._target, item[0])
                # uncompressed blocks are encoded as their frame is built: the first frame leaves
                # once its own blocks are encoded, not the whole send's. The blocks' bytes (maybe
                # views of pinned pool blocks: takes_views) are read only under _reading.
                with self._reading:
                    self._check_cancelled()
                    encoded = (b.encode() for b in item) if self._codec == "off" else encode_blocks(item, self._codec)
                frames = iter_frame_parts(self._counted(encoded), frame_bytes, self._mac, target)
                while True:
                    with self._reading:
                        self._check_cancelled()
                        parts = next(frames, None)   # encoding copies a view's bytes out of the pool
                    if parts is None:
                        break
                    self._frame(sock, parts)
            self._send_s += time.perf_counter() - t0
            item = None

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise KVTransferError("CANCELLED", "the KV stream was cancelled")

    def _counted(self, encoded: Iterable[tuple[kv_pb2.KVBlockHeader, memoryview]]
                 ) -> Iterator[tuple[kv_pb2.KVBlockHeader, memoryview]]:
        for header, payload in encoded:
            self._wire_bytes += memoryview(payload).nbytes
            yield header, payload

    @staticmethod
    def _frame(sock: socket.socket, parts: list) -> None:
        length = sum(memoryview(p).nbytes for p in parts)
        send_parts(sock, [tcp_wire.HEADER.pack(tcp_wire.FRAME, length), *parts])


def _refusal(sock: socket.socket) -> tcp_wire.Refused | None:
    try:
        sock.settimeout(0.5)
        kind, body = tcp_wire.read_small(sock)
    except (OSError, tcp_wire.WireError):
        return None
    return tcp_wire.parse_error(body) if kind == tcp_wire.ERROR else None


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class TcpKVSender(KVSender):
    """Streams to decode workers' raw TCP data planes (their ReserveResponse.data_address)."""

    def __init__(self, *, cluster_token: str | bytes | None = None, tls: ssl.SSLContext | None = None,
                 frame_bytes: int = DEFAULT_FRAME_BYTES, frame_target: int = FRAME_TARGET_BYTES,
                 kv_compression: str = "off") -> None:
        """cluster_token: the deployment's (it keys the handshake and every frame's MAC, as over
        gRPC). tls: a client context (tcp_wire.client_context) from the deployment's mTLS files."""
        if not 0 < frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"kv frame_bytes must be in (0, {MAX_FRAME_BYTES}], got {frame_bytes}")
        if not 0 < frame_target:
            raise ValueError(f"kv frame_target must be > 0, got {frame_target}")
        self.cluster_token = cluster_token
        self.frame_bytes, self.frame_target = frame_bytes, frame_target
        self.codecs = CodecPolicy(kv_compression)
        self.pool = ConnectionPool(cluster_token, tls)
        self.fallbacks = 0   # transfers that went over their fallback stream
        self._fallback_logged: dict[str, float] = {}

    def open(self, target: str, request_id: str, transfer_token: bytes,
             fallback: Callable[[], KVStream] | None = None) -> KVStream:
        """fallback: opens the transfer's stream over another transport (gRPC), taken when this
        plane cannot be had (TcpKVStream)."""
        return TcpKVStream(self, target, request_id, transfer_token, fallback)

    def fell_back(self, target: str, why: BaseException) -> None:
        """A transfer to target went over its fallback: counted, and logged at most every FALLBACK_LOG_S."""
        self.fallbacks += 1
        now = time.monotonic()
        if now - self._fallback_logged.get(target, -FALLBACK_LOG_S) >= FALLBACK_LOG_S:
            self._fallback_logged[target] = now
            log.warning("KV to %s goes over gRPC: its TCP data plane could not be had (%s; %d transfers so far)",
                        target, why, self.fallbacks)

    async def close(self) -> None:
        self.pool.close()
