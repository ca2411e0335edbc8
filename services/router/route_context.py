"""What the route strategies (route_colocated, route_disaggregated) share: the pool and its
placement, the watchdog, the SLO gate (slo_gate.py), the prefix-in-flight wait, a worker's replies
as chunks, and releasing a request on its workers in the background."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.services.router.admission import AdmissionQueue
from pdserve.services.router.errors import WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.migration import WorkerWatch
from pdserve.services.router.placement import Placement, Route
from pdserve.services.router.prefix_index import request_keys
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.sessions import SessionTable
from pdserve.services.router.slo_gate import SloGate
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
    gate: SloGate
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
