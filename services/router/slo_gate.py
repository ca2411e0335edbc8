"""Admission by prediction (--slo-admission), at the router: a new request predicted to miss its
TTFT target is refused at once with a retry hint, one with a TPOT target no worker can keep is
refused as invalid, a decode worker takes only requests that keep every TPOT target there, and a
request still waiting past its TTFT target is shed. The targets and the overload shares are slo.py's."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.services.router.admission import AdmissionQueue
from pdserve.services.router.errors import RouterError
from pdserve.services.router.generation_state import Generation
from pdserve.services.router.placement import Placement, Route
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.slo import (OverloadShares, SloPolicy, predicted_wait_ms, retry_after_s,
                                         step_ms_with_one_more)
from pdserve.services.router.worker_pool import NoWorker, WorkerHandle, WorkerPool


@dataclass(eq=False)
class SloGate:
    pool: WorkerPool
    placement: Placement
    admission: AdmissionQueue
    metrics: RouterMetrics
    slo: SloPolicy = field(default_factory=SloPolicy)
    tpot_targets: Callable[[WorkerHandle], list[float]] = lambda worker: []   # of the requests on a worker
    # Prompt tokens of requests admitted by prediction and not yet handed to a worker: a burst
    # arrives faster than it is placed, and each arrival's prediction must count the ones before it.
    unplaced_tokens: int = 0
    shares: OverloadShares = field(default_factory=OverloadShares)

    def predicted_ttft_ms(self, gen: Generation, route: Route, keys: list[int]) -> float:
        """The request's TTFT if it arrived now: its wait for decode capacity (disaggregated: the
        first free decode slot, then an admission interval per request ahead of it in the queue),
        the prompt tokens admitted before it and not yet placed (at the prefill workers' learned
        cost, shared among them), then the best route's estimate (the prefill worker's queue and
        compute, the transfer): route is its best one, keys its prompt's block keys."""
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

    def admit(self, gen: Generation, best_route: Callable[[], Route], keys: list[int]) -> None:
        """Refuse at once a new request predicted to miss its TTFT target (RouterError with a retry
        hint of the predicted excess); a migrating one, or one without a target, goes on. best_route:
        the request's best route now (raises NoWorker)."""
        target = self.slo.ttft_target_ms(gen.service)
        if not self.slo.admission or gen.generated or gen.timing.migrations:
            return
        self.check_tpot_reachable(gen)
        if target is None:
            return
        try:
            predicted = self.predicted_ttft_ms(gen, best_route(), keys)
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
