"""The disaggregated route: reserve decode blocks (waiting in the admission queue while every
decode worker is full) → prefill on a prefill worker, which ships the KV chunk by chunk and
streams the sampled token at once → that token goes to the client (TTFT) while the last blocks
are still in flight, and the decode worker is asked to continue from it → tokens stream back.
With conditional disaggregation the chosen route may instead prefill on the decode worker
itself (route_colocated.on_one_worker)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator

import grpc

from pdserve.v1 import worker_pb2
from pdserve.services.common import tracing
from pdserve.services.common.proto_convert import params_to_proto
from pdserve.services.router.admission import Turn
from pdserve.services.router.errors import RouterError, WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.migration import own_deadline, refused
from pdserve.services.router.route_colocated import on_one_worker
from pdserve.services.router.route_context import RPC_TIMEOUT_S, RouteContext
from pdserve.services.router.placement import Route
from pdserve.services.router.worker_pool import NoWorker, WorkerHandle

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
            with ctx.pool.placed(prefill, ctx.placement.uncached(prefill, keys, gen.n_tokens)):
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
        call = decode.decode.Decode(worker_pb2.DecodeRequest(
            request_id=gen.worker_request_id, first_token_id=first_token_id,
            kv_wait_ms=int(ctx.options.stall_timeout_s * 1e3)), metadata=tracing.metadata(gen.trace))
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
        deadline, own = own_deadline(gen, now + ctx.options.queue_timeout_s)   # the client's deadline bounds the queue too
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
            async with ctx.admission.turn(deadline - now, ticket) as turn:
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
        head that a worker would take but for its own TPOT target steps aside while it waits."""
        ctx, n_tokens = self.ctx, gen.n_tokens
        while True:
            routes = await ctx.watch.pick(gen, lambda: ctx.routes(gen, keys))
            own_target_only = False   # some worker would take it, were it not for its own TPOT target
            for route in routes:
                worker = route.decode
                if not ctx.placement.fits(worker, n_tokens):
                    continue   # cannot fit: do not ask
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
            remaining = turn.deadline - time.monotonic()
            if remaining <= 0:
                raise RouterError("RESOURCE_EXHAUSTED", f"no decode capacity for {n_tokens} tokens within "
                                  f"{time.perf_counter() - t0:.3g}s", retry_after_s=ctx.admission.retry_after_s())
            if own_target_only:
                await turn.step_aside(ctx.pool.wait_changed)
            else:
                await ctx.pool.wait_changed(remaining)
