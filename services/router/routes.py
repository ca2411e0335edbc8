"""The routes one request's attempt can take, and what they share.

- **Disaggregated** (``DisaggregatedRoute``): reserve decode blocks (waiting in the admission
  queue while every decode worker is full, or the prefill worker is backlogged) → prefill on a
  prefill worker, which ships the KV chunk by chunk and streams the sampled token at once → that
  token goes to the client (TTFT) while the last blocks are still in flight, and the decode
  worker is asked to continue from it → tokens stream back. With conditional disaggregation the
  chosen route may instead prefill on the decode worker itself (``on_one_worker``).
- **Colocated** (``colocated``): one worker prefills and decodes, chosen by its cost to serve
  (services/router/placement.py); a prompt whose prefix is still in flight there waits for it first.
- **What they share** (``RouteContext``): the pool and its placement, the watchdog, the SLO gate
  (slo_gate.py), the prefix-in-flight wait, a worker's replies as chunks, and releasing a request
  on its workers in the background.
- **Multi-turn sessions** (``SessionTable``): which decode worker holds a conversation's KV. A
  request's session key is its ``session_id`` (gRPC field, HTTP extension), else its OpenAI
  ``user``. When a turn finishes on a decode (or colocated) worker, that worker holds the whole
  turn in its prefix cache — the history, the new message and the answer it generated — so the
  next turn's prompt (history + answer + new message) is cached there up to its new tokens. The
  table remembers the worker for ``session_ttl_s`` after the turn; the next turn's placement may
  then prefill on that worker, computing only what it lacks, wherever the cost model finds that
  cheaper than a prefill worker recomputing the history, even under ``--disaggregation always``.
  Bounded: at most ``max_sessions`` entries, least recently used dropped first.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TYPE_CHECKING

import grpc

from pdserve.services.common import tracing
from pdserve.services.common.proto_convert import params_to_proto
from pdserve.services.router.admission import AdmissionQueue, Turn
from pdserve.services.router.errors import RouterError, WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.migration import WorkerWatch, own_deadline, refused
from pdserve.services.router.placement import Placement, Route
from pdserve.services.router.prefix_index import request_keys
from pdserve.services.router.router_metrics import RouterMetrics
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
                     [first.logprob] if first.HasField("logprob") else None, list(first.prompt_logprobs) or None)

    def decode_chunk(self, event: worker_pb2.DecodeEvent, worker: WorkerHandle, gen: Generation) -> Chunk:
        """A decode event as a chunk. A worker ending the request with "abort" that nobody asked
        for (its engine failed, or it was told by a stale abort) is a fault: the request moves."""
        if event.finished and event.finish_reason == "abort" and not gen.aborted:
            raise WorkerFailure(worker.address, "ABORTED", "the worker aborted the request")
        if event.finished:   # the turn's KV (history, message, answer) is on that worker now
            self.sessions.turn_ended(gen.service.session_key, worker.address)
            if event.HasField("spec_decode"):
                gen.timing.spec_decode = event.spec_decode
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


async def colocated(ctx: RouteContext, gen: Generation) -> AsyncIterator[Chunk]:
    """One attempt on a colocated worker."""
    if sum(w.status.num_waiting for w in ctx.pool.healthy("both") if w.status) > ctx.options.max_queued_requests:
        raise ctx.admission.full_error()
    keys = ctx.keys(gen)
    ctx.gate.admit(gen, lambda: ctx.best_route(gen, keys), keys)   # --slo-admission: refused now rather than late
    route = await ctx.watch.pick(gen, lambda: ctx.best_route(gen, keys))
    if ctx.prefix_in_flight(route, keys):
        ctx.metrics.prefix_waits.inc()
        await ctx.await_prefix_in_flight(gen, keys, asyncio.get_running_loop().time() + ctx.options.stall_timeout_s)
        route = await ctx.watch.pick(gen, lambda: ctx.best_route(gen, keys))
    worker = route.decode
    gen.workers.add(worker)
    if not gen.generated:
        gen.timing.prefill_route = "colocated"
    worker.index.note_routed(keys)
    try:
        async for chunk in on_one_worker(ctx, gen, worker, worker.colocated.Generate, time.perf_counter(),
                                         ctx.placement.uncached(worker, keys, gen.n_tokens), keys):
            yield chunk
    finally:
        ctx.pool.settle(worker, keys)


async def on_one_worker(ctx: RouteContext, gen: Generation, worker: WorkerHandle, rpc, routed_at: float,
                        uncached: int, keys: list[int]) -> AsyncIterator[Chunk]:
    """Prefill and decode on one worker: rpc is its Generate. uncached counts as queued prompt
    tokens there until the first token; then the prompt's blocks (keys) are held there."""
    ctx.gate.placed_prompt(gen)
    with ctx.pool.placed(worker), contextlib.ExitStack() as queued:
        queued.enter_context(ctx.pool.placed(worker, uncached, count=False))
        call = rpc(worker_pb2.GenerateLocalRequest(
            request_id=gen.worker_request_id, prompt_token_ids=gen.prompt, output_token_ids=gen.generated,
            params=params_to_proto(gen.params)), metadata=tracing.metadata(gen.trace))
        async for event in ctx.watch.events(call, worker, gen):
            if event.HasField("progress"):   # queued or prefilling there: alive (the watchdog saw it)
                continue
            if event.HasField("first_token"):
                first = event.first_token
                queued.close()
                ctx.pool.settle(worker, keys)
                ctx.first_token(gen, first, "local", routed_at)
                if not gen.generated and gen.timing.prefill_route == "local":
                    gen.timing.decode_cached_tokens = first.num_cached_tokens
                yield ctx.first_chunk(first, first.HasField("finish_reason"))
                if first.HasField("finish_reason"):
                    return
            else:
                yield ctx.decode_chunk(event.decode, worker, gen)
                if event.decode.finished:
                    return
        if not gen.aborted:
            raise WorkerFailure(worker.address, "UNAVAILABLE", "worker stream ended early")


log = logging.getLogger(__name__)

MIN_TURN_S = 0.01              # the least time a request is given to be placed, deadline or not
# The final message waits this long at most for the prefill's KVDelivered (sent once the decode
# worker acknowledged the last block, so it is normally in already), whose figures its timings carry.
KV_DELIVERED_WAIT_S = 0.5

Placed = tuple[WorkerHandle, Route, "worker_pb2.ReserveResponse | None", float]


class DisaggregatedRoute:
    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    async def __call__(self, gen: Generation) -> AsyncIterator[Chunk]:
        """One attempt: place it, then prefill (remote or local) and decode."""
        ctx = self.ctx
        # A role restarting: wait here, every request on its own clock, rather than at the head of
        # the admission queue (one at a time) or holding a decode reservation whose lease may lapse.
        await ctx.watch.await_role(gen, "decode")
        if not ctx.placement.conditional and not ctx.pool.healthy("both"):
            await ctx.watch.await_role(gen, "prefill")   # else a decode or colocated worker may prefill it
        keys = ctx.keys(gen)
        ctx.gate.admit(gen, lambda: ctx.best_route(gen, keys), keys)   # --slo-admission: refused now rather than late
        loop = asyncio.get_running_loop()
        wait_until = None   # for a prefix in flight on the chosen worker: at most the stall timeout
        while True:
            picked = await self._reserve(gen, keys, wait_for_prefix=wait_until is None or loop.time() < wait_until)
            if picked is not None:
                break
            if wait_until is None:
                wait_until = loop.time() + ctx.options.stall_timeout_s
                ctx.metrics.prefix_waits.inc()
            await ctx.await_prefix_in_flight(gen, keys, wait_until)
        decode = picked[0]
        try:
            async with contextlib.aclosing(self._run(gen, keys, *picked)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            ctx.pool.settle(decode, keys)

    async def _run(self, gen: Generation, keys: list[int], decode: WorkerHandle, route: Route,
                   reservation: worker_pb2.ReserveResponse | None, routed_at: float) -> AsyncIterator[Chunk]:
        ctx, t = self.ctx, gen.timing
        if not gen.generated:
            t.prefill_route = "local" if route.local else "remote"
            t.estimated_local_ms, t.estimated_remote_ms = route.local_ms, route.remote_ms
            t.threshold_tokens = route.threshold_tokens
        ctx.metrics.count_route("local" if route.local else "remote")
        decode.index.note_routed(keys)
        if route.local:   # on a colocated member, its own service (the decode service is closed there)
            rpc = decode.colocated.Generate if decode.role == "both" else decode.decode.Generate
            async for chunk in on_one_worker(ctx, gen, decode, rpc, routed_at,
                                             ctx.placement.uncached(decode, keys, gen.n_tokens), keys):
                yield chunk
            return
        if not gen.generated:
            t.decode_cached_tokens = len(reservation.held_block_hashes) * (ctx.placement.block_size or 0)
        with ctx.pool.placed(decode):
            prefill, _ = await ctx.watch.pick(gen, lambda: ctx.placement.pick_prefill(keys, gen.n_tokens, gen.failed))
            prefill.index.note_routed(keys)
            gen.workers.add(prefill)
            ctx.gate.placed_prompt(gen)
            with ctx.pool.placed(prefill), contextlib.ExitStack() as queued:
                # its prompt tokens count as queued there until the first token (as on_one_worker's)
                queued.enter_context(ctx.pool.placed(prefill, ctx.placement.uncached(prefill, keys, gen.n_tokens),
                                                     count=False))
                call = prefill.prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id=gen.worker_request_id, prompt_token_ids=gen.prompt, output_token_ids=gen.generated,
                    params=params_to_proto(gen.params),
                    target=worker_pb2.KVTarget(address=decode.kv_address, transfer_token=reservation.transfer_token,
                                               needed_block_indices=reservation.needed_block_indices,
                                               data_address=reservation.data_address)),
                    metadata=tracing.metadata(gen.trace))
                first_token: asyncio.Future[worker_pb2.FirstToken] = asyncio.get_running_loop().create_future()
                follow = ctx.spawn(self._follow_prefill(call, prefill, decode, gen, first_token))
                try:
                    first = await first_token
                    queued.close()
                    ctx.first_token(gen, first, "remote", routed_at)
                    if first.HasField("finish_reason"):   # the first token ends it: no decode needed
                        await ctx.release(gen)
                        yield ctx.first_chunk(first, True)
                        return
                    yield ctx.first_chunk(first, False)
                    async with contextlib.aclosing(self._decode(gen, keys, decode, first.token_id)) as chunks:
                        async for chunk in chunks:
                            if chunk.finish_reason is not None and not follow.done():
                                await asyncio.wait((follow,), timeout=KV_DELIVERED_WAIT_S)
                            yield chunk
                except Exception:   # a fault: stop following this prefill
                    follow.cancel()
                    raise
                finally:
                    # On success, or when the caller stops reading (GeneratorExit, cancellation), the
                    # follower runs on until the prefill stream ends: KVDelivered still comes, and the
                    # prefill worker is not cancelled mid-acknowledgement.
                    if not first_token.done():
                        first_token.cancel()
                    ctx.pool.settle(prefill, keys)

    async def _decode(self, gen: Generation, keys: list[int], decode: WorkerHandle,
                      first_token_id: int) -> AsyncIterator[Chunk]:
        """The decode worker continues from the first token once its KV is in place."""
        ctx = self.ctx
        call = decode.decode_mux.decode(worker_pb2.DecodeRequest(
            request_id=gen.worker_request_id, first_token_id=first_token_id,
            kv_wait_ms=int(ctx.options.stall_timeout_s * 1e3), traceparent=tracing.traceparent(gen.trace)))
        first_event = True
        async for event in ctx.watch.events(call, decode, gen):
            if first_event:
                ctx.pool.settle(decode, keys)   # admitted: every block of the prompt is held there
                if not gen.timing.first_decode_step_ms:
                    gen.timing.first_decode_step_ms = event.first_decode_step_ms
            first_event = False
            yield ctx.decode_chunk(event, decode, gen)
            if event.finished:
                return
        if not gen.aborted:
            raise WorkerFailure(decode.address, "UNAVAILABLE", "decode stream ended early")

    async def _follow_prefill(self, call, prefill: WorkerHandle, decode: WorkerHandle, gen: Generation,
                              first_token: asyncio.Future) -> None:
        """The whole prefill stream: the sampled token resolves first_token, KVDelivered gives the
        exposed transfer time. A fault before the token fails first_token; one after it (the KV
        may be incomplete) is reported to the decode worker."""
        hand_off = None   # the span of the KV hand-off's exposed part: first token to the last block's ack
        try:
            async for event in self.ctx.watch.events(call, prefill, gen):
                if event.HasField("first_token") and not first_token.done():
                    first_token.set_result(event.first_token)
                    hand_off = tracing.start("pdserve.kv_transfer", gen.trace, prefill_worker=prefill.address,
                                             decode_worker=decode.address)
                elif event.HasField("kv_delivered") and not gen.timing.kv_transfer_ms:
                    delivered = event.kv_delivered
                    tracing.end(hand_off, blocks=delivered.blocks, bytes=delivered.bytes,
                                wire_bytes=delivered.wire_bytes, codec=delivered.codec or None,
                                exposed_ms=delivered.exposed_ms, streams=delivered.streams)
                    hand_off = None
                    gen.timing.kv_transfer_ms = delivered.exposed_ms
                    gen.timing.kv_bytes += delivered.bytes
                    gen.timing.kv_wire_bytes += delivered.wire_bytes
                    gen.timing.kv_streams += delivered.streams
                    gen.timing.kv_codec = delivered.codec or gen.timing.kv_codec
                    self.ctx.placement.costs.observe_transfer(delivered.exposed_blocks, delivered.exposed_ms)
            if not first_token.done():
                raise WorkerFailure(prefill.address, "UNAVAILABLE", "prefill ended without a token")
        except (WorkerFailure, RouterError) as exc:
            tracing.end(hand_off, f"{exc}")
            hand_off = None
            await self._after_prefill_fault(exc, decode, gen, first_token)
        finally:
            tracing.end(hand_off, "the prefill stream was cancelled")

    async def _after_prefill_fault(self, exc: Exception, decode: WorkerHandle, gen: Generation,
                                   first_token: asyncio.Future) -> None:
        """A prefill fault: before the token, the attempt fails with it; after, the KV may be short."""
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

    # ---- placement ------------------------------------------------------------------------
    async def _reserve(self, gen: Generation, keys: list[int], wait_for_prefix: bool) -> Placed | None:
        """The decode worker and route, waiting in the admission queue while every decode worker
        is full. A remote route reserves blocks for the whole sequence there (the response); a
        local one needs no reservation (None). Also returns when the route was chosen. None (with
        wait_for_prefix) when the chosen worker has the prompt's prefix only in flight: the caller
        waits for it out of the queue, and asks again."""
        ctx = self.ctx
        request = worker_pb2.ReserveRequest(request_id=gen.worker_request_id, prompt_token_ids=gen.prompt,
                                            output_token_ids=gen.generated, params=params_to_proto(gen.params),
                                            lease_ms=ctx.options.kv_lease_ms)
        now = time.monotonic()
        limit = ctx.options.queue_timeout_s   # None: no limit of the router's own
        deadline, own = own_deadline(gen, math.inf if limit is None else now + limit)   # the client's bounds it too
        bound = ("the request's own deadline" if own else
                 "" if limit is None else f"queue_timeout_s={limit:g}, set by --queue-timeout-s")
        shed_at = ctx.gate.ttft_deadline(gen)   # --slo-admission: shed once its TTFT target has passed
        shedding = shed_at is not None and shed_at < deadline
        if shedding:
            deadline = shed_at
        t0 = time.perf_counter()
        # A deadline already inside the margin still gets one try at placement (no wait).
        deadline = max(deadline, now + MIN_TURN_S)
        span = tracing.start("pdserve.admission", gen.trace, queued=len(ctx.admission))
        placed = error = None
        try:
            ticket = gen.service.ticket
            if gen.timing.migrations:
                ticket = dataclasses.replace(ticket, moved=True)
            async with ctx.admission.turn(deadline - now, ticket, bound) as turn:
                placed = await self._place(gen, request, keys, wait_for_prefix, turn, t0)
                return placed
        except RouterError as exc:   # it waited behind a request waiting for a restarting role: say so
            error = f"{exc.code}: {exc.message}"
            role = "both" if ctx.pool.colocated else "decode"   # "decode": colocated members too
            if exc.code == "RESOURCE_EXHAUSTED" and ctx.pool.outage_started(role) is not None:
                raise ctx.watch.outage_error(NoWorker(role), own) from None
            if exc.code == "RESOURCE_EXHAUSTED" and shedding and time.monotonic() >= shed_at:
                ctx.metrics.slo_shed.inc()
                waited = (time.monotonic() - gen.arrived) * 1e3
                raise RouterError("RESOURCE_EXHAUSTED", f"shed: waited {waited:.0f} ms for decode capacity, past its "
                                  f"TTFT target of {ctx.gate.slo.ttft_target_ms(gen.service):g} ms; retry later",
                                  retry_after_s=exc.retry_after_s) from None
            raise
        finally:
            tracing.end(span, error, decode_worker=placed[0].address if placed else None,
                        route=("local" if placed[1].local else "remote") if placed else None)

    async def _place(self, gen: Generation, request: worker_pb2.ReserveRequest, keys: list[int],
                     wait_for_prefix: bool, turn: Turn, t0: float) -> Placed | None:
        """_reserve as the head of the admission queue, until the turn's deadline (monotonic). A
        head that a worker would take but for its own TPOT target steps aside while it waits. A
        remote route waits while its prefill worker is backlogged (Placement.prefill_backlogged):
        its reservation would hold decode KV while the prompt waits there."""
        ctx, n_tokens = self.ctx, gen.n_tokens
        while True:
            routes = await ctx.watch.pick(gen, lambda: ctx.routes(gen, keys))
            own_target_only = False   # some worker would take it, were it not for its own TPOT target
            backlogged = ctx.placement.prefill_backlogged(keys, n_tokens, gen.failed)
            held_for_prefill = False   # some decode worker has room, but the prefill queue is long
            for route in routes:
                worker = route.decode
                if not ctx.placement.fits(worker, n_tokens):
                    continue   # cannot fit: do not ask
                if backlogged and not route.local:
                    held_for_prefill = True
                    continue   # its prompt would wait behind a backlog there: wait here instead
                if not ctx.gate.keeps_tpot(gen, worker):
                    own_target_only = own_target_only or ctx.gate.keeps_tpot(gen, worker, own=False)
                    continue   # one more sequence there would push a TPOT target past its limit
                if wait_for_prefix and ctx.prefix_in_flight(route, keys):
                    return None
                routed_at = time.perf_counter()
                response = None
                if not route.local:
                    try:
                        response = await worker.decode.Reserve(request, timeout=RPC_TIMEOUT_S,
                                                               metadata=tracing.metadata(gen.trace))
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code().name
                        error = refused(code, worker, exc.details())
                        if error is not None:
                            raise error from None
                        if code != "RESOURCE_EXHAUSTED":
                            ctx.pool.mark_down(worker)
                        continue
                gen.workers.add(worker)
                if not gen.generated:
                    ctx.metrics.request_queue_time_seconds.observe(time.perf_counter() - t0)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("route %s: %s", gen.request_id, "; ".join(
                        f"{r.decode.address}{'*' if r is route else ''} {'local' if r.local else 'remote'} "
                        f"held={r.decode_cached_blocks} local={r.local_ms:.1f} remote={r.remote_ms:.1f} "
                        f"cost={r.cost:.1f} running={ctx.placement.load(r.decode).running} "
                        f"free={r.decode.free_blocks}" for r in routes))
                return worker, route, response, routed_at
            remaining = turn.remaining()   # None: no deadline
            if remaining == 0:
                why = f" ({turn.bound})" if turn.bound else ""
                what = "room in a prefill worker's queue" if held_for_prefill else "decode capacity"
                raise RouterError("RESOURCE_EXHAUSTED", f"no {what} for {n_tokens} tokens within "
                                  f"{time.perf_counter() - t0:.3g}s{why}", retry_after_s=ctx.admission.retry_after_s())
            if own_target_only:
                await turn.step_aside(ctx.pool.wait_changed)
            else:
                await ctx.pool.wait_changed(remaining)


class SessionTable:
    def __init__(self, ttl_s: float, max_sessions: int, clock: Callable[[], float] = time.monotonic) -> None:
        """ttl_s 0: sessions off (nothing is remembered)."""
        if ttl_s < 0:
            raise ValueError(f"session_ttl_s must be >= 0, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._workers: OrderedDict[str, tuple[str, float]] = OrderedDict()   # key -> (address, expires)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._workers)

    def worker(self, key: str) -> str | None:
        """The address of the worker that served the session's last turn, within its TTL."""
        if not key or not self.enabled:
            return None
        entry = self._workers.get(key)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._workers[key]
            return None
        return entry[0]

    def turn_ended(self, key: str, address: str) -> None:
        """A turn of the session finished on the worker at address: its KV is there now."""
        if not key or not self.enabled:
            return
        self._workers[key] = (address, self.clock() + self.ttl_s)
        self._workers.move_to_end(key)
        while len(self._workers) > self.max_sessions:
            self._workers.popitem(last=False)
