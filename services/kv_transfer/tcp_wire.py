"""The raw TCP KV data plane's wire: records, the mutual handshake, and TLS contexts. Shared by
its receiver (tcp_receiver.py) and its sender (tcp_transport.py).

After a TCP (or mutual-TLS) connection opens, both ends prove they hold the deployment's
cluster token before anything else is read: the receiver sends ``MAGIC + server_nonce``, the
sender answers ``MAGIC + client_nonce + HMAC(key, CLIENT_CONTEXT + both nonces)``, and the
receiver, once that proof checks, answers with an OK record holding ``HMAC(key, SERVER_CONTEXT
+ both nonces)`` (or an ERROR record, then closes). The key is HMAC-SHA256(cluster token,
AUTH_CONTEXT): the token never travels, the nonces make every proof single-use, both proofs
also cover the listener's HOST:PORT as the sender dialed it (a relay to another listener fails), and the
distinct contexts keep one side's proof from serving as the other's. Without a cluster token
(``--insecure-no-auth``, loopback only) the key is derived from AUTH_CONTEXT alone: the same
exchange, which then only guards against a misdirected connection.

Then records, each ``kind (1 byte) + length (4 bytes, little-endian) + body``; every length is
checked against its kind's bound before anything is allocated. A connection carries one
transfer at a time: FRAME records (the KVFrame wire encoding of frames.py, each MACed per
reservation as over gRPC), then END; the receiver answers ACK (a PushAck) or ERROR (code and
message), and the connection may carry the next transfer. An ERROR ends the connection.
Between transfers a BEAT record (one stream's open frame) extends that reservation's lease: a
request queued on its prefill worker holds no connection, only its lease, kept by beats that
share one connection per decode worker.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import struct
import time
from typing import Callable

from pdserve.services.kv_transfer.base import MAX_FRAME_BYTES

MAGIC = b"PDKVTCP1"
# Connections from one peer address that a listener lets prove themselves at once (its default);
# a sender handshakes with one target at most this many at a time, so a burst of transfers waits
# for a place instead of being turned away to its fallback.
UNPROVED_PER_PEER = 4
NONCE_BYTES = 32
PROOF_BYTES = 32
AUTH_CONTEXT = b"pdserve-kv-tcp-auth-v1"
CLIENT_CONTEXT = b"pdserve-kv-tcp-client-proof-v2"   # v2: both proofs name the listener dialed (HOST:PORT)
SERVER_CONTEXT = b"pdserve-kv-tcp-server-proof-v2"

FRAME, END, ACK, ERROR, OK, BEAT = 1, 2, 3, 4, 5, 6
HEADER = struct.Struct("<BI")
MAX_RECORD_BYTES = MAX_FRAME_BYTES + (64 << 10)   # a frame's payload plus room for its headers
MAX_STATUS_BYTES = 8 << 10                       # an ACK, ERROR or OK record's body, at most
RECORD_LIMITS = {FRAME: MAX_RECORD_BYTES, END: 0, ACK: MAX_STATUS_BYTES, ERROR: MAX_STATUS_BYTES,
                 OK: PROOF_BYTES, BEAT: MAX_STATUS_BYTES}


class WireError(Exception):
    """The peer broke the protocol or went away (the connection is unusable)."""


class Closed(WireError):
    """The peer closed the connection."""


class Refused(Exception):
    """The peer answered ERROR: ``code`` is the gRPC status name, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def auth_key(cluster_token: str | bytes | None) -> bytes:
    if cluster_token:
        secret = cluster_token.encode() if isinstance(cluster_token, str) else cluster_token
        return hmac.new(secret, AUTH_CONTEXT, hashlib.sha256).digest()
    return hmac.new(AUTH_CONTEXT, b"", hashlib.sha256).digest()


def _proof(key: bytes, context: bytes, server_nonce: bytes, client_nonce: bytes, target: str = "") -> bytes:
    """target: the listener's HOST:PORT as the sender dials it (a relay to another listener fails)."""
    return hmac.new(key, context + server_nonce + client_nonce + target.lower().encode(), hashlib.sha256).digest()


# ---- records ------------------------------------------------------------------------------

def until(sock: socket.socket, deadline: float | None) -> None:
    """Before a wait: sock's timeout set to what is left until deadline (time.monotonic()), or
    socket.timeout once it has passed, however the bytes before it dripped. None: as it is."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("the KV data-plane handshake did not complete in time")
    sock.settimeout(left)


def recv_exact(sock: socket.socket, view: memoryview, patience: Callable[[], bool] | None = None,
               deadline: float | None = None) -> None:
    """Fill view from sock (Closed at EOF). The socket's timeout bounds each wait; when one runs
    out, patience() says whether to go on waiting (None: never; socket.timeout is raised).
    deadline: every wait ends by then (until), the whole fill included."""
    got = 0
    while got < view.nbytes:
        until(sock, deadline)
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            if patience is None or not patience():
                raise
            continue
        if not n:
            raise Closed("the peer closed the connection")
        got += n


def read_header(sock: socket.socket, at_start: bool = False,
                patience: Callable[[], bool] | None = None) -> tuple[int, int] | None:
    """The next record's (kind, length), its length checked against its kind's bound. None: the
    peer closed cleanly before a record began (at_start only, which waits without patience)."""
    head = bytearray(HEADER.size)
    view = memoryview(head)
    if at_start:
        n = sock.recv_into(view)
        if not n:
            return None
        if n < HEADER.size:
            recv_exact(sock, view[n:], patience)
    else:
        recv_exact(sock, view, patience)
    return _checked(head)


class RecordReader:
    """A connection's records as the receiver reads them: each body is read together with as much
    of the next record's header as has already arrived (never waiting for it), so a frame costs
    one receive and the END after a transfer's last frame is in hand with it (its ACK goes out
    without another wait on the socket, and without giving up the GIL to a busy thread first).
    One body buffer, grown to the largest record seen (each length checked against its kind's
    bound first), never shrunk; a body's view is valid until the next body is read.

    A body may also be read in steps: ``body_head`` (its first bytes, as many as wanted), then
    ``body_rest`` (the rest into the buffer) or ``body_rest_into`` (a stretch of it straight into
    the caller's buffers, say the paged KV pool's blocks: one copy, the kernel's, from socket
    to pool; plain sockets only, ``scatters``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.scatters = hasattr(sock, "recvmsg_into") and not isinstance(sock, ssl.SSLSocket)
        self._buffer = bytearray()
        self._ahead = b""   # the start of the next record's header, read along with a body
        self._length = self._got = 0   # the body being read, and how much of it is in the buffer

    def header(self, at_start: bool = False, patience: Callable[[], bool] | None = None
               ) -> tuple[int, int] | None:
        """As read_header, starting from the bytes already read ahead."""
        head = bytearray(HEADER.size)
        got = len(self._ahead)
        head[:got], self._ahead = self._ahead, b""
        view = memoryview(head)
        if at_start and not got:
            got = self.sock.recv_into(view)
            if not got:
                return None
        if got < HEADER.size:
            recv_exact(self.sock, view[got:], patience)
        return _checked(head)

    def body(self, length: int, patience: Callable[[], bool] | None = None) -> memoryview:
        """The record's length bytes (length was checked by header)."""
        self._begin(length)
        return self.body_rest(patience)

    def body_head(self, length: int, want: int, patience: Callable[[], bool] | None = None) -> memoryview:
        """The first bytes of a body of length bytes, at least want more of them than before (or all
        that remain): call again for more, then body_rest or body_rest_into."""
        if not self._length:
            self._begin(length)
        upto = min(self._length, self._got + want)
        view = memoryview(self._buffer)
        while self._got < upto:
            self._got += self._receive(lambda: self.sock.recv_into(view[self._got:upto]), patience)
        return view[:self._got]

    def body_rest(self, patience: Callable[[], bool] | None = None) -> memoryview:
        """The whole body, its rest read into the buffer (with the next header's start, as body)."""
        length, got = self._length, self._got
        view = memoryview(self._buffer)[:length + HEADER.size]
        while got < length:
            got += self._receive(lambda: self.sock.recv_into(view[got:]), patience)
        self._ahead = bytes(view[length:got])
        self._length = self._got = 0
        return view[:length]

    def body_rest_into(self, start: int, views: list[memoryview],
                       patience: Callable[[], bool] | None = None) -> memoryview:
        """The body from byte start on: the first sum(views) bytes into views, in order (those
        body_head already read are copied there), the rest (the trailer) into a small buffer,
        which is returned. scatters must hold."""
        length, got = self._length, self._got
        into = sum(v.nbytes for v in views)
        trailer = bytearray(length - start - into + HEADER.size)
        buffered = memoryview(self._buffer)[start:got]
        views = list(views)
        copied = _fill(views, buffered)
        tail = buffered[copied:]
        trailer[:tail.nbytes] = tail
        tgot, need = tail.nbytes, len(trailer) - HEADER.size
        room = memoryview(trailer)
        while views or tgot < need:
            targets = views[:MAX_SCATTER] if len(views) >= MAX_SCATTER else [*views, room[tgot:]]
            n = self._receive(lambda: self.sock.recvmsg_into(targets)[0], patience)
            n -= _advance(views, n)
            tgot += n
        self._ahead = bytes(room[need:tgot])
        self._length = self._got = 0
        return room[:need]

    def _begin(self, length: int) -> None:
        room = length + HEADER.size
        if len(self._buffer) < room:
            self._buffer = bytearray(room)
        self._length, self._got = length, 0

    @staticmethod
    def _receive(receive: Callable[[], int], patience: Callable[[], bool] | None) -> int:
        """receive() once it returns bytes (Closed at EOF); a timeout asks patience, as recv_exact."""
        while True:
            try:
                n = receive()
            except socket.timeout:
                if patience is None or not patience():
                    raise
                continue
            if not n:
                raise Closed("the peer closed the connection")
            return n


MAX_SCATTER = 1000   # buffers per receive (IOV_MAX is 1024)


def _fill(views: list[memoryview], data: memoryview) -> int:
    """Copy data into the front of views, dropping each as it fills; returns the bytes copied."""
    done = 0
    while views and done < data.nbytes:
        take = min(views[0].nbytes, data.nbytes - done)
        views[0][:take] = data[done:done + take]
        done += take
        _advance(views, take)
    return done


def _advance(views: list[memoryview], n: int) -> int:
    """Drop n received bytes from the front of views (fewer if they run out); returns how many."""
    used = 0
    while views and used < n:
        head = views[0]
        if head.nbytes <= n - used:
            used += head.nbytes
            views.pop(0)
        else:
            views[0] = head[n - used:]
            used = n
    return used


def _checked(head: bytes | bytearray) -> tuple[int, int]:
    kind, length = HEADER.unpack(head)
    limit = RECORD_LIMITS.get(kind)
    if limit is None:
        raise WireError(f"unknown KV record kind {kind}")
    if length > limit:
        raise WireError(f"a KV record of {length} bytes (kind {kind}) is over its limit of {limit}")
    return kind, length


def read_small(sock: socket.socket) -> tuple[int, bytes]:
    """One status-sized record (ACK, ERROR, OK)."""
    header = read_header(sock)
    kind, length = header
    if kind == FRAME:
        raise WireError("a KV frame where a status was expected")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return kind, bytes(body)


def record(kind: int, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(body)) + body


def error_record(code: str, message: str) -> bytes:
    body = f"{code}\n{message}".encode()[:MAX_STATUS_BYTES]
    return record(ERROR, body)


def parse_error(body: bytes) -> Refused:
    code, _, message = body.decode(errors="replace").partition("\n")
    return Refused(code or "UNKNOWN", message)


def expect_ack(sock: socket.socket) -> bytes:
    """The receiver's answer to END: the PushAck's bytes, or Refused."""
    kind, body = read_small(sock)
    if kind == ERROR:
        raise parse_error(body)
    if kind != ACK:
        raise WireError(f"KV record kind {kind} where an acknowledgement was expected")
    return body


# ---- the handshake ------------------------------------------------------------------------

def server_handshake(sock: socket.socket, key: bytes, deadline: float | None = None,
                     admit: Callable[[], Refused | None] | None = None, target: str = "") -> None:
    """The receiver's side: Refused (after sending ERROR) unless the peer proves the key.
    deadline (time.monotonic()): the whole exchange ends by then (socket.timeout), however slowly
    the peer sends. admit: asked once the proof checks, before OK; a Refused it returns is sent
    (ERROR) and raised: a bound that only members of the deployment count against."""
    server_nonce = os.urandom(NONCE_BYTES)
    until(sock, deadline)
    sock.sendall(MAGIC + server_nonce)
    hello = bytearray(len(MAGIC) + NONCE_BYTES + PROOF_BYTES)
    recv_exact(sock, memoryview(hello), deadline=deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise WireError("not a pdserve KV data-plane client")
    client_nonce = bytes(hello[len(MAGIC):len(MAGIC) + NONCE_BYTES])
    proof = bytes(hello[len(MAGIC) + NONCE_BYTES:])
    if not hmac.compare_digest(proof, _proof(key, CLIENT_CONTEXT, server_nonce, client_nonce, target)):
        message = "the KV data-plane client did not prove this deployment's cluster token"
        until(sock, deadline)
        sock.sendall(error_record("UNAUTHENTICATED", message))
        raise Refused("UNAUTHENTICATED", message)
    refusal = admit() if admit is not None else None
    until(sock, deadline)
    if refusal is not None:
        sock.sendall(error_record(refusal.code, str(refusal)))
        raise refusal
    sock.sendall(record(OK, _proof(key, SERVER_CONTEXT, server_nonce, client_nonce, target)))


def client_handshake(sock: socket.socket, key: bytes, target: str = "") -> None:
    """The sender's side: Refused unless the receiver accepts our proof and proves the key back."""
    hello = bytearray(len(MAGIC) + NONCE_BYTES)
    recv_exact(sock, memoryview(hello)[:1])
    if hello[0] == ERROR:   # refused before the handshake (too many connections)
        recv_exact(sock, memoryview(hello)[1:HEADER.size])
        _, length = HEADER.unpack(hello[:HEADER.size])
        body = bytearray(min(length, MAX_STATUS_BYTES))
        recv_exact(sock, memoryview(body))
        raise parse_error(bytes(body))
    recv_exact(sock, memoryview(hello)[1:])
    if hello[:len(MAGIC)] != MAGIC:
        raise WireError("not a pdserve KV data plane")
    server_nonce = bytes(hello[len(MAGIC):])
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + client_nonce + _proof(key, CLIENT_CONTEXT, server_nonce, client_nonce, target))
    kind, body = read_small(sock)
    if kind == ERROR:
        raise parse_error(body)
    if kind != OK or not hmac.compare_digest(body, _proof(key, SERVER_CONTEXT, server_nonce, client_nonce, target)):
        raise Refused("UNAUTHENTICATED", "the KV data plane did not prove this deployment's cluster token")


# ---- TLS ----------------------------------------------------------------------------------

def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """Mutual TLS as the gRPC plane's (the same files): the client's certificate must chain to ca."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The server's certificate must chain to ca and name the host dialed (as gRPC checks)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    return ctx
