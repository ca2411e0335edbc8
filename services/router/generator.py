"""The router's generation core, independent of the client protocol (gRPC, HTTP): a thin
coordinator of one request's attempts.

Each attempt follows a route (services/router/routes.py): disaggregated (decode blocks reserved,
prefill on a prefill worker shipping the KV, decode continuing from the first token; or, with
conditional disaggregation, prefill on the decode worker itself) or colocated (one worker does both). Placement (services/router/placement.py) chooses the
workers and the route by their estimated cost to serve. Faults (services/router/migration.py): every
worker stream runs under a progress watchdog, a role restarting holds its requests for at most
``worker_wait_s``, and a request whose worker dies, stalls or loses the KV migrates: the prompt
plus every token already sent is prefilled again elsewhere, so the client sees one unbroken
stream; greedy and seeded requests produce exactly the tokens of a run without the fault.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import AsyncIterator

from pdserve.engine import SamplingParams
from pdserve.engine.quoting import quoted
from pdserve.services.common import tracing
from pdserve.services.router.admission import AdmissionQueue
from pdserve.services.router.config import GenerationOptions
from pdserve.services.router.errors import RouterError
from pdserve.services.router.generation_state import Chunk, Generation, Timing
from pdserve.services.router.migration import MigrationLoop, WorkerWatch
from pdserve.services.router.placement import CostModel, Placement
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.routes import DisaggregatedRoute, RouteContext, SessionTable, colocated
from pdserve.services.router.slo import ServiceClass, SloPolicy
from pdserve.services.router.slo_gate import SloGate
from pdserve.services.router.worker_pool import WorkerHandle, WorkerPool


class Generator:
    def __init__(self, pool: WorkerPool, options: GenerationOptions, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.options = options
        self.metrics = metrics
        self.admission = AdmissionQueue(options.max_queued_requests)
        costs = CostModel(options.itl_weight, options.cache_affinity_weight)
        self.placement = Placement(pool, options.routing, options.disaggregation, costs, self._tokens_left)
        self.active: dict[tuple[str, str], Generation] = {}   # (principal, request id) ->
        gate = SloGate(pool, self.placement, self.admission, metrics,
                       SloPolicy(options.slo_admission, options.slo_ttft_ms, options.slo_tpot_ms, options.slo_shed),
                       self._tpot_targets)
        self.routes = RouteContext(pool, options, metrics, self.placement, self.admission,
                                   WorkerWatch(pool, options.stall_timeout_s, options.worker_wait_s), gate,
                                   sessions=SessionTable(options.session_ttl_s, options.max_sessions))
        self.migration = MigrationLoop(options.migration_limit, metrics)
        self._disaggregated = DisaggregatedRoute(self.routes)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       deadline: float | None = None, service: ServiceClass = ServiceClass()
                       ) -> AsyncIterator[tuple[Chunk, Generation]]:
        """Chunks of new tokens; the last has a finish_reason. Raises RouterError. deadline: the
        client's (time.monotonic()), which bounds its wait for a restarting worker; service: its
        priority, client and latency targets (services/router/slo.py)."""
        key = (service.principal, request_id)   # ids are scoped to their caller's API key
        if key in self.active:
            raise RouterError("INVALID_ARGUMENT", f"request_id {quoted(request_id)} is already in flight")
        params = replace(params, priority=service.priority)   # the workers admit and preempt by it
        gen = Generation(request_id, prompt, params, Timing(time.perf_counter()), deadline=deadline, service=service)
        gen.trace = tracing.start("pdserve.request", request_id=request_id, prompt_tokens=len(prompt),
                                  max_tokens=params.max_tokens, priority=service.priority, user=service.client or None)
        self.active[key] = gen
        finish, error = None, None
        try:
            async with contextlib.aclosing(self.migration.run(gen, self._attempt, self.routes.release)) as chunks:
                async for chunk in chunks:
                    finish = chunk.finish_reason or finish
                    yield chunk, gen
        except RouterError as exc:
            error = f"{exc.code}: {exc.message}"
            raise
        finally:
            self.active.pop(key, None)
            self.routes.gate.placed_prompt(gen)   # refused or failed before its prompt reached a worker
            if gen.workers:
                await self.routes.release(gen)
            tracing.end(gen.trace, error, finish_reason=finish, output_tokens=len(gen.generated),
                        migrations=gen.timing.migrations, route=gen.timing.prefill_route or None)

    async def abort(self, request_id: str, principal: str = "") -> bool:
        """Abort the caller's (principal's) request of that id; False when it has none in flight."""
        gen = self.active.get((principal, request_id))
        if gen is None:
            return False
        gen.aborted = True
        await self.routes.release(gen)
        return True

    def _attempt(self, gen: Generation) -> AsyncIterator[Chunk]:
        return colocated(self.routes, gen) if self.pool.colocated else self._disaggregated(gen)

    def _tpot_targets(self, worker: WorkerHandle) -> list[float]:
        """The TPOT targets of the requests this router has on worker now."""
        slo = self.routes.gate.slo
        return [t for gen in self.active.values() if worker in gen.workers
                if (t := slo.tpot_target_ms(gen.service)) is not None]

    def _tokens_left(self, worker: WorkerHandle) -> list[int]:
        """Output tokens still to come of each request placed on worker (routing's decode load)."""
        return [gen.params.max_tokens - len(gen.generated) for gen in self.active.values() if worker in gen.workers]
