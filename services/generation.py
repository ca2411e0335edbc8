"""The router's generation core, independent of the client protocol (gRPC, HTTP).

Disaggregated: reserve decode blocks (waiting in the admission queue while every decode
worker is full) → prefill on a prefill worker, which ships the KV chunk by chunk and streams
the sampled token at once → that token goes to the client (TTFT) while the last blocks are
still in flight, and the decode worker is asked to continue from it → tokens stream back.
Colocated: one worker does both.

Placement (services/routing.py): the decode worker, the prefill worker and the route (remote
prefill, or local prefill on the decode worker with conditional disaggregation) are chosen by
their estimated cost to serve, from the workers' prefix-cache keys and step costs.

Faults: every worker stream runs under a progress watchdog (``stall_timeout_s`` without an
event) and the channels under gRPC keepalive. When a worker dies, stalls or loses the KV, the
request *migrates*: the prompt plus every token already sent is prefilled again elsewhere
(prefix-cache hits make it cheap) and decoding continues, so the client sees one unbroken
stream with no token missing or repeated; greedy and seeded requests produce exactly the
tokens of a run without the fault. After ``migration_limit`` moves the request fails with
the last cause.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from engine import SamplingParams
from pdserve.v1 import common_pb2, worker_pb2
from services.admission import AdmissionQueue
from services.convert import params_to_proto
from services.cost_model import CostModel
from services.errors import RouterError, WorkerFailure
from services.kv_index import DEFAULT_MAX_KEYS, request_keys
from services.metrics import RouterMetrics
from services.routing import DISAGGREGATION_MODES, ROUTING_POLICIES, Placement, Route
from services.worker_pool import NoWorker, WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0           # unary internal calls (Reserve, Abort)
DEADLINE_MARGIN_S = 1.0        # a request waiting for a worker gives up this long before its deadline,
                               # so that its client hears why (UNAVAILABLE) rather than DEADLINE_EXCEEDED
MIN_TURN_S = 0.01              # the least time a request is given to be placed, deadline or not
# Worker answers that are the request's own fault (never retried elsewhere).
REQUEST_ERRORS = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"}


@dataclass(slots=True)
class GenerationOptions:
    migration_limit: int = field(default=3, metadata={
        "help": "times one request may move to another worker after a fault before it fails"})
    stall_timeout_s: float = field(default=10.0, metadata={
        "help": "a worker stream silent this long is treated as failed (and the request migrates)"})
    queue_timeout_s: float = field(default=60.0, metadata={
        "help": "how long a request may wait for decode capacity"})
    max_queued_requests: int = field(default=256, metadata={
        "help": "requests waiting for decode capacity; more are refused at once with a retry hint"})
    kv_lease_ms: int = field(default=0, metadata={
        "help": "idle KV lease asked for each reservation (0: the decode worker's default)"})
    worker_wait_s: float = field(default=60.0, metadata={
        "help": "a role with no healthy worker (a restart) holds the requests that need it for at most this long, "
                "counted from when its last worker was lost, and every waiter by the same time (or its own "
                "deadline, sooner); then they fail UNAVAILABLE. `pdserve up` sets it from its workers' measured "
                "restart time", "aliases": ("--worker-wait",)})
    routing: str = field(default="kv-aware", metadata={
        "help": "how workers are chosen: kv-aware (by estimated cost to serve: uncached prompt tokens, from the "
                "workers' prefix-cache events, queue and running load, KV blocks to ship) or load (fewest in "
                "flight / queued prompt tokens)", "choices": ROUTING_POLICIES})
    disaggregation: str = field(default="always", metadata={
        "help": "always: every prompt is prefilled on a prefill worker; conditional: on the chosen decode worker "
                "instead when the learned costs say it is cheaper (see /metrics and the response timings)",
        "choices": DISAGGREGATION_MODES})
    itl_weight: float = field(default=1.0, metadata={
        "help": "conditional disaggregation: ms of time to first token worth one ms of delay added to each "
                "sequence decoding on the worker that would prefill locally"})
    cache_affinity_weight: float = field(default=1.0, metadata={
        "help": "kv-aware routing: ms of cost per ms of prefill time of the prefix blocks another decode worker "
                "holds and the candidate lacks (0: only the transfer counts; 1: a prefix leaves its worker only "
                "when that worker's extra decode load costs more than computing the prefix again)"})
    kv_index_max_keys: int = field(default=DEFAULT_MAX_KEYS, metadata={
        "help": "kv-aware routing: prefix-cache keys remembered per worker (least recently seen dropped)"})

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {self.disaggregation!r}")
        if self.itl_weight < 0:
            raise ValueError(f"itl_weight must be >= 0, got {self.itl_weight}")
        if self.cache_affinity_weight < 0:
            raise ValueError(f"cache_affinity_weight must be >= 0, got {self.cache_affinity_weight}")
        if self.kv_index_max_keys < 1:
            raise ValueError(f"kv_index_max_keys must be >= 1, got {self.kv_index_max_keys}")
        for name in ("migration_limit", "max_queued_requests", "kv_lease_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("stall_timeout_s", "queue_timeout_s", "worker_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class Timing:
    start: float
    first_token: float | None = None
    last_token: float | None = None
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    first_decode_step_ms: float = 0.0
    cached_tokens: int = 0
    migrations: int = 0
    prefill_route: str = ""             # "remote" | "local" | "colocated"
    estimated_local_ms: float = 0.0
    estimated_remote_ms: float = 0.0
    threshold_tokens: float | None = None
    decode_cached_tokens: int = 0
    kv_bytes: int = 0


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[common_pb2.TokenLogprob] | None = None   # one per token, when params.logprobs is set


@dataclass(eq=False)
class Generation:
    """One request as the router follows it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    timing: Timing
    generated: list[int] = field(default_factory=list)
    workers: set[WorkerHandle] = field(default_factory=set)   # where it may hold state now
    failed: set[str] = field(default_factory=set)              # workers it left after a fault
    aborted: bool = False
    deadline: float | None = None      # the client's own deadline (monotonic), when it gave one

    @property
    def worker_request_id(self) -> str:
        """The id the workers know this attempt by: a late abort of an earlier attempt can never
        hit the current one, even on the same worker."""
        return self.request_id if not self.timing.migrations else f"{self.request_id}@{self.timing.migrations}"


class Generator:
    def __init__(self, pool: WorkerPool, options: GenerationOptions, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.options = options
        self.metrics = metrics
        self.admission = AdmissionQueue(options.max_queued_requests)
        costs = CostModel(options.itl_weight, options.cache_affinity_weight)
        self.placement = Placement(pool, options.routing, options.disaggregation, costs, self._tokens_left)
        self.active: dict[str, Generation] = {}
        self._background: set[asyncio.Task] = set()   # prefill followers and aborts in flight

    # ---- public ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       deadline: float | None = None) -> AsyncIterator[tuple[Chunk, Generation]]:
        """Chunks of new tokens; the last has a finish_reason. Raises RouterError. deadline: the
        client's (time.monotonic()), which bounds its wait for a restarting worker."""
        if request_id in self.active:
            raise RouterError("INVALID_ARGUMENT", f"request_id {request_id!r} is already in flight")
        gen = Generation(request_id, prompt, params, Timing(time.perf_counter()), deadline=deadline)
        self.active[request_id] = gen
        try:
            while True:
                try:
                    async for chunk in self._attempt(gen):
                        if chunk.token_ids:
                            gen.generated.extend(chunk.token_ids)
                        if chunk.finish_reason is not None:
                            gen.workers.clear()   # the workers freed it themselves
                        yield chunk, gen
                        if chunk.finish_reason is not None:
                            return
                    yield Chunk([], "abort"), gen   # only an abort ends an attempt without a finish
                    return
                except WorkerFailure as fault:
                    await self._release(gen)
                    if gen.aborted:
                        yield Chunk([], "abort"), gen
                        return
                    gen.failed.add(fault.address)
                    if gen.timing.migrations >= self.options.migration_limit:
                        raise RouterError(fault.code, fault.client_message(),
                                          detail=f"after {gen.timing.migrations} migration(s): {fault}") from None
                    gen.timing.migrations += 1
                    self.metrics.migrations.inc()
                    log.warning("request %s migrates (%d/%d) after %s", request_id, gen.timing.migrations,
                                self.options.migration_limit, fault)
        finally:
            self.active.pop(request_id, None)
            if gen.workers:
                await self._release(gen)

    async def abort(self, request_id: str) -> bool:
        gen = self.active.get(request_id)
        if gen is None:
            return False
        gen.aborted = True
        await self._release(gen)
        return True

    def _tokens_left(self, worker: WorkerHandle) -> list[int]:
        """Output tokens still to come of each request placed on worker (routing's decode load)."""
        return [gen.params.max_tokens - len(gen.generated) for gen in self.active.values() if worker in gen.workers]

    # ---- one attempt ----------------------------------------------------------------------
    def _attempt(self, gen: Generation) -> AsyncIterator[Chunk]:
        return self._colocated(gen) if self.pool.colocated else self._disaggregated(gen)

    def _keys(self, gen: Generation) -> list[int]:
        """The chain keys of the request's full blocks (what the workers' prefix caches hold)."""
        bs = self.placement.block_size
        return request_keys([*gen.prompt, *gen.generated], bs, gen.params.cache_salt) \
            if bs and self.placement.kv_aware else []

    def _prefix_in_flight(self, route: Route, keys: list[int]) -> bool:
        """The route's worker has this prompt's prefix only in flight: an earlier request routed
        there is still computing or receiving those blocks, and a sequence cannot share blocks
        that are not computed yet (they would be shipped or computed a second time, and a burst
        sharing a new prefix would never hit)."""
        return bool(keys) and self.placement.kv_aware and bool(self.placement.costs.affinity_weight) \
            and route.decode.index.pending_blocks(keys) > 0

    async def _await_prefix_in_flight(self, gen: Generation, keys: list[int], n_tokens: int, deadline: float) -> None:
        """Wait until the best route's worker holds the prefix it has in flight, or the request
        computing it there has its KV in place or is gone (PrefixIndex.settle), or deadline (loop
        time). A remote prefill would queue behind that request at the prefill worker anyway."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            try:
                route = self.placement.decode_routes(keys, n_tokens, gen.params.max_tokens, gen.failed)[0]
            except NoWorker:
                return
            if not self._prefix_in_flight(route, keys):
                return
            await self.pool.wait_changed(deadline - loop.time())

    async def _disaggregated(self, gen: Generation) -> AsyncIterator[Chunk]:
        # A role restarting: wait here, every request on its own clock, rather than at the head of
        # the admission queue (one at a time) or holding a decode reservation whose lease may lapse.
        await self._await_role(gen, "decode")
        if not self.placement.conditional:   # conditional: with no prefill worker it prefills locally
            await self._await_role(gen, "prefill")
        keys = self._keys(gen)
        n_tokens = len(gen.prompt) + len(gen.generated)
        loop = asyncio.get_running_loop()
        wait_until = None   # for a prefix in flight on the chosen worker: at most the stall timeout
        while True:
            picked = await self._reserve(gen, keys, wait_for_prefix=wait_until is None or loop.time() < wait_until)
            if picked is not None:
                break
            if wait_until is None:
                wait_until = loop.time() + self.options.stall_timeout_s
                self.metrics.prefix_waits.inc()
            await self._await_prefix_in_flight(gen, keys, n_tokens, wait_until)
        decode, route, reservation, routed_at = picked
        try:
            async with contextlib.aclosing(self._disaggregated_on(gen, keys, n_tokens, decode, route, reservation,
                                                                  routed_at)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.pool.settle(decode, keys)

    async def _disaggregated_on(self, gen: Generation, keys: list[int], n_tokens: int, decode: WorkerHandle,
                                route: Route, reservation: worker_pb2.ReserveResponse | None, routed_at: float
                                ) -> AsyncIterator[Chunk]:
        t = gen.timing
        if not gen.generated:
            t.prefill_route = "local" if route.local else "remote"
            t.estimated_local_ms, t.estimated_remote_ms = route.local_ms, route.remote_ms
            t.threshold_tokens = route.threshold_tokens
        self.metrics.count_route("local" if route.local else "remote")
        decode.index.note_routed(keys)
        if route.local:
            async for chunk in self._local(gen, decode, decode.decode.Generate, routed_at,
                                           self.placement.uncached(decode, keys, n_tokens), keys):
                yield chunk
            return
        if not gen.generated:
            t.decode_cached_tokens = len(reservation.held_block_hashes) * (self.placement.block_size or 0)
        with self.pool.placed(decode):
            prefill, _ = await self._pick(gen, lambda: self.placement.pick_prefill(keys, n_tokens, gen.failed))
            prefill.index.note_routed(keys)
            gen.workers.add(prefill)
            with self.pool.placed(prefill, self.placement.uncached(prefill, keys, n_tokens)):
                call = prefill.prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id=gen.worker_request_id, prompt_token_ids=gen.prompt, output_token_ids=gen.generated,
                    params=params_to_proto(gen.params),
                    target=worker_pb2.KVTarget(address=decode.kv_address, transfer_token=reservation.transfer_token,
                                               needed_block_indices=reservation.needed_block_indices)))
                first_token: asyncio.Future[worker_pb2.FirstToken] = asyncio.get_running_loop().create_future()
                follow = self._spawn(self._follow_prefill(call, prefill, decode, gen, first_token))
                try:
                    first = await first_token
                    self._first_token(gen, first, "remote", routed_at)
                    first_logprobs = [first.logprob] if first.HasField("logprob") else None
                    if first.HasField("finish_reason"):   # the first token ends it: no decode needed
                        await self._release(gen)
                        yield Chunk([first.token_id], first.finish_reason, first_logprobs)
                        return
                    yield Chunk([first.token_id], None, first_logprobs)
                    decode_call = decode.decode.Decode(worker_pb2.DecodeRequest(
                        request_id=gen.worker_request_id, first_token_id=first.token_id,
                        kv_wait_ms=int(self.options.stall_timeout_s * 1e3)))
                    first_event = True
                    async for event in self._events(decode_call, decode, gen):
                        if first_event:
                            self.pool.settle(decode, keys)   # admitted: every block of the prompt is held there
                            if not t.first_decode_step_ms:
                                t.first_decode_step_ms = event.first_decode_step_ms
                        first_event = False
                        yield self._chunk(event, decode, gen)
                        if event.finished:
                            return
                    if not gen.aborted:
                        raise WorkerFailure(decode.address, "UNAVAILABLE", "decode stream ended early")
                except Exception:   # a fault: stop following this prefill
                    follow.cancel()
                    raise
                finally:
                    # On success, or when the caller stops reading (GeneratorExit, cancellation), the
                    # follower runs on until the prefill stream ends: KVDelivered still comes, and the
                    # prefill worker is not cancelled mid-acknowledgement.
                    if not first_token.done():
                        first_token.cancel()
                    self.pool.settle(prefill, keys)

    def _first_token(self, gen: Generation, first: worker_pb2.FirstToken, route: str, routed_at: float) -> None:
        """Record the first token's worker-side breakdown, and learn the route's overhead from it."""
        if gen.generated:
            return
        t = gen.timing
        t.queue_ms, t.prefill_ms, t.cached_tokens = first.queue_ms, first.prefill_ms, first.num_cached_tokens
        self.placement.costs.observe_overhead(route, (time.perf_counter() - routed_at) * 1e3,
                                              first.queue_ms + first.prefill_ms)

    async def _follow_prefill(self, call, prefill: WorkerHandle, decode: WorkerHandle, gen: Generation,
                              first_token: asyncio.Future) -> None:
        """The whole prefill stream: the sampled token resolves first_token, KVDelivered gives the
        exposed transfer time. A fault before the token fails first_token; one after it (the KV
        may be incomplete) is reported to the decode worker."""
        try:
            async for event in self._events(call, prefill, gen):
                if event.HasField("first_token") and not first_token.done():
                    first_token.set_result(event.first_token)
                elif event.HasField("kv_delivered") and not gen.timing.kv_transfer_ms:
                    delivered = event.kv_delivered
                    gen.timing.kv_transfer_ms = delivered.exposed_ms
                    gen.timing.kv_bytes += delivered.bytes
                    self.placement.costs.observe_transfer(delivered.exposed_blocks, delivered.exposed_ms)
            if not first_token.done():
                raise WorkerFailure(prefill.address, "UNAVAILABLE", "prefill ended without a token")
        except (WorkerFailure, RouterError) as exc:
            if not first_token.done():
                first_token.set_exception(exc)
                return
            # The KV may not all have arrived: if the decode worker still waits for blocks, it fails
            # the reservation now (the decode call then fails and the request migrates); a request
            # it already admitted is left alone.
            log.info("prefill of %s ended after its token: %s", gen.request_id, exc)
            try:
                await decode.decode.FailTransfer(worker_pb2.FailTransferRequest(
                    request_id=gen.worker_request_id, reason=str(exc)), timeout=RPC_TIMEOUT_S / 2)
            except grpc.aio.AioRpcError as rpc:
                log.info("FailTransfer of %s on %s: %s", gen.request_id, decode.address, rpc.code().name)

    async def _colocated(self, gen: Generation) -> AsyncIterator[Chunk]:
        if sum(w.status.num_waiting for w in self.pool.healthy("both") if w.status) > self.options.max_queued_requests:
            raise self.admission.full_error()
        keys = self._keys(gen)
        n_tokens = len(gen.prompt) + len(gen.generated)
        def best() -> Route:
            return self.placement.decode_routes(keys, n_tokens, gen.params.max_tokens, gen.failed)[0]
        route = await self._pick(gen, best)
        if self._prefix_in_flight(route, keys):
            self.metrics.prefix_waits.inc()
            await self._await_prefix_in_flight(gen, keys, n_tokens,
                                               asyncio.get_running_loop().time() + self.options.stall_timeout_s)
            route = await self._pick(gen, best)
        worker = route.decode
        gen.workers.add(worker)
        if not gen.generated:
            gen.timing.prefill_route = "colocated"
        worker.index.note_routed(keys)
        try:
            async for chunk in self._local(gen, worker, worker.colocated.Generate, time.perf_counter(),
                                           self.placement.uncached(worker, keys, n_tokens), keys):
                yield chunk
        finally:
            self.pool.settle(worker, keys)

    async def _local(self, gen: Generation, worker: WorkerHandle, rpc, routed_at: float,
                     uncached: int, keys: list[int]) -> AsyncIterator[Chunk]:
        """Prefill and decode on one worker (a colocated one, or a decode worker prefilling
        locally): rpc is its Generate. uncached counts as queued prompt tokens there until the
        first token; then the prompt's blocks (keys) are held there."""
        with self.pool.placed(worker), contextlib.ExitStack() as queued:
            queued.enter_context(self.pool.placed(worker, uncached, count=False))
            call = rpc(worker_pb2.GenerateLocalRequest(
                request_id=gen.worker_request_id, prompt_token_ids=gen.prompt, output_token_ids=gen.generated,
                params=params_to_proto(gen.params)))
            async for event in self._events(call, worker, gen):
                if event.HasField("progress"):   # queued or prefilling there: alive (the watchdog saw it)
                    continue
                if event.HasField("first_token"):
                    first = event.first_token
                    queued.close()
                    self.pool.settle(worker, keys)
                    self._first_token(gen, first, "local", routed_at)
                    if not gen.generated and gen.timing.prefill_route == "local":
                        gen.timing.decode_cached_tokens = first.num_cached_tokens
                    yield Chunk([first.token_id], first.finish_reason if first.HasField("finish_reason") else None,
                                [first.logprob] if first.HasField("logprob") else None)
                    if first.HasField("finish_reason"):
                        return
                else:
                    yield self._chunk(event.decode, worker, gen)
                    if event.decode.finished:
                        return
            if not gen.aborted:
                raise WorkerFailure(worker.address, "UNAVAILABLE", "worker stream ended early")

    # ---- pieces ---------------------------------------------------------------------------
    @staticmethod
    def _chunk(event: worker_pb2.DecodeEvent, worker: WorkerHandle, gen: Generation) -> Chunk:
        """A decode event as a chunk. A worker ending the request with "abort" that nobody asked
        for (its engine failed, or it was told by a stale abort) is a fault: the request moves."""
        if event.finished and event.finish_reason == "abort" and not gen.aborted:
            raise WorkerFailure(worker.address, "ABORTED", "the worker aborted the request")
        return Chunk(list(event.token_ids), event.finish_reason if event.finished else None,
                     list(event.logprobs) or None)

    async def _reserve(self, gen: Generation, keys: list[int], wait_for_prefix: bool
                       ) -> tuple[WorkerHandle, Route, worker_pb2.ReserveResponse | None, float] | None:
        """The decode worker and route, waiting in the admission queue while every decode worker
        is full. A remote route reserves blocks for the whole sequence there (the response); a
        local one needs no reservation (None). Also returns when the route was chosen. None (with
        wait_for_prefix) when the chosen worker has the prompt's prefix only in flight: the caller
        waits for it out of the queue, and asks again."""
        request = worker_pb2.ReserveRequest(request_id=gen.worker_request_id, prompt_token_ids=gen.prompt,
                                            output_token_ids=gen.generated, params=params_to_proto(gen.params),
                                            lease_ms=self.options.kv_lease_ms)
        n_tokens = len(gen.prompt) + len(gen.generated)
        now = time.monotonic()
        deadline = now + self.options.queue_timeout_s
        own = gen.deadline is not None and gen.deadline - DEADLINE_MARGIN_S < deadline
        if own:   # the client's deadline bounds the queue too
            deadline = gen.deadline - DEADLINE_MARGIN_S
        t0 = time.perf_counter()
        # A deadline already inside the margin still gets one try at placement (no wait).
        deadline = max(deadline, now + MIN_TURN_S)
        try:
            async with self.admission.turn(deadline - now):
                return await self._place(gen, request, keys, n_tokens, wait_for_prefix, deadline, t0)
        except RouterError as exc:   # it waited behind a request waiting for a restarting role: say so
            role = "both" if self.pool.colocated else "decode"
            if exc.code == "RESOURCE_EXHAUSTED" and self.pool.outage_started(role) is not None:
                raise self._outage_error(NoWorker(role), own) from None
            raise

    async def _place(self, gen: Generation, request: worker_pb2.ReserveRequest, keys: list[int], n_tokens: int,
                     wait_for_prefix: bool, deadline: float, t0: float
                     ) -> tuple[WorkerHandle, Route, worker_pb2.ReserveResponse | None, float] | None:
        """_reserve as the head of the admission queue, until deadline (monotonic)."""
        while True:
            routes = await self._pick(gen, lambda: self.placement.decode_routes(
                keys, n_tokens, gen.params.max_tokens, gen.failed))
            for route in routes:
                worker = route.decode
                bs = worker.status.block_size if worker.status and worker.status.block_size else 1
                if worker.status is not None and worker.free_blocks < -(-n_tokens // bs):
                    continue   # cannot fit: do not ask
                if wait_for_prefix and self._prefix_in_flight(route, keys):
                    return None
                routed_at = time.perf_counter()
                response = None
                if not route.local:
                    try:
                        response = await worker.decode.Reserve(request, timeout=RPC_TIMEOUT_S)
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code().name
                        if code in REQUEST_ERRORS:
                            raise RouterError(code, f"a worker refused the request ({code})",
                                              detail=f"{worker.address}: {exc.details()}") from None
                        if code != "RESOURCE_EXHAUSTED":
                            self.pool.mark_down(worker)
                        continue
                gen.workers.add(worker)
                if not gen.generated:
                    self.metrics.request_queue_time_seconds.observe(time.perf_counter() - t0)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("route %s: %s", gen.request_id, "; ".join(
                        f"{r.decode.address}{'*' if r is route else ''} {'local' if r.local else 'remote'} "
                        f"held={r.decode_cached_blocks} local={r.local_ms:.1f} remote={r.remote_ms:.1f} "
                        f"cost={r.cost:.1f} running={self.placement.load(r.decode).running} "
                        f"free={r.decode.free_blocks}" for r in routes))
                return worker, route, response, routed_at
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RouterError("RESOURCE_EXHAUSTED", f"no decode capacity for {n_tokens} tokens within "
                                  f"{self.options.queue_timeout_s:g}s",
                                  retry_after_s=self.admission.retry_after_s())
            await self.pool.wait_changed(remaining)

    async def _pick(self, gen: Generation, pick):
        """pick() from the pool. With no healthy worker of the role, wait for one to come back (a
        restart): until worker_wait_s after the role lost its last worker (the same time for every
        waiter), or until just before the request's own deadline; then fail UNAVAILABLE."""
        while True:
            try:
                return pick()
            except NoWorker as exc:
                now = time.monotonic()
                since = self.pool.outage_started(exc.role)
                since = now if since is None else since
                until = since + self.options.worker_wait_s
                own = gen.deadline is not None and gen.deadline - DEADLINE_MARGIN_S < until
                if own:
                    until = gen.deadline - DEADLINE_MARGIN_S
                if now >= until:
                    raise self._outage_error(exc, own) from None
                await self.pool.wait_changed(until - now)

    def _outage_error(self, exc: NoWorker, own_deadline: bool) -> RouterError:
        now = time.monotonic()
        since = self.pool.outage_started(exc.role) or now
        why = ("before this request's deadline" if own_deadline else
               f"within worker_wait_s={self.options.worker_wait_s:g}s of losing the last one")
        return RouterError("UNAVAILABLE", f"{exc}: none for {now - since:.1f}s, and none came back {why}")

    async def _await_role(self, gen: Generation, role: str) -> None:
        """Wait (as _pick) until the role has a healthy worker."""
        def check() -> None:
            if not self.pool.healthy(role):
                raise NoWorker(role)
        await self._pick(gen, check)

    async def _events(self, call, worker: WorkerHandle, gen: Generation):
        """A worker stream under the progress watchdog. Faults become WorkerFailure; an abort
        requested through the router ends the stream quietly."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(call.read(), self.options.stall_timeout_s)
                except asyncio.TimeoutError:
                    raise WorkerFailure(worker.address, "DEADLINE_EXCEEDED",
                                        f"no progress for {self.options.stall_timeout_s:g}s") from None
                if event is grpc.aio.EOF:
                    return
                yield event
        except grpc.aio.AioRpcError as exc:
            if gen.aborted:
                return
            code = exc.code().name
            if code in REQUEST_ERRORS:
                raise RouterError(code, f"a worker refused the request ({code})",
                                  detail=f"{worker.address}: {exc.details()}") from None
            if code == "UNAVAILABLE":
                self.pool.mark_down(worker)
            raise WorkerFailure(worker.address, code, exc.details() or code) from None
        finally:
            call.cancel()

    async def _release(self, gen: Generation) -> None:
        """Free the request on every worker that may hold it (reservations, pins, sequences). The
        aborts run in the background: a frozen worker must not hold up a migration (it frees the
        request itself anyway, when its streams break or its lease lapses)."""
        workers, gen.workers = gen.workers, set()
        for worker in workers:
            self._spawn(self._abort_on(worker, gen.worker_request_id))

    def _spawn(self, coro) -> asyncio.Task:
        """A task that outlives its creator: held here until done (the loop keeps only weak
        references, and a collected task would cancel its call mid-way)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _abort_on(self, worker: WorkerHandle, request_id: str) -> None:
        try:
            await worker.info.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=RPC_TIMEOUT_S / 2)
        except grpc.aio.AioRpcError as exc:
            log.info("abort of %s on %s: %s", request_id, worker.address, exc.code().name)
