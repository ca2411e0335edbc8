"""The router's view of its workers: one status stream per worker (WatchStatus), health from
that stream, and the router's own count of what it has placed on each worker.

A worker is healthy while its status stream delivers (it sends at least every second; a
stream silent for ``stale_s`` counts as a frozen worker) and it is not draining. A broken
stream is retried at once and then every ``retry_s``, so a restarted worker is used again
within a second; a resolver (Ray) may supply a restarted worker's new address. Every status
change wakes ``changed`` waiters: the admission queue and the router's health. A role left
with no healthy worker has an outage start (``outage_started``): requests waiting for one of
its workers to come back are bounded from that moment, all of them by the same time.

With ``watch_kv`` each worker's prefix-cache keys stream in too (``WatchKVEvents``) and keep
its ``index`` (services/router/prefix_index.py) for KV-aware routing; a broken stream empties the index
(the worker may have restarted with an empty cache) until the next snapshot arrives.

Membership changes while the router serves (services/router/membership.py): ``add`` a worker
(its streams start at once), ``remove`` one (its streams stop, its index goes with it). A worker
the router drains (``WorkerHandle.admitting`` False) takes no new requests; ``evict`` makes every
stream of a request still on it fail as a worker fault, so those requests migrate.

Roles may mix: a colocated ("both") worker among prefill and decode workers serves as a decode
worker that prefills its own prompts (``healthy("decode")`` includes it); the pool is
``colocated`` only while every member is.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.common.change_signal import ChangeSignal
from pdserve.services.common.proto_convert import ROLE_ENUM
from pdserve.services.router.decode_mux import DecodeMux
from pdserve.services.router.prefix_index import DEFAULT_MAX_KEYS, PrefixIndex
from pdserve.services.common.security import Credentials
from pdserve.services.common.grpc_setup import options as channel_options

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
# The member roles that can do a role's part of a request: a colocated worker decodes too.
SERVED_BY = {"prefill": ("prefill",), "decode": ("decode", "both"), "both": ("both",)}


@dataclass(eq=False)
class WorkerHandle:
    address: str
    role: str                                  # "prefill" | "decode" | "both"
    credentials: Credentials = field(default_factory=Credentials, repr=False)
    status: worker_pb2.WorkerStatus | None = None
    connected: bool = False                    # its status stream is live
    inflight: int = 0                          # requests the router has on it now
    inflight_prompt_tokens: int = 0
    last_seen: float = 0.0
    healthy_at: float | None = None            # when it was last heard healthy (monotonic)
    index: PrefixIndex = field(default_factory=PrefixIndex, repr=False)   # its prefix-cache keys, as last heard
    admitting: bool = True                     # the router places new requests here (False: drained by an operator)
    joined: bool = False                       # it registered itself (Membership.Join), rather than named at start
    placed_total: int = 0                      # requests placed here since it became a member
    open_calls: int = 0                        # worker streams of requests open now (WorkerWatch.events)
    evicted: asyncio.Event = field(default_factory=asyncio.Event, repr=False)   # its requests must move now

    def __post_init__(self) -> None:
        self._connect(self.address)

    def _connect(self, address: str) -> None:
        self.address = address
        self.channel = self.credentials.channel(address, channel_options())
        self.info = worker_pb2_grpc.WorkerStub(self.channel)
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self.channel)
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        self.decode_mux = DecodeMux(self.decode)   # the requests decoding there, over one stream
        self.colocated = worker_pb2_grpc.ColocatedWorkerStub(self.channel)

    async def rebind(self, address: str) -> None:
        """Point at the worker's new address (it was restarted elsewhere)."""
        old = self.channel
        self._connect(address)
        await old.close()

    @property
    def healthy(self) -> bool:
        return self.admitting and self.connected and self.status is not None and not self.status.draining \
            and not self.role_mismatch

    @property
    def role_mismatch(self) -> bool:
        """Its status reports a role other than the router's own record, which the router trusts:
        such a worker is not routed to until the two agree again."""
        return self.status is not None and self.status.role not in (0, ROLE_ENUM[self.role])

    @property
    def idle(self) -> bool:
        """Nothing of a request here: no stream open from the router, and the worker reports
        nothing queued, computing, reserved or pinned for sending. A request placed a moment ago
        shows up in one of these within a status message: see Membership's IDLE_SETTLE_S."""
        s = self.status
        return self.open_calls == 0 and (s is None or not (
            s.num_running or s.num_waiting or s.num_reserved or s.num_sending))

    @property
    def kv_address(self) -> str:
        return self.status.kv_address if self.status and self.status.kv_address else self.address

    @property
    def free_blocks(self) -> int:
        return self.status.num_free_blocks if self.status else 0


class NoWorker(RuntimeError):
    """No healthy worker of the wanted role."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} worker")
        self.role = role


class MembershipError(ValueError):
    """A membership change the pool refuses (the message says why)."""


class WorkerSet:
    """The workers placement chooses among (services/router/placement.py) and what it asks of
    them, without streams or channels: ``WorkerPool`` is the router's, kept by its workers' status
    streams; the planner's simulator builds one of its simulated workers. A member is anything
    with ``WorkerHandle``'s fields that placement reads: address, role, status (the worker's last
    WorkerStatus, None before the first), healthy, inflight, inflight_prompt_tokens, free_blocks
    and index (its prefix-cache keys)."""

    def __init__(self, workers: list | None = None) -> None:
        self.workers: list[WorkerHandle] = [] if workers is None else workers

    @property
    def colocated(self) -> bool:
        """Every member is colocated (a mixed pool routes as a disaggregated one)."""
        return bool(self.workers) and all(w.role == "both" for w in self.workers)

    @property
    def block_size(self) -> int:
        """The deployment's KV block size, as its workers report it (their EngineConfig's); 0 before any has."""
        return next((w.status.block_size for w in self.workers if w.status is not None and w.status.block_size), 0)

    def healthy(self, role: str) -> list[WorkerHandle]:
        """The healthy members that can do role's part (SERVED_BY: for "decode", colocated ones too)."""
        return [w for w in self.workers if w.role in SERVED_BY[role] and w.healthy]

    def decode_candidates(self, exclude: set[str] = frozenset()) -> list[WorkerHandle]:
        """Healthy decode (or colocated) workers, least loaded first: fewest in-flight requests,
        then most free KV blocks."""
        role = "decode"   # colocated workers included (SERVED_BY)
        healthy = [w for w in self.healthy(role) if w.address not in exclude] or self.healthy(role)
        if not healthy:
            raise NoWorker(role)
        return sorted(healthy, key=lambda w: (w.inflight, -w.free_blocks))


class WorkerPool(WorkerSet):
    def __init__(self, prefill: list[str], decode: list[str], colocated: list[str],
                 credentials: Credentials | None = None, *, stale_s: float = 3.0, retry_s: float = 0.25,
                 resolver: Callable[[WorkerHandle], Awaitable[str | None]] | None = None,
                 watch_kv: bool = False, kv_index_max_keys: int = DEFAULT_MAX_KEYS, dynamic: bool = False) -> None:
        """dynamic: workers may join later (Membership), so the pool may start with none, or with
        one role only."""
        self.credentials = credentials or Credentials()
        self.kv_index_max_keys = kv_index_max_keys
        super().__init__()
        if not (prefill or decode or colocated) and not dynamic:
            raise ValueError("the router needs at least one worker")
        if not dynamic and not colocated and bool(prefill) != bool(decode):
            raise ValueError("disaggregated serving needs both prefill and decode workers")
        for role, addresses in (("prefill", prefill), ("decode", decode), ("both", colocated)):
            for address in addresses:
                self.workers.append(self._handle(address, role))
        self.stale_s = stale_s
        self.retry_s = retry_s
        self.resolver = resolver   # the current address of an unreachable worker (e.g. a restarted Ray actor)
        self.watch_kv = watch_kv
        self._tasks: dict[WorkerHandle, list[asyncio.Task]] = {}
        self._started = False
        self._changed = ChangeSignal()
        self.started_at = time.monotonic()

    def _handle(self, address: str, role: str) -> WorkerHandle:
        if role not in ROLES:
            raise MembershipError(f"role must be one of {ROLES}, got {role!r}")
        handle = WorkerHandle(address, role, self.credentials)
        handle.index = PrefixIndex(self.kv_index_max_keys)
        return handle

    def find(self, address: str) -> WorkerHandle | None:
        return next((w for w in self.workers if w.address == address), None)

    @staticmethod
    def check_role(role: str) -> None:
        if role not in ROLES:
            raise MembershipError(f"role must be one of {ROLES}, got {role!r}")

    def add(self, address: str, role: str) -> WorkerHandle:
        """The worker at address, a member from now on (its status stream starts at once); the
        member already there when the address is known (MembershipError if its role differs)."""
        known = self.find(address)
        if known is not None:
            if known.role != role:
                raise MembershipError(f"{address} is already a {known.role} worker here, not {role}")
            return known
        self.check_role(role)
        worker = self._handle(address, role)
        self.workers.append(worker)
        if self._started:
            self._start_watching(worker)
        log.info("worker %s (%s) joined", address, role)
        self.notify()
        return worker

    async def remove(self, worker: WorkerHandle) -> None:
        """Forget worker: its streams stop and its prefix index goes with it. Requests still on it
        keep their handle (its channel closes once they release it, in the background)."""
        if worker not in self.workers:
            return
        self.workers.remove(worker)
        for task in self._tasks.pop(worker, []):
            task.cancel()
        worker.connected, worker.admitting = False, False
        log.info("worker %s (%s) removed", worker.address, worker.role)
        self.notify()
        await asyncio.sleep(0)

    def set_role(self, worker: WorkerHandle, role: str) -> None:
        """The worker serves role now (it switched in its process): its prefix index is rebuilt
        from its events, its placement counts start again."""
        self.check_role(role)
        worker.role = role
        worker.index.clear()
        self.notify()

    @staticmethod
    def evict(worker: WorkerHandle) -> None:
        """Every open stream of a request on worker fails as a worker fault (its requests migrate)."""
        worker.evicted.set()

    def of_role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role == role]

    def outage_started(self, role: str) -> float | None:
        """Since when (monotonic) the role has had no healthy worker: when the last of them was
        last heard healthy, or the pool's start when none ever was; None while one is healthy."""
        workers = [w for w in self.workers if w.role in SERVED_BY[role]]
        if any(w.healthy for w in workers):
            return None
        heard = [w.healthy_at for w in workers if w.healthy_at is not None]
        return max(heard) if heard else self.started_at

    @property
    def serving(self) -> bool:
        """A request can be served now: by a healthy colocated worker, or a healthy prefill and decode worker."""
        return bool(self.healthy("both")) or bool(self.healthy("prefill") and self.healthy("decode"))

    # ---- status streams -----------------------------------------------------------------
    def start(self) -> None:
        self.started_at = time.monotonic()
        self._started = True
        for worker in self.workers:
            self._start_watching(worker)

    def _start_watching(self, worker: WorkerHandle) -> None:
        tasks = [asyncio.create_task(self._watch(worker), name=f"watch {worker.address}")]
        if self.watch_kv:
            tasks.append(asyncio.create_task(self._watch_kv(worker), name=f"kv events {worker.address}"))
        self._tasks[worker] = tasks

    async def _watch_kv(self, worker: WorkerHandle) -> None:
        """Keep worker.index from its KV events; retried like the status stream. A worker that
        does not publish them (UNIMPLEMENTED) is routed by load alone."""
        while True:
            call = worker.info.WatchKVEvents(worker_pb2.StatusRequest())
            try:
                async for events in call:
                    worker.index.apply(events.reset, events.stored, events.removed, events.tiered)
                    self.notify()   # a request waiting for a prefix in flight there may go on
                raise ConnectionError("KV event stream ended")
            except asyncio.CancelledError:
                call.cancel()
                raise
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                call.cancel()
                worker.index.clear()
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("worker %s publishes no KV events: routed by load", worker.address)
                    return
                await asyncio.sleep(self.retry_s)

    async def _watch(self, worker: WorkerHandle) -> None:
        while True:
            try:
                call = worker.info.WatchStatus(worker_pb2.StatusRequest())
                while True:
                    status = await asyncio.wait_for(call.read(), self.stale_s)
                    if status is grpc.aio.EOF:
                        raise ConnectionError("status stream ended")
                    if not worker.connected:
                        log.info("worker %s (%s) is up", worker.address, worker.role)
                    worker.status, worker.connected, worker.last_seen = status, True, time.monotonic()
                    if worker.healthy:
                        worker.healthy_at = worker.last_seen
                    self.notify()
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError) as exc:
                call.cancel()
                if worker.connected:
                    why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "no status"
                    log.warning("worker %s (%s) lost: %s", worker.address, worker.role, why)
                    worker.connected = False
                    self.notify()
                await self._follow(worker)
                await asyncio.sleep(self.retry_s)

    async def _follow(self, worker: WorkerHandle) -> None:
        if self.resolver is None:
            return
        address = await self.resolver(worker)
        if address and address != worker.address:
            log.info("worker %s (%s) moved to %s", worker.address, worker.role, address)
            await worker.rebind(address)

    def mark_down(self, worker: WorkerHandle) -> None:
        """A call failed in a way that says the worker is gone; its stream will confirm or revive it."""
        if worker.connected:
            worker.connected = False
            self.notify()

    async def wait_ready(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all(w.healthy for w in self.workers):
            if loop.time() > deadline:
                down = [w.address for w in self.workers if not w.healthy]
                raise TimeoutError(f"workers not ready after {timeout}s: {down}")
            await self.wait_changed(deadline - loop.time())

    async def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        for w in self.workers:
            await w.channel.close()

    def settle(self, worker: WorkerHandle, keys: list[int]) -> None:
        """The request that noted these prefix keys on worker has its KV in place there, or is
        gone: stop expecting them (PrefixIndex.settle), and wake requests waiting for them."""
        worker.index.settle(keys)
        self.notify()

    # ---- change notification --------------------------------------------------------------
    def notify(self) -> None:
        """Wake every waiter on a change (a membership change made outside the pool)."""
        self._changed.notify()

    async def wait_changed(self, timeout: float | None = None) -> None:
        """Until any worker's status or health changes (or timeout)."""
        await self._changed.wait(timeout)

    # ---- placement --------------------------------------------------------------------------
    @contextlib.contextmanager
    def placed(self, worker: WorkerHandle, prompt_tokens: int = 0, count: bool = True) -> Iterator[WorkerHandle]:
        """Count a request (unless count is False) and prompt_tokens to compute on worker for as long
        as the block runs."""
        n = 1 if count else 0
        worker.inflight += n
        worker.placed_total += n
        worker.inflight_prompt_tokens += prompt_tokens
        try:
            yield worker
        finally:
            worker.inflight -= n
            worker.inflight_prompt_tokens -= prompt_tokens
