"""The decode worker's raw TCP KV data plane (the wire: tcp_wire.py; the sender:
tcp_transport.py), next to the gRPC stream (grpc_receiver.py), which stays the fallback.

A listener thread accepts connections, each served by its own thread: the peer proves the
cluster token (and, with the deployment's TLS files, its certificate) before anything else is
read, all of it within ``handshake_timeout_s`` of the accept however slowly its bytes come, then
sends transfers one at a time. Until its proof checks a connection is one of at most
``max_unauthenticated`` (``max_unauthenticated_per_peer`` from one address); one past either is
closed as soon as it is accepted (no thread). Only a proved connection takes one of the
``max_connections`` slots (none free: refused, RESOURCE_EXHAUSTED), so strangers that connect
and drip bytes hold no slot, and a sender that finds the plane closed to it goes over gRPC.

A frame of whole uncompressed blocks (what the sender frames) is read in two steps: its fields
before the payload, whose blocks the connector checks and claims, then its payload with ``recvmsg_into``
straight into those blocks' slabs in the paged pool (the kernel's copy is the only one), then
its MAC, checked over what was read before the blocks count as received (_take_frame). Any other
frame (the open frame, a heartbeat, a block split across frames, a compressed one, or any frame
over TLS) is read with ``recv_into`` into the connection's one reused buffer, its MAC checked
and its blocks written into the pool by the connector. Lengths are checked first; the next
record's header comes along where it has arrived (tcp_wire.RecordReader). Socket reads, the MAC
(OpenSSL) and any pool copy (torch) release the GIL, so the worker's event loop keeps serving
while the bytes come in. The connector is lock-protected and hands its state changes to
the loop itself (AsyncEngine._on_kv_change). The per-frame steps are the gRPC stream's
(receive_session.py): the same checks, the same failure rule.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from pdserve.engine.kv.handoff import HandoffError, HandoffState
from pdserve.services.common.proofs import is_loopback
from pdserve.services.kv_transfer import tcp_wire
from pdserve.services.kv_transfer.base import KVSink
from pdserve.services.kv_transfer.frames import parse_frame, parse_head, parse_trailer
from pdserve.services.kv_transfer.receive_session import Pending, ReceiveSession, end, take_inline

log = logging.getLogger(__name__)

_WAITING = (HandoffState.RESERVED, HandoffState.RECEIVING, HandoffState.READY)
REFUSAL_DRAIN_S = 0.5      # after an ERROR, the rest the sender had in flight is read and dropped this long
ACCEPT_POLL_S = 0.5        # how often the accept loop looks at the close flag
TURNED_AWAY_LOG_S = 60.0   # connections turned away before their proof are logged at most this often
HEAD_READ_BYTES = 4096     # a frame's fields before its payload are read this much first (then twice as much)


@dataclass(frozen=True, slots=True)
class DataPlaneLimits:
    max_connections: int = 64         # proved connections served at once; more are refused (RESOURCE_EXHAUSTED)
    handshake_timeout_s: float = 5.0  # the TLS handshake and the token proof together, from the accept
    max_unauthenticated: int = 16     # connections not yet proved, at once; more are closed when accepted
    max_unauthenticated_per_peer: int = tcp_wire.UNPROVED_PER_PEER   # ... of them from one peer address
    idle_timeout_s: float = 120.0     # an idle connection (between transfers) is closed after this
    frame_timeout_s: float = 30.0     # inside a transfer not yet opened, the next bytes must come within
                                      # this; once opened, as long as the reservation lives (its lease)
    poll_s: float = 1.0               # how often a waiting transfer looks at its reservation

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated", "max_unauthenticated_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("handshake_timeout_s", "idle_timeout_s", "frame_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class KVDataListener:
    """Accepts KV data-plane connections on host:port (0: ephemeral) and feeds sink."""

    def __init__(self, sink: KVSink, host: str, port: int = 0, *, cluster_token: str | bytes | None = None,
                 tls: ssl.SSLContext | None = None, limits: DataPlaneLimits = DataPlaneLimits()) -> None:
        """cluster_token: the deployment's; it keys the handshake and the frames' MACs. None is
        allowed on a loopback host only (--insecure-no-auth), as for the gRPC plane.
        tls: a server context (tcp_wire.server_context) from the deployment's mTLS files."""
        if not cluster_token and not is_loopback(host):
            raise ValueError(f"the KV data plane would listen on {host} (not loopback) without a cluster token: "
                             f"set $PDSERVE_CLUSTER_TOKEN, or use --kv-data-plane grpc")
        if not 0 <= port < 65536:
            raise ValueError(f"kv_data_port must be 0-65535, got {port}")
        self.sink, self.cluster_token, self.tls, self.limits = sink, cluster_token, tls, limits
        self._key = tcp_wire.auth_key(cluster_token)
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.create_server((host.strip("[]"), port), family=family, backlog=128)
        self._sock.settimeout(ACCEPT_POLL_S)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._unproved: dict[str, int] = {}   # peer address -> its connections not yet proved
        self.turned_away = 0                  # connections closed at accept: too many unproved
        self._warned_at = -TURNED_AWAY_LOG_S
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kv-data-accept-{self.port}", daemon=True)

    def start(self) -> "KVDataListener":
        self._acceptor.start()
        return self

    def address(self, host: str | None = None) -> str:
        host = host or self.host
        return f"[{host}]:{self.port}" if ":" in host and not host.startswith("[") else f"{host}:{self.port}"

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, end every connection (a transfer in flight fails as cancelled) and wait
        for their threads, up to timeout_s."""
        self._closed.set()
        _shutdown(self._sock)   # wakes the acceptor's accept (Linux)
        self._sock.close()
        with self._lock:
            conns, threads = list(self._open), list(self._threads)
        for conn in conns:
            _shutdown(conn)
        deadline = time.monotonic() + timeout_s
        for thread in [self._acceptor, *threads]:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    # ---- connections ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return   # closed
            deadline = time.monotonic() + self.limits.handshake_timeout_s   # from the accept, whatever comes
            refusal = self._admit_unproved(peer[0])
            if refusal:
                _turn_away(conn, refusal)
                continue
            thread = threading.Thread(target=self._serve, args=(conn, peer, deadline), name=f"kv-data-{peer[1]}",
                                      daemon=True)
            with self._lock:
                self._open.add(conn)
                self._threads.add(thread)
            thread.start()

    def _admit_unproved(self, host: str) -> str:
        """Count a new connection against the bounds on unproved ones; "": counted, else why not."""
        limits = self.limits
        with self._lock:
            mine = self._unproved.get(host, 0)
            if sum(self._unproved.values()) >= limits.max_unauthenticated:
                why = f"at most {limits.max_unauthenticated} connections may be proving themselves at once"
            elif mine >= limits.max_unauthenticated_per_peer:
                why = f"at most {limits.max_unauthenticated_per_peer} connections from one address may be " \
                      f"proving themselves at once"
            else:
                self._unproved[host] = mine + 1
                return ""
            self.turned_away += 1
            warn = time.monotonic() - self._warned_at >= TURNED_AWAY_LOG_S
            if warn:
                self._warned_at = time.monotonic()
        if warn:
            log.warning("KV data-plane connection from %s closed at accept (%s; %d so far; a member turned "
                        "away sends over gRPC)", host, why, self.turned_away)
        return why

    def _proved_or_gone(self, host: str) -> None:
        """A connection's handshake ended (proved, refused or failed): it no longer counts as unproved."""
        with self._lock:
            left = self._unproved.get(host, 0) - 1
            if left > 0:
                self._unproved[host] = left
            else:
                self._unproved.pop(host, None)

    def _take_slot(self) -> tcp_wire.Refused | None:
        if self._slots.acquire(blocking=False):
            return None
        return tcp_wire.Refused("RESOURCE_EXHAUSTED", f"the KV data plane serves at most "
                                                      f"{self.limits.max_connections} connections")

    def _serve(self, conn: socket.socket, peer: tuple, deadline: float) -> None:
        """deadline (time.monotonic()): the TLS handshake and the token proof end by then."""
        raw = conn
        unproved, slot = True, False

        def admit() -> tcp_wire.Refused | None:   # proved: out of the unproved, into a slot if one is free
            nonlocal unproved, slot
            unproved = False
            self._proved_or_gone(peer[0])
            refusal = self._take_slot()
            slot = refusal is None
            return refusal
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    self._open.add(conn)
                tcp_wire.until(conn, deadline)
                conn.do_handshake()   # bounded as a whole by the socket's timeout (CPython's ssl)
            tcp_wire.server_handshake(conn, self._key, deadline=deadline, admit=admit, target=self.address())
            reader = tcp_wire.RecordReader(conn)
            while not self._closed.is_set() and self._transfer(conn, reader):
                pass
        except tcp_wire.Refused as exc:
            log.warning("KV data-plane connection from %s refused: %s", peer[0], exc)
        except (OSError, tcp_wire.WireError) as exc:
            log.debug("KV data-plane connection from %s ended: %s", peer[0], exc)
        finally:
            _shutdown(conn)
            conn.close()
            raw.close()
            with self._lock:
                self._open.discard(conn)
                self._open.discard(raw)
                self._threads.discard(threading.current_thread())
            if unproved:
                self._proved_or_gone(peer[0])
            if slot:
                self._slots.release()

    def _transfer(self, conn: socket.socket, reader: tcp_wire.RecordReader) -> bool:
        """One transfer, FRAME records to END, answered ACK or ERROR. False: the connection ends."""
        conn.settimeout(self.limits.idle_timeout_s)
        session = ReceiveSession(self.sink, self.cluster_token)
        try:
            header = reader.header(at_start=True)
        except (OSError, tcp_wire.Closed):
            return False   # idle past its deadline, or closed
        except tcp_wire.WireError as exc:   # an unknown kind, an oversized length: refused, nothing allocated
            self._refuse(conn, session, HandoffError("INVALID_ARGUMENT", str(exc)))
            return False
        if header is None:
            return False
        if header[0] == tcp_wire.BEAT:
            return self._beat(conn, reader.body(header[1]))
        pending: deque[Pending] = deque()
        conn.settimeout(self.limits.poll_s)
        unopened_until = time.monotonic() + self.limits.frame_timeout_s

        def patience() -> bool:
            """Go on waiting for the sender? While its reservation lives: a prefill worker frozen
            for a while (or computing without a heartbeat getting through) is the lease's to judge."""
            if self._closed.is_set():
                return False
            if not session.request_id:
                return time.monotonic() < unopened_until
            return self.sink.state(session.request_id) in _WAITING
        try:
            while True:
                kind, length = header
                if kind == tcp_wire.END:
                    conn.sendall(tcp_wire.record(tcp_wire.ACK, end(session, pending).SerializeToString()))
                    return True
                if kind != tcp_wire.FRAME:
                    raise HandoffError("INVALID_ARGUMENT", f"KV record kind {kind} inside a transfer")
                _take_frame(reader, session, pending, length, patience)
                header = reader.header(patience=patience)
        except tcp_wire.Closed:
            session.cancelled()   # the sender went away mid-transfer: as a cancelled gRPC stream
        except tcp_wire.WireError as exc:
            self._refuse(conn, session, HandoffError("INVALID_ARGUMENT", str(exc)))
        except socket.timeout:   # not opened in time, or its reservation ended (lapsed, failed, aborted)
            self._refuse(conn, session, HandoffError("DEADLINE_EXCEEDED", "the KV stream stalled: "
                                                     + ("its reservation ended" if session.request_id else
                                                        f"not opened within {self.limits.frame_timeout_s:g}s")))
        except HandoffError as exc:
            self._refuse(conn, session, exc)
        except OSError:
            session.cancelled()
        return False

    def _beat(self, conn: socket.socket, body: memoryview) -> bool:
        """A BEAT between transfers: the named reservation's lease is extended when the beat holds
        its token. One that does not (lapsed, unknown, wrong token) changes nothing and is not
        answered: its stream learns of it when it sends. A malformed one ends the connection."""
        frame = parse_frame(body)
        if frame.error or frame.open is None or not frame.open.request_id:
            self._refuse(conn, ReceiveSession(self.sink, self.cluster_token),
                         HandoffError("INVALID_ARGUMENT", frame.error or "a KV beat must name a stream"))
            return False
        try:
            self.sink.heartbeat(frame.open.request_id, frame.open.transfer_token)
        except HandoffError as exc:
            log.debug("KV beat for %r not taken: %s", frame.open.request_id, exc)
        return True

    def _refuse(self, conn: socket.socket, session: ReceiveSession, exc: HandoffError) -> None:
        """The sink's refusal (that request's blocks freed), told to the sender; what it still had in
        flight is read and dropped for a moment, so that the status is not lost to a reset."""
        session.fail(exc)
        try:
            conn.sendall(tcp_wire.error_record(exc.code, str(exc)))
            conn.shutdown(socket.SHUT_WR)
            _drain(conn, REFUSAL_DRAIN_S)
        except OSError:
            pass


def _take_frame(reader: tcp_wire.RecordReader, session: ReceiveSession, pending: deque[Pending], length: int,
                patience: Callable[[], bool]) -> None:
    """One FRAME record. A frame of whole uncompressed blocks, on a plain socket, after the stream
    opened and with no block left part-way: its fields before the payload are read first, its
    blocks checked and claimed (ReceiveSession.claim), its payload read straight into them, then
    its MAC checked over what was read, and only then do the blocks count as received (a frame
    that fails fails the request, which frees them). Any other frame is read whole, then taken
    as any inline frame (receive_session.take_inline)."""
    if not (reader.scatters and session.request_id and not pending):
        take_inline(session, pending, parse_frame(reader.body(length, patience)))
        return
    data = reader.body_head(length, HEAD_READ_BYTES, patience)
    while (head := parse_head(data, length)) is None:   # twice as much each time: parsing stays linear
        data = reader.body_head(length, data.nbytes, patience)
    direct = head.payload_at >= 0 and not head.frame.open
    run = session.claim(head.frame.headers, head.payload_len) if direct else None
    if run is None:
        take_inline(session, pending, parse_frame(reader.body_rest(patience)))
        return
    try:
        trailer = reader.body_rest_into(head.payload_at, run.slabs, patience)
        try:
            mac = parse_trailer(trailer)
        except ValueError as exc:
            raise HandoffError("INVALID_ARGUMENT", f"malformed KVFrame: {exc}") from None
        session.verify([data[:head.payload_at], *run.slabs], mac)
    except BaseException:
        session.finish(run, written=False)
        raise
    session.finish(run, written=True)


def _drain(conn: socket.socket, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    sink = bytearray(64 << 10)
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            if not conn.recv_into(sink):
                return
        except OSError:
            return


def _turn_away(conn: socket.socket, why: str) -> None:
    """Close a connection just accepted, saying why (RESOURCE_EXHAUSTED) where its send buffer
    takes the record at once: the accept loop never waits on it."""
    try:
        conn.setblocking(False)
        conn.send(tcp_wire.error_record("RESOURCE_EXHAUSTED", why))
    except OSError:
        pass
    finally:
        conn.close()


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
