"""The router's generation core, independent of the client protocol (gRPC, HTTP): a thin
coordinator of one request's attempts.

Each attempt follows a route strategy: disaggregated (services/router/route_disaggregated.py: decode
blocks reserved, prefill on a prefill worker shipping the KV, decode continuing from the first
token; or, with conditional disaggregation, prefill on the decode worker itself) or colocated
(services/router/route_colocated.py: one worker does both). Placement (services/router/placement.py) chooses the
workers and the route by their estimated cost to serve. Faults (services/router/migration.py): every
worker stream runs under a progress watchdog, a role restarting holds its requests for at most
``worker_wait_s``, and a request whose worker dies, stalls or loses the KV migrates: the prompt
plus every token already sent is prefilled again elsewhere, so the client sees one unbroken
stream; greedy and seeded requests produce exactly the tokens of a run without the fault.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from pdserve.engine import SamplingParams
from pdserve.engine.quoting import quoted
from pdserve.engine.settings import setting
from pdserve.services.common import tracing
from pdserve.services.router.admission import AdmissionQueue
from pdserve.services.router.cost_model import CostModel
from pdserve.services.router.errors import RouterError
from pdserve.services.router.generation_state import Chunk, Generation, Timing
from pdserve.services.router.prefix_index import DEFAULT_MAX_KEYS
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.router.migration import MigrationLoop, WorkerWatch
from pdserve.services.router.route_colocated import colocated
from pdserve.services.router.sessions import SessionTable
from pdserve.services.router.route_context import RouteContext
from pdserve.services.router.route_disaggregated import DisaggregatedRoute
from pdserve.services.router.placement import DISAGGREGATION_MODES, ROUTING_POLICIES, Placement
from pdserve.services.router.slo import MAX_TARGET_MS, ServiceClass, SloPolicy
from pdserve.services.router.worker_pool import WorkerHandle, WorkerPool


@dataclass(slots=True)
class GenerationOptions:
    migration_limit: int = setting(3, "times one request may move to another worker after a fault before it fails")
    stall_timeout_s: float = setting(10.0, "a worker stream silent this long is treated as failed (and the request "
                                           "migrates)")
    queue_timeout_s: float = setting(60.0, "how long a request may wait for decode capacity")
    max_queued_requests: int = setting(256, "requests waiting for decode capacity; more are refused at once with a "
                                            "retry hint")
    kv_lease_ms: int = setting(0, "idle KV lease asked for each reservation (0: the decode worker's default)")
    worker_wait_s: float = setting(
        60.0, "a role with no healthy worker (a restart) holds the requests that need it for at most this long, "
              "counted from when its last worker was lost, and every waiter by the same time (or its own "
              "deadline, sooner); then they fail UNAVAILABLE. `pdserve up` sets it from its workers' measured "
              "restart time", aliases=("--worker-wait",))
    routing: str = setting(
        "kv-aware", "how workers are chosen: kv-aware (by estimated cost to serve: uncached prompt tokens, from the "
                    "workers' prefix-cache events, queue and running load, KV blocks to ship) or load (fewest in "
                    "flight / queued prompt tokens)", choices=ROUTING_POLICIES)
    disaggregation: str = setting(
        "always", "always: every prompt is prefilled on a prefill worker; conditional: on the chosen decode worker "
                  "instead when the learned costs say it is cheaper (see /metrics and the response timings)",
        choices=DISAGGREGATION_MODES)
    itl_weight: float = setting(1.0, "conditional disaggregation: ms of time to first token worth one ms of delay "
                                     "added to each sequence decoding on the worker that would prefill locally")
    cache_affinity_weight: float = setting(
        1.0, "kv-aware routing: ms of cost per ms of prefill time of the prefix blocks another decode worker holds "
             "and the candidate lacks (0: only the transfer counts; 1: a prefix leaves its worker only when that "
             "worker's extra decode load costs more than computing the prefix again)")
    kv_index_max_keys: int = setting(DEFAULT_MAX_KEYS, "kv-aware routing: prefix-cache keys remembered per worker "
                                                       "(least recently seen dropped)")
    slo_admission: bool = setting(False, "admit by prediction: refuse at once (429 / RESOURCE_EXHAUSTED, with a "
                                         "retry hint) a request predicted to miss its TTFT target, offer a decode "
                                         "worker only requests that keep every TPOT target there, and shed a "
                                         "request still queued past its TTFT target")
    slo_ttft_ms: float = setting(0.0, "the deployment's time-to-first-token target in ms (0: none); a request's "
                                      "own (slo_ttft_ms) wins")
    slo_tpot_ms: float = setting(0.0, "the deployment's time-per-output-token target in ms (0: none); a request's "
                                      "own (slo_tpot_ms) wins")
    slo_shed: bool = setting(True, "with --slo-admission: shed a request still waiting for decode capacity once its "
                                   "TTFT target has passed, rather than serve it late")
    session_ttl_s: float = setting(600.0, "multi-turn sessions (session_id, else user): for this long after a turn, "
                                          "the next turn may prefill on the decode worker that holds the "
                                          "conversation's KV, computing only its new tokens (0: off)")
    max_sessions: int = setting(100_000, "sessions remembered (least recently used dropped)")

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
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not 0 <= getattr(self, name) <= MAX_TARGET_MS:
                raise ValueError(f"{name} must be in [0, {MAX_TARGET_MS:g}] ms, got {getattr(self, name)}")
        for name in ("migration_limit", "max_queued_requests", "kv_lease_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.session_ttl_s < 0 or self.max_sessions < 1:
            raise ValueError(f"session_ttl_s must be >= 0 and max_sessions >= 1, got {self.session_ttl_s}, "
                             f"{self.max_sessions}")
        for name in ("stall_timeout_s", "queue_timeout_s", "worker_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")



class Generator:
    def __init__(self, pool: WorkerPool, options: GenerationOptions, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.options = options
        self.metrics = metrics
        self.admission = AdmissionQueue(options.max_queued_requests)
        costs = CostModel(options.itl_weight, options.cache_affinity_weight)
        self.placement = Placement(pool, options.routing, options.disaggregation, costs, self._tokens_left)
        self.active: dict[tuple[str, str], Generation] = {}   # (principal, request id) ->
        self.routes = RouteContext(pool, options, metrics, self.placement, self.admission,
                                   WorkerWatch(pool, options.stall_timeout_s, options.worker_wait_s),
                                   SloPolicy(options.slo_admission, options.slo_ttft_ms, options.slo_tpot_ms,
                                             options.slo_shed), self._tpot_targets,
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
            self.routes.placed_prompt(gen)   # refused or failed before its prompt reached a worker
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
        slo = self.routes.slo
        return [t for gen in self.active.values() if worker in gen.workers
                if (t := slo.tpot_target_ms(gen.service)) is not None]

    def _tokens_left(self, worker: WorkerHandle) -> list[int]:
        """Output tokens still to come of each request placed on worker (routing's decode load)."""
        return [gen.params.max_tokens - len(gen.generated) for gen in self.active.values() if worker in gen.workers]
