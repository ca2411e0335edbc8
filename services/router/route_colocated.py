"""The route where one worker prefills and decodes: a colocated worker, or a decode worker
prefilling locally (conditional disaggregation). The worker is chosen by its cost to serve
(services/router/placement.py); a prompt whose prefix is still in flight there waits for it first."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from pdserve.v1 import worker_pb2
from pdserve.services.common import tracing
from pdserve.services.common.proto_convert import params_to_proto
from pdserve.services.router.errors import WorkerFailure
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.route_context import RouteContext
from pdserve.services.router.worker_pool import WorkerHandle


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
