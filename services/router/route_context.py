"""What the route strategies (route_colocated, route_disaggregated) share: the pool and its
placement, the watchdog, the prefix-in-flight wait, a request's first-token bookkeeping, and
releasing a request on its workers in the background."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, TYPE_CHECKING

import grpc

from pdserve.services.router.admission import AdmissionQueue
from pdserve.services.router.errors import RouterError, WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.migration import WorkerWatch
from pdserve.services.router.placement import Placement, Route
from pdserve.services.router.prefix_index import request_keys
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.sessions import SessionTable
from pdserve.services.router.slo import (OverloadShares, SloPolicy, predicted_wait_ms, retry_after_s,
    step_ms_with_one_more)
from pdserve.services.router.worker_pool import NoWorker, WorkerHandle, WorkerPool
from pdserve.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:
    from pdserve.services.router.config import GenerationOptions

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0           # unary internal calls (Reserve, Abort, FailTransfer)


@dataclass(eq=False)
class RouteContext:
    pool: WorkerPool
    options: GenerationOptions
    metrics: RouterMetrics
    placement: Placement
    admission: AdmissionQueue
    watch: WorkerWatch
    slo: SloPolicy = field(default_factory=SloPolicy)
    tpot_targets: Callable[[WorkerHandle], list[float]] = lambda worker: []   # of the requests on a worker
    # Prompt tokens of requests admitted by prediction and not yet handed to a worker: a burst
    # arrives faster than it is placed, and each arrival's prediction must count the ones before it.
    unplaced_tokens: int = 0
    shares: OverloadShares = field(default_factory=OverloadShares)
    sessions: SessionTable = field(default_factory=lambda: SessionTable(0, 1))   # default: off
    _background: set[asyncio.Task] = field(default_factory=set, repr=False)   # prefill followers, aborts

    def keys(self, gen: Generation) -> list[int]:
        """The chain keys of the request's full blocks (what the workers' prefix caches hold)."""
        bs = self.placement.block_size
        return request_keys([*gen.prompt, *gen.generated], bs, gen.params.cache_salt) \
            if bs and self.placement.kv_aware else []

    def routes(self, gen: Generation, keys: list[int]) -> list[Route]:
        """Every decode worker's offer for the request, best first (Placement.decode_routes); the
        worker its session's last turn ended on may prefill it. Raises NoWorker."""
        return self.placement.decode_routes(keys, gen.n_tokens, gen.params.max_tokens, gen.failed,
                                            session_worker=self.sessions.worker(gen.service.session_key))

    def best_route(self, gen: Generation, keys: list[int]) -> Route:
        return self.routes(gen, keys)[0]

    # ---- SLO admission (services/router/slo.py) -------------------------------------------
    def predicted_ttft_ms(self, gen: Generation, keys: list[int]) -> float:
        """The request's TTFT if it arrived now: its wait for decode capacity (disaggregated: the
        first free decode slot, then an admission interval per request ahead of it in the queue),
        the prompt tokens admitted before it and not yet placed (at the prefill workers' learned
        cost, shared among them), then the best route's estimate (the prefill worker's queue and
        compute, the transfer)."""
        route = self.best_route(gen, keys)
        if self.pool.colocated:
            worker = route.decode
            cost = self.placement.step_cost(worker)
            unplaced = self.unplaced_tokens * cost.ms_per_token / max(1, len(self.pool.healthy("both")))
            return unplaced + self.placement.costs.prefill_ms(cost, self.placement.load(worker),
                                                              self.placement.uncached(worker, keys, gen.n_tokens))
        # the first free decode slot, then one admission interval per request ahead of it in the queue's order
        wait = self.decode_wait_ms(gen) + predicted_wait_ms(self.admission.ahead_of(gen.service.ticket),
                                                           self.admission.admission_rate())
        prefill = self.pool.healthy("prefill")
        per_token = (sum(self.placement.step_cost(w).ms_per_token for w in prefill) / len(prefill)) if prefill else 0.0
        unplaced = self.unplaced_tokens * per_token / max(1, len(prefill))
        return wait + unplaced + (route.local_ms if route.local else route.remote_ms)

    def decode_wait_ms(self, gen: Generation) -> float:
        """How long until some decode worker can take the request: 0 where it fits now (its free
        blocks hold the prompt and one more sequence keeps the TPOT targets there); elsewhere, until
        the first of the sequences this router placed there ends (its tokens left, at the worker's
        step time now). The least over the decode workers; 0 when none is known."""
        bs = self.placement.block_size or 1
        need = -(-gen.n_tokens // bs)
        waits = []
        for worker in self.pool.healthy("decode"):
            if worker.free_blocks >= need and self.keeps_tpot(gen, worker):
                return 0.0
            left = self.placement.tokens_left(worker)
            if left:
                cost, load = self.placement.step_cost(worker), self.placement.load(worker)
                waits.append(min(left) * cost.decode_step_ms(max(1, load.running)))
        return min(waits, default=0.0)

    def placed_prompt(self, gen: Generation) -> None:
        """The request's prompt is on a worker now (or the request is gone): it no longer counts as
        admitted and unplaced."""
        self.unplaced_tokens -= gen.unplaced_tokens
        gen.unplaced_tokens = 0

    def admit_by_prediction(self, gen: Generation, keys: list[int]) -> None:
        """Refuse at once a new request predicted to miss its TTFT target (RouterError with a retry
        hint of the predicted excess); a migrating one, or one without a target, goes on."""
        target = self.slo.ttft_target_ms(gen.service)
        if not self.slo.admission or gen.generated or gen.timing.migrations:
            return
        self.check_tpot_reachable(gen)
        if target is None:
            return
        try:
            predicted = self.predicted_ttft_ms(gen, keys)
        except NoWorker:
            return   # no worker to predict with: it waits for one as any request does
        now, ticket = time.monotonic(), gen.service.ticket
        if predicted > target:
            self.metrics.slo_rejected.inc()
            self.shares.refused(ticket, now)
            raise RouterError("RESOURCE_EXHAUSTED", f"would miss its TTFT target: predicted {predicted:.0f} ms > "
                              f"{target:g} ms; retry later", retry_after_s=retry_after_s(predicted - target))
        why = self.shares.yields(ticket, now)
        if why is not None:
            self.metrics.slo_rejected.inc()
            raise RouterError("RESOURCE_EXHAUSTED", f"overloaded: {why}; retry later",
                              retry_after_s=retry_after_s(predicted))
        self.shares.admitted(ticket, now)
        gen.unplaced_tokens = gen.n_tokens
        self.unplaced_tokens += gen.n_tokens

    def ttft_deadline(self, gen: Generation) -> float | None:
        """When (monotonic) a request still waiting for capacity is shed: its TTFT target passed."""
        target = self.slo.ttft_target_ms(gen.service)
        if not (self.slo.admission and self.slo.shed_late) or target is None or gen.generated:
            return None
        return gen.arrived + target / 1e3

    def keeps_tpot(self, gen: Generation, worker: WorkerHandle, own: bool = True) -> bool:
        """Whether one more sequence on worker keeps the tightest TPOT target of this request (own)
        and of those already there (by the worker's learned step costs)."""
        if not self.slo.admission:
            return True
        mine = (self.slo.tpot_target_ms(gen.service),) if own else ()
        targets = [t for t in (*mine, *self.tpot_targets(worker)) if t is not None]
        if not targets:
            return True
        cost, load = self.placement.step_cost(worker), self.placement.load(worker)
        return step_ms_with_one_more(cost.base_ms, cost.ms_per_seq, load.running) <= min(targets)

    def check_tpot_reachable(self, gen: Generation) -> None:
        """A TPOT target of the request's own that no decode worker keeps even with nothing else
        running there: no wait would place it, so it is refused at arrival (RouterError
        INVALID_ARGUMENT naming slo_tpot_ms and the fastest step), not queued to block others."""
        own = gen.service.tpot_ms
        if not self.slo.admission or own is None or own < self.slo.tpot_ms or gen.generated:
            return
        workers = self.pool.healthy("both" if self.pool.colocated else "decode")
        fastest = min((step_ms_with_one_more(c.base_ms, c.ms_per_seq, 0)
                       for c in map(self.placement.step_cost, workers)), default=None)
        if fastest is not None and own < fastest:
            raise RouterError("INVALID_ARGUMENT", f"slo_tpot_ms must be at least {fastest:.3g} ms on this deployment "
                              f"(its fastest decode step with one sequence), got {own:g}", field="slo_tpot_ms")

    def prefix_in_flight(self, route: Route, keys: list[int]) -> bool:
        """The route's worker has this prompt's prefix only in flight: an earlier request routed
        there is still computing or receiving those blocks, and a sequence cannot share blocks
        that are not computed yet (they would be shipped or computed a second time, and a burst
        sharing a new prefix would never hit)."""
        return bool(keys) and self.placement.kv_aware and bool(self.placement.costs.affinity_weight) \
            and route.decode.index.pending_blocks(keys) > 0

    async def await_prefix_in_flight(self, gen: Generation, keys: list[int], deadline: float) -> None:
        """Wait until the best route's worker holds the prefix it has in flight, or the request
        computing it there has its KV in place or is gone (PrefixIndex.settle), or deadline (loop
        time). A remote prefill would queue behind that request at the prefill worker anyway."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            try:
                route = self.best_route(gen, keys)
            except NoWorker:
                return
            if not self.prefix_in_flight(route, keys):
                return
            await self.pool.wait_changed(deadline - loop.time())

    def first_token(self, gen: Generation, first: worker_pb2.FirstToken, route: str, routed_at: float) -> None:
        """Record the first token's worker-side breakdown, and learn the route's overhead from it."""
        if gen.generated:
            return
        t = gen.timing
        t.queue_ms, t.prefill_ms, t.cached_tokens = first.queue_ms, first.prefill_ms, first.num_cached_tokens
        self.placement.costs.observe_overhead(route, (time.perf_counter() - routed_at) * 1e3,
                                              first.queue_ms + first.prefill_ms)

    @staticmethod
    def first_chunk(first: worker_pb2.FirstToken, finish: bool) -> Chunk:
        return Chunk([first.token_id], first.finish_reason if finish else None,
                     [first.logprob] if first.HasField("logprob") else None)

    def decode_chunk(self, event: worker_pb2.DecodeEvent, worker: WorkerHandle, gen: Generation) -> Chunk:
        """A decode event as a chunk. A worker ending the request with "abort" that nobody asked
        for (its engine failed, or it was told by a stale abort) is a fault: the request moves."""
        if event.finished and event.finish_reason == "abort" and not gen.aborted:
            raise WorkerFailure(worker.address, "ABORTED", "the worker aborted the request")
        if event.finished:   # the turn's KV (history, message, answer) is on that worker now
            self.sessions.turn_ended(gen.service.session_key, worker.address)
        return Chunk(list(event.token_ids), event.finish_reason if event.finished else None,
                     list(event.logprobs) or None)

    async def release(self, gen: Generation) -> None:
        """Free the request on every worker that may hold it (reservations, pins, sequences). The
        aborts run in the background: a frozen worker must not hold up a migration (it frees the
        request itself anyway, when its streams break or its lease lapses)."""
        workers, gen.workers = gen.workers, set()
        for worker in workers:
            self.spawn(self._abort_on(worker, gen.worker_request_id))

    def spawn(self, coro) -> asyncio.Task:
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
