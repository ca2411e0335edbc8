"""The router: validates and tokenizes, picks workers, orchestrates prefill → KV → decode,
and streams tokens back. Colocated workers ("both") are served through the same API."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from engine import SamplingParams
from engine.model_config import ModelConfig
from engine.tokenizer import load_tokenizer
from engine.validation import validate_request
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from services.convert import params_from_proto, params_to_proto
from services.detokenizer import IncrementalDetokenizer
from services.metrics import RouterMetrics
from services.worker_pool import NoWorker, WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

RESERVE_RETRY_S = 0.02


@dataclass(slots=True)
class RouterOptions:
    model: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    reserve_timeout_s: float = 30.0       # how long a request may wait for decode capacity
    reservation_deadline_ms: int = 30_000  # decode side frees a reservation not admitted by then
    worker_wait_s: float = 0.0             # with no healthy prefill/decode worker, wait this long (a restart)


@dataclass(eq=False)
class ActiveRequest:
    request_id: str
    workers: list[WorkerHandle] = field(default_factory=list)
    aborted: bool = False


@dataclass(slots=True)
class Timing:
    start: float
    first_token: float | None = None
    last_token: float | None = None
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    first_decode_step_ms: float = 0.0


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, options: RouterOptions, pool: WorkerPool, metrics: RouterMetrics | None = None) -> None:
        self.options = options
        self.pool = pool
        self.metrics = metrics or RouterMetrics()
        self.model_config = ModelConfig.from_dir(options.model)
        self.tokenizer = load_tokenizer(options.model)
        self.active: dict[str, ActiveRequest] = {}

    @property
    def max_model_len(self) -> int:
        lens = [w.status.max_model_len for w in self.pool.workers if w.status is not None]
        return min(lens) if lens else self.model_config.max_position_embeddings

    # ---- RPCs -----------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        eos = self.model_config.eos_token_ids
        block_sizes = [w.status.block_size for w in self.pool.workers if w.status is not None]
        return router_pb2.ModelInfo(
            model_name=self.options.model, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            eos_token_id=eos[0] if eos else 0, block_size=block_sizes[0] if block_sizes else 0,
            num_prefill_workers=len(self.pool.of_role("prefill")) + len(self.pool.of_role("both")),
            num_decode_workers=len(self.pool.of_role("decode")) + len(self.pool.of_role("both")))

    async def Abort(self, request, context):
        active = self.active.get(request.request_id)
        if active is None:
            return common_pb2.AbortResponse(found=False)
        active.aborted = True
        await self._abort_on_workers(active)
        return common_pb2.AbortResponse(found=True)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        timing = Timing(start=time.perf_counter())
        rid = request.request_id or uuid.uuid4().hex
        prompt, params, skip_special = await self._parse(request, rid, context)
        active = ActiveRequest(rid)
        self.active[rid] = active
        self.metrics.num_requests_running.inc()
        detok = IncrementalDetokenizer(self.tokenizer, skip_special)
        usage = router_pb2.Usage(prompt_tokens=len(prompt))
        finished = False
        try:
            events = (self._colocated(active, prompt, params, timing, usage, context) if self.pool.colocated
                      else self._disaggregated(active, prompt, params, timing, usage, context))
            async for token_ids, reason in events:
                now = time.perf_counter()
                if token_ids:
                    self._observe_tokens(timing, len(token_ids), now)
                    usage.completion_tokens += len(token_ids)
                msg = router_pb2.GenerateResponse(request_id=rid, token_ids=token_ids,
                                                  text=detok.add(token_ids, final=reason is not None))
                if reason is not None:
                    finished = True
                    msg.finished = True
                    msg.finish_reason = reason
                    msg.usage.CopyFrom(usage)
                    msg.timings.CopyFrom(self._timings(timing, now))
                    self._observe_finish(timing, usage, now)
                yield msg
        finally:
            self.active.pop(rid, None)
            self.metrics.num_requests_running.dec()
            if not finished:
                self.metrics.request_failure.inc()
                # Client gone, deadline passed or a worker failed: free the request everywhere.
                await asyncio.shield(self._abort_on_workers(active))

    # ---- request parsing --------------------------------------------------------
    async def _parse(self, request: router_pb2.GenerateRequest, rid: str, context: grpc.aio.ServicerContext
                     ) -> tuple[list[int], SamplingParams, bool]:
        if rid in self.active:
            await self._reject(context, f"request_id {rid!r} is already in flight")
        which = request.WhichOneof("input")
        if which is None:
            await self._reject(context, "input: give either text or token_ids")
        prompt = self.tokenizer.encode(request.text) if which == "text" else list(request.token_ids.ids)
        params = params_from_proto(request.params)
        try:
            validate_request(prompt, params, self.model_config.vocab_size, self.max_model_len)
        except ValueError as exc:
            await self._reject(context, str(exc))
        skip_special = request.params.skip_special_tokens if request.params.HasField("skip_special_tokens") else True
        return prompt, params, skip_special

    async def _reject(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.metrics.request_failure.inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    # ---- disaggregated path --------------------------------------------------------
    async def _disaggregated(self, active: ActiveRequest, prompt: list[int], params: SamplingParams, timing: Timing,
                             usage: router_pb2.Usage, context) -> AsyncIterator[tuple[list[int], str | None]]:
        rid = active.request_id
        decode, reservation = await self._reserve(active, prompt, params, context)
        try:
            done = await self._prefill(active, prompt, params, decode, reservation, context)
            if done is None:
                yield [], "abort"
                return
            timing.queue_ms, timing.prefill_ms, timing.kv_transfer_ms = done.queue_ms, done.prefill_ms, done.kv_transfer_ms
            usage.cached_tokens = done.num_cached_tokens
            if done.HasField("finish_reason"):   # the first token ends it: no decode needed
                await self._abort_worker(decode, rid)
                yield [done.first_token_id], done.finish_reason
                return
            yield [done.first_token_id], None
            call = decode.stub.Decode(worker_pb2.DecodeRequest(request_id=rid, first_token_id=done.first_token_id,
                                                               params=params_to_proto(params)))
            async for event in self._relay(call, active, context):
                if event.first_decode_step_ms:
                    timing.first_decode_step_ms = event.first_decode_step_ms
                yield list(event.token_ids), (event.finish_reason if event.finished else None)
                if event.finished:
                    return
            yield [], "abort"
        finally:
            decode.inflight -= 1

    async def _prefill(self, active: ActiveRequest, prompt: list[int], params: SamplingParams, decode: WorkerHandle,
                       reservation: worker_pb2.ReserveResponse, context) -> worker_pb2.PrefillDone | None:
        """Run the prompt on a prefill worker, which ships the KV blocks the decode worker lacks."""
        needed = set(reservation.needed_block_indices)
        prefill = await self._wait_for_worker(self.pool.pick_prefill, context)
        active.workers.append(prefill)
        prefill.inflight += 1
        prefill.inflight_prompt_tokens += len(prompt)
        kv_address = decode.status.kv_address if decode.status and decode.status.kv_address else decode.address
        done = None
        try:
            call = prefill.stub.Prefill(worker_pb2.PrefillRequest(
                request_id=active.request_id, prompt_token_ids=prompt, params=params_to_proto(params),
                decode_address=kv_address,
                skip_block_indices=[i for i in range(reservation.num_blocks) if i not in needed]))
            async for event in self._relay(call, active, context):
                if event.HasField("done"):
                    done = event.done
        finally:
            prefill.inflight -= 1
            prefill.inflight_prompt_tokens -= len(prompt)
        return done

    async def _wait_for_worker(self, pick, context):
        """pick() from the pool; with no healthy worker, retry for up to options.worker_wait_s, then UNAVAILABLE."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.worker_wait_s
        while True:
            try:
                return pick()
            except NoWorker as exc:
                if loop.time() >= deadline:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            await asyncio.sleep(RESERVE_RETRY_S)

    async def _reserve(self, active: ActiveRequest, prompt: list[int], params: SamplingParams, context
                       ) -> tuple[WorkerHandle, worker_pb2.ReserveResponse]:
        """Reserve decode blocks for the whole prompt, waiting while every decode worker is full."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.reserve_timeout_s
        request = worker_pb2.ReserveRequest(request_id=active.request_id, prompt_token_ids=prompt,
                                            max_tokens=params.max_tokens,
                                            deadline_ms=self.options.reservation_deadline_ms)
        while True:
            candidates = await self._wait_for_worker(self.pool.decode_candidates, context)
            for worker in candidates:
                worker.inflight += 1   # count it now, so concurrent requests spread over workers
                try:
                    response = await worker.stub.Reserve(request, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    worker.inflight -= 1
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        continue
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        await context.abort(exc.code(), exc.details())
                    self.pool.mark_down(worker)
                    continue
                except BaseException:   # cancelled while reserving
                    worker.inflight -= 1
                    raise
                active.workers.append(worker)
                return worker, response
            if loop.time() > deadline:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no decode capacity for {len(prompt)} prompt tokens within "
                                    f"{self.options.reserve_timeout_s}s")
            await asyncio.sleep(RESERVE_RETRY_S)

    # ---- colocated path -------------------------------------------------------------
    async def _colocated(self, active: ActiveRequest, prompt: list[int], params: SamplingParams, timing: Timing,
                         usage: router_pb2.Usage, context) -> AsyncIterator[tuple[list[int], str | None]]:
        try:
            worker = self.pool.decode_candidates()[0]
        except NoWorker as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        active.workers.append(worker)
        worker.inflight += 1
        try:
            call = worker.stub.GenerateLocal(worker_pb2.GenerateLocalRequest(
                request_id=active.request_id, prompt_token_ids=prompt, params=params_to_proto(params)))
            async for event in self._relay(call, active, context):
                if event.HasField("prefill_done"):
                    done = event.prefill_done
                    timing.queue_ms, timing.prefill_ms = done.queue_ms, done.prefill_ms
                    usage.cached_tokens = done.num_cached_tokens
                    yield [done.first_token_id], None
                else:
                    ev = event.decode
                    yield list(ev.token_ids), (ev.finish_reason if ev.finished else None)
                    if ev.finished:
                        return
        finally:
            worker.inflight -= 1
        yield [], "abort"

    # ---- helpers ----------------------------------------------------------------
    async def _relay(self, call, active: ActiveRequest, context):
        """Iterate a worker stream; a worker error ends the client's call with the same status,
        except that an abort requested through the router ends it normally with reason "abort"."""
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            if active.aborted:
                return
            await context.abort(exc.code(), f"worker: {exc.details()}")
        finally:
            call.cancel()

    async def _abort_on_workers(self, active: ActiveRequest) -> None:
        await asyncio.gather(*(self._abort_worker(w, active.request_id) for w in active.workers))

    async def _abort_worker(self, worker: WorkerHandle, rid: str) -> None:
        try:
            await worker.stub.Abort(common_pb2.AbortRequest(request_id=rid), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("abort of %s on %s failed: %s", rid, worker.address, exc.code())

    def _observe_tokens(self, timing: Timing, n: int, now: float) -> None:
        if timing.first_token is None:
            timing.first_token = now
            self.metrics.time_to_first_token_seconds.observe(now - timing.start)
        elif timing.last_token is not None:
            gap = (now - timing.last_token) / n
            for _ in range(n):
                self.metrics.inter_token_latency_seconds.observe(gap)
        timing.last_token = now
        self.metrics.generation_tokens.inc(n)

    def _observe_finish(self, timing: Timing, usage: router_pb2.Usage, now: float) -> None:
        self.metrics.request_success.inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.e2e_request_latency_seconds.observe(now - timing.start)
        self.metrics.request_queue_time_seconds.observe(timing.queue_ms / 1e3)
        self.metrics.kv_transfer_seconds.observe(timing.kv_transfer_ms / 1e3)

    def _timings(self, timing: Timing, now: float) -> router_pb2.Timings:
        ttft = ((timing.first_token or now) - timing.start) * 1e3
        return router_pb2.Timings(queue_ms=timing.queue_ms, prefill_ms=timing.prefill_ms,
                                  kv_transfer_ms=timing.kv_transfer_ms,
                                  first_decode_step_ms=timing.first_decode_step_ms,
                                  ttft_ms=ttft, e2e_ms=(now - timing.start) * 1e3)


async def serve_router(options: RouterOptions, host: str, port: int, metrics_port: int | None = None,
                       ready_timeout_s: float = 120.0, stop: asyncio.Event | None = None,
                       resolver=None, on_start=None) -> None:
    """Run the router until stop is set (or SIGINT/SIGTERM). resolver: see WorkerPool;
    on_start(bound_port) runs once serving."""

    from services.metrics import start_metrics_server
    from services.server import start_server, stop_on_signals

    pool = WorkerPool(options.prefill, options.decode, options.colocated, resolver=resolver)
    await pool.wait_ready(ready_timeout_s)
    pool.start()
    metrics = RouterMetrics()
    servicer = RouterServicer(options, pool, metrics)
    server, bound, _ = await start_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, servicer, "pdserve.v1.Router")], host, port)
    note = ""
    if metrics_port is not None:
        note = f", metrics on http://{host}:{start_metrics_server(metrics.registry, host, metrics_port)}/metrics"
    print(f"pdserve router listening on {host}:{bound}{note}", flush=True)
    if on_start is not None:
        on_start(bound)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=2)
        await pool.close()
