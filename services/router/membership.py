"""The router's membership API (pdserve.v1.Membership): which workers it routes to, changed
while it serves.

- A worker started with ``--router ADDR`` holds a ``Join`` stream open for as long as it is a
  member (services/workers/membership_client.py): it is added to the pool at once and routed to
  once its status stream says it is healthy. A router restarted gets its membership back as its
  workers join again. A joined worker whose Join stream ends and whose status stream stays down
  for ``MEMBER_LOST_S`` is forgotten (it died, or left).
- An operator (`pdserve workers ...`, the planner) lists, adds, drains, resumes, removes and
  switches the role of workers, proving the router's admin token (``--admin-token-file``,
  ``$PDSERVE_ADMIN_TOKEN``), which members lack: a worker's cluster token joins that worker, at
  its own address (the host its call comes from), and lists the members, nothing more.
  Removing and switching drain first: no new requests, and those in flight get
  ``drain_timeout_s`` to finish; what is left then migrates (WorkerPool.evict), so no request is
  lost. A removed worker's prefix-index entries go with it. The same operations are
  methods (``add``, ``remove``, ``switch_role``, raising ``Refused``) for the router's own
  sources of members: a watched file (services/router/workers_file.py).

Every call is on the internal plane: with a cluster token the router refuses a call without a
fresh proof of it, and a membership change without one of the admin token
(services/common/proof_interceptors.ClusterInterceptor, scoped to this service), whatever API key its
public API wants. An address the router is told to dial is HOST:PORT (a DNS name or an IP, no scheme or
path: ``security.is_dial_address``), and a drain timeout is finite, at most
``MAX_DRAIN_TIMEOUT_S``. A router that dials only loopback workers (no mutual TLS and no
``--insecure-internal-plane``) refuses members at other addresses.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from pdserve.v1 import membership_pb2, membership_pb2_grpc, worker_pb2
from pdserve.services.common.proto_convert import ROLE_ENUM, ROLE_NAMES
from pdserve.services.router.worker_pool import MembershipError, WorkerHandle, WorkerPool
from pdserve.services.common.security import MAX_DRAIN_TIMEOUT_S
from pdserve.services.common.proofs import host_of, is_dial_address, is_loopback

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/pdserve.v1.Membership/"
IDLE_SETTLE_S = 0.2       # a worker counts as idle once it has been idle this long (a request just placed shows)
EVICT_WAIT_S = 10.0       # after the drain timeout, how long the requests still there get to move away
MEMBER_LOST_S = 10.0      # a joined worker with no Join stream and no status stream this long is forgotten
MEMBER_HEARTBEAT_S = 5.0  # a Join stream hears its member entry at least this often
ADD_WAIT_S = 10.0         # AddWorker answers once the worker is heard, or after this long
SET_ROLE_TIMEOUT_S = 30.0
JOIN_RESOLVE_S = 2.0      # a Join naming its host by name: the name resolves within this, or the Join is refused
MAX_ADDRESS_CHARS = 256
MAX_WORKER_ID_CHARS = 128

S = membership_pb2


class Refused(Exception):
    """A membership change refused, with the gRPC status the API answers it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class MembershipSettings:
    drain_timeout_s: float            # in-flight requests of a worker being removed or switched finish within this
    remote_workers: bool = False      # members may be at non-loopback addresses (mutual TLS or the explicit flag)


class MembershipServicer(membership_pb2_grpc.MembershipServicer):
    def __init__(self, pool: WorkerPool, settings: MembershipSettings) -> None:
        self.pool = pool
        self.settings = settings
        self.join_streams: dict[WorkerHandle, int] = {}
        self.switching: set[WorkerHandle] = set()
        self._background: set[asyncio.Task] = set()
        self._closed = False

    # ---- the member entry ----------------------------------------------------------------
    def member(self, worker: WorkerHandle) -> membership_pb2.Member:
        status = worker.status
        return S.Member(address=worker.address, role=ROLE_ENUM[worker.role],
                        worker_id=status.worker_id if status is not None else "", state=self.state(worker),
                        joined=worker.joined, inflight=worker.inflight, placed_total=worker.placed_total,
                        num_free_blocks=status.num_free_blocks if status is not None else 0,
                        num_total_blocks=status.num_total_blocks if status is not None else 0,
                        max_num_batched_tokens=status.max_num_batched_tokens if status is not None else 0)

    def state(self, worker: WorkerHandle) -> int:
        if worker not in self.pool.workers:
            return S.MEMBER_STATE_REMOVED
        if worker in self.switching:
            return S.MEMBER_STATE_SWITCHING
        if not worker.admitting:
            return S.MEMBER_STATE_DRAINED if worker.idle else S.MEMBER_STATE_DRAINING
        if worker.healthy:
            return S.MEMBER_STATE_SERVING
        if worker.connected and worker.status is not None and worker.status.draining:
            return S.MEMBER_STATE_DRAINING   # draining itself (SIGTERM)
        return S.MEMBER_STATE_JOINING if worker.status is None else S.MEMBER_STATE_DOWN

    # ---- RPCs ------------------------------------------------------------------------------
    async def Join(self, request: membership_pb2.JoinRequest, context) -> AsyncIterator[membership_pb2.Member]:
        address = await self._address(request.address, context)
        await self._own_address(address, context)
        role = await self._role(request.role, context)
        if len(request.worker_id) > MAX_WORKER_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"worker_id has {len(request.worker_id)} characters, at most {MAX_WORKER_ID_CHARS}")
        worker = await self._add(address, role, context)
        worker.joined = True
        self.join_streams[worker] = self.join_streams.get(worker, 0) + 1
        try:
            last, sent_at = None, 0.0
            while True:
                entry = self.member(worker)
                now = time.monotonic()
                if entry != last or now - sent_at >= MEMBER_HEARTBEAT_S:
                    yield entry
                    last, sent_at = entry, now
                if entry.state == S.MEMBER_STATE_REMOVED:
                    return
                await self.pool.wait_changed(MEMBER_HEARTBEAT_S)
        finally:
            self.join_streams[worker] -= 1
            if not self.join_streams[worker]:
                del self.join_streams[worker]
                if worker in self.pool.workers:
                    self._spawn(self._forget_if_gone(worker))

    async def ListWorkers(self, request, context) -> membership_pb2.WorkerList:
        return S.WorkerList(workers=[self.member(w) for w in self.pool.workers])

    async def AddWorker(self, request: membership_pb2.AddWorkerRequest, context) -> membership_pb2.Member:
        address = await self._address(request.address, context)
        worker = await self._add(address, await self._role(request.role, context), context)
        deadline = time.monotonic() + ADD_WAIT_S
        while worker.status is None and worker in self.pool.workers and time.monotonic() < deadline:
            await self.pool.wait_changed(deadline - time.monotonic())
        return self.member(worker)

    def add(self, address: str, role: str) -> WorkerHandle:
        """A member at address from now on (Refused if the address may not be one, or is one in
        another role); routed to once its status stream says it is healthy."""
        problem = self.address_problem(address)
        if problem is not None:
            raise Refused(*problem)
        try:
            return self.pool.add(address, role)
        except MembershipError as exc:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    async def DrainWorker(self, request: membership_pb2.DrainWorkerRequest, context) -> membership_pb2.Member:
        worker = await self._find(request.address, context)
        self._set_admitting(worker, False)
        return self.member(worker)

    async def ResumeWorker(self, request: membership_pb2.MemberRequest, context) -> membership_pb2.Member:
        worker = await self._find(request.address, context)
        if worker in self.switching:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{worker.address} is switching its role")
        self._set_admitting(worker, True)
        return self.member(worker)

    async def RemoveWorker(self, request: membership_pb2.DrainWorkerRequest, context) -> membership_pb2.Member:
        worker = await self._find(request.address, context)
        await self.remove(worker, await self._drain_timeout(request.drain_timeout_s, context))
        return self.member(worker)

    async def remove(self, worker: WorkerHandle, drain_timeout_s: float) -> None:
        """Drain worker (its requests get drain_timeout_s to finish, then move), then forget it."""
        self._set_admitting(worker, False)
        await self._quiesce(worker, drain_timeout_s)
        await self.pool.remove(worker)
        self._spawn(self._close_when_released(worker))

    async def SwitchRole(self, request: membership_pb2.SwitchRoleRequest, context) -> membership_pb2.Member:
        worker = await self._find(request.address, context)
        role = await self._role(request.role, context)
        timeout = await self._drain_timeout(request.drain_timeout_s, context)
        try:
            await self.switch_role(worker, role, timeout)
        except Refused as exc:
            await context.abort(exc.code, str(exc))
        return self.member(worker)

    async def switch_role(self, worker: WorkerHandle, role: str, drain_timeout_s: float) -> None:
        """Drain worker, switch its role in its process (model and KV pool kept), route to it in
        the new role. Refused (the worker keeps its role and serves again) if it is switching
        already, did not become idle, or refused."""
        if role == worker.role:
            return
        if worker in self.switching:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{worker.address} is switching its role already")
        was_admitting = worker.admitting
        self.switching.add(worker)
        self._set_admitting(worker, False)
        old = worker.role
        try:
            if not await self._quiesce(worker, drain_timeout_s):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{worker.address} did not become idle: its role was not switched")
            try:
                status = await worker.info.SetRole(worker_pb2.SetRoleRequest(role=ROLE_ENUM[role]),
                                                   timeout=SET_ROLE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise Refused(exc.code(), f"{worker.address} refused the switch: {exc.details()}") from None
            self.pool.set_role(worker, ROLE_NAMES.get(status.role, role))
            worker.status = status
            log.info("worker %s switched role %s -> %s", worker.address, old, worker.role)
            was_admitting = True
        finally:
            self.switching.discard(worker)
            self._set_admitting(worker, was_admitting)

    # ---- draining ----------------------------------------------------------------------------
    def _set_admitting(self, worker: WorkerHandle, admitting: bool) -> None:
        if worker.admitting != admitting:
            log.info("worker %s (%s) %s", worker.address, worker.role, "resumed" if admitting else "draining")
        worker.admitting = admitting
        self.pool.notify()

    async def _wait_idle(self, worker: WorkerHandle, timeout: float) -> bool:
        """Until the worker has been idle for IDLE_SETTLE_S (True), or timeout (False)."""
        deadline = time.monotonic() + timeout
        idle_since = None
        while True:
            now = time.monotonic()
            if worker.idle:
                idle_since = idle_since or now
                if now - idle_since >= IDLE_SETTLE_S:
                    return True
            else:
                idle_since = None
            if now >= deadline:
                return False
            await self.pool.wait_changed(min(deadline - now, IDLE_SETTLE_S))

    async def _quiesce(self, worker: WorkerHandle, timeout: float) -> bool:
        """Let the requests on a drained worker finish within timeout; then move what is left
        elsewhere (they migrate). True once the worker is idle."""
        if await self._wait_idle(worker, timeout):
            return True
        log.warning("worker %s: requests still in flight after %gs: moving them", worker.address, timeout)
        self.pool.evict(worker)
        try:
            return await self._wait_idle(worker, EVICT_WAIT_S)
        finally:
            worker.evicted.clear()

    async def _forget_if_gone(self, worker: WorkerHandle) -> None:
        """A joined worker whose Join stream ended: forget it if it does not join again and its
        status stream is down MEMBER_LOST_S later (it died or left; one that rejoins is kept)."""
        while worker in self.pool.workers and worker not in self.join_streams:
            await asyncio.sleep(MEMBER_LOST_S)
            if worker in self.join_streams or worker not in self.pool.workers:
                return
            if not worker.connected:
                log.warning("worker %s (%s) left: forgotten", worker.address, worker.role)
                await self.pool.remove(worker)
                self._spawn(self._close_when_released(worker))
                return

    async def _close_when_released(self, worker: WorkerHandle) -> None:
        """A removed worker's channel closes once no request of this router calls it (aborts of
        the requests that moved away included), at most EVICT_WAIT_S later."""
        deadline = time.monotonic() + EVICT_WAIT_S
        while worker.open_calls and time.monotonic() < deadline:
            await asyncio.sleep(IDLE_SETTLE_S)
        await asyncio.sleep(IDLE_SETTLE_S)
        await worker.channel.close()

    # ---- checks ------------------------------------------------------------------------------
    async def _address(self, address: str, context) -> str:
        problem = self.address_problem(address)
        if problem is not None:
            await context.abort(*problem)
        return address

    def address_problem(self, address: str) -> tuple[grpc.StatusCode, str] | None:
        """Why address may not be a member (the status and the message), or None."""
        if len(address) > MAX_ADDRESS_CHARS or not is_dial_address(address):
            return (grpc.StatusCode.INVALID_ARGUMENT,
                    f"address must be HOST:PORT (a DNS name, an IPv4 address or a bracketed IPv6 one, no scheme or "
                    f"path; port 1-65535; at most {MAX_ADDRESS_CHARS} characters), got {address[:64]!r}")
        if not self.settings.remote_workers and not is_loopback(host_of(address)):
            return (grpc.StatusCode.FAILED_PRECONDITION,
                    f"{address} is not a loopback address: this router dials other hosts only with mutual "
                    f"TLS (--tls-*) or --insecure-internal-plane")
        return None

    async def _own_address(self, address: str, context) -> None:
        """A worker joins itself only: the host its address names (an IP, or a name resolving to
        one within JOIN_RESOLVE_S) is the one its call comes from (PERMISSION_DENIED otherwise;
        any loopback name from a loopback peer). Other addresses are an operator's to add."""
        peer = peer_ip(context.peer())
        hosts = await resolve_host(host_of(address), JOIN_RESOLVE_S) if peer is not None else set()
        if peer in hosts or (peer is not None and peer.is_loopback and any(h.is_loopback for h in hosts)):
            return
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"a worker joins at its own address: {address[:64]!r} is not on the host this call comes "
                            f"from ({peer or 'unknown'}); an operator adds other addresses (`pdserve workers add`, "
                            f"with the admin token)")

    @staticmethod
    async def _role(role: int, context) -> str:
        if role not in ROLE_NAMES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be WORKER_ROLE_PREFILL, "
                                                                  f"WORKER_ROLE_DECODE or WORKER_ROLE_BOTH, got {role}")
        return ROLE_NAMES[role]

    async def _drain_timeout(self, value: float, context) -> float:
        """A request's drain_timeout_s; 0: the router's own."""
        if not (math.isfinite(value) and 0 <= value <= MAX_DRAIN_TIMEOUT_S):   # NaN and inf too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"drain_timeout_s must be in [0, {MAX_DRAIN_TIMEOUT_S:g}] seconds, got {value}")
        return value or self.settings.drain_timeout_s

    async def _add(self, address: str, role: str, context) -> WorkerHandle:
        try:
            return self.add(address, role)
        except Refused as exc:
            await context.abort(exc.code, str(exc))

    async def _find(self, address: str, context) -> WorkerHandle:
        worker = self.pool.find(address)
        if worker is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {address[:MAX_ADDRESS_CHARS]!r} is a member "
                                                           f"of this router")
        return worker

    def _spawn(self, coro) -> None:
        if self._closed:   # the router is stopping: nothing more to follow
            coro.close()
            return
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _plain(ip: IPAddress) -> IPAddress:
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def peer_ip(peer: str) -> IPAddress | None:
    """The IP of a gRPC peer ("ipv4:10.0.0.5:43210", "ipv6:%5B::1%5D:43210"); None: not an IP peer."""
    kind, _, rest = urllib.parse.unquote(peer or "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    try:
        return _plain(ipaddress.ip_address(rest.rpartition(":")[0].strip("[]").split("%")[0]))
    except ValueError:
        return None


async def resolve_host(host: str, timeout_s: float) -> set[IPAddress]:
    """The IPs host names: itself when it is one, else what it resolves to within timeout_s (none
    when it does not)."""
    try:
        return {_plain(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                       timeout_s)
    except (OSError, asyncio.TimeoutError, UnicodeError):
        return set()
    ips = set()
    for info in infos:
        try:
            ips.add(_plain(ipaddress.ip_address(str(info[4][0]).split("%")[0])))
        except ValueError:
            continue
    return ips
