"""The router's gRPC API (pdserve.v1.Router): maps requests to the request front
(services/api/request_front.py: limits, tokenizing, validation), runs them through the generation
core (services/router/generator.py), streams tokens and text back."""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, ContextManager, Sequence

import grpc

from pdserve.engine import SamplingParams
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.services.api.detokenizer import IncrementalDetokenizer
from pdserve.services.api.principals import ApiKeys, Principal, bound_to
from pdserve.services.api.request_front import FrontRequest, Prompt, RequestFront, TokenizeRequest, ValidatedRequest
from pdserve.services.api.request_limits import InvalidRequest, RequestLimits
from pdserve.services.api.router_facade import RouterFacade
from pdserve.services.common import tracing
from pdserve.services.common.fd_limit import raise_fd_limit
from pdserve.services.common.grpc_setup import check_port_free, service_registration, start_server, stop_on_signals
from pdserve.services.common.metrics import start_metrics_server
from pdserve.services.common.proofs import API_KEY_HEADER
from pdserve.services.common.proto_convert import params_from_proto
from pdserve.services.common.security import Credentials
from pdserve.services.router.admission import PendingGate
from pdserve.services.router.config import GenerationOptions, RouterConfig
from pdserve.services.router.errors import RouterError
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.generator import Generator
from pdserve.services.router.membership import (MembershipServicer, MembershipSettings,
    SERVICE_PREFIX as MEMBERSHIP_PREFIX)
from pdserve.services.router.router_metrics import RouterMetrics
from pdserve.services.router.slo import ServiceClass
from pdserve.services.router.worker_pool import WorkerPool
from pdserve.services.router.workers_file import WorkersFileWatcher
from pdserve.v1 import common_pb2, membership_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata on RESOURCE_EXHAUSTED: when to retry


@dataclass(slots=True)
class RouterOptions:
    model: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    limits: RequestLimits = field(default_factory=RequestLimits)
    config: RouterConfig = field(default_factory=RouterConfig)
    workers_file: str | None = None     # more members, from a watched file (services/router/workers_file.py)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, options: RouterOptions, pool: WorkerPool, metrics: RouterMetrics | None = None,
                 keys: ApiKeys | None = None) -> None:
        self.options = options
        self.keys = keys or ApiKeys(min_client_priority=options.config.min_client_priority)   # who calls
        self.pool = pool
        self.metrics = metrics or RouterMetrics()
        self.model_config = ModelConfig.from_dir(options.model)
        self.tokenizer = load_tokenizer(options.model)
        self.generator = Generator(pool, options.generation, self.metrics)
        self.draining = False
        self.pending = PendingGate(options.limits.max_pending_requests)   # both doors: gRPC and HTTP
        self.front = RequestFront(self.tokenizer, self.model_config.vocab_size, options.limits,
                                  lambda: self.max_model_len, served_model_names(options.config, options.model)[0])

    @property
    def max_model_len(self) -> int:
        lens = [w.status.max_model_len for w in self.pool.workers if w.status is not None]
        return min(lens) if lens else self.model_config.max_position_embeddings

    # ---- RPCs -----------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        eos = self.model_config.eos_token_ids
        return router_pb2.ModelInfo(
            model_name=self.options.model, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            eos_token_id=eos[0] if eos else 0, block_size=self.pool.block_size,
            num_prefill_workers=len(self.pool.of_role("prefill")) + len(self.pool.of_role("both")),
            num_decode_workers=len(self.pool.of_role("decode")) + len(self.pool.of_role("both")))

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        """Abort one of the caller's own requests (another API key's ids are not in its scope)."""
        principal = self.keys.identify(_authorization(context))
        found = principal is not None and await self.generator.abort(request.request_id, principal.name)
        return common_pb2.AbortResponse(found=found)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        try:
            with self.pending.hold():
                parsed = await self.parse(request, self.keys.identify(_authorization(context)))
        except RouterError as exc:
            self.metrics.request_failure.inc()
            await abort_with(context, exc, request.request_id)
        detok = IncrementalDetokenizer(self.tokenizer, parsed.skip_special_tokens)
        usage = router_pb2.Usage(prompt_tokens=len(parsed.prompt))
        self.metrics.num_requests_running.inc()
        finished = False
        try:
            remaining = context.time_remaining()   # the client's deadline, if it set one
            deadline = time.monotonic() + remaining if remaining is not None else None
            async for chunk, gen in self.generator.generate(parsed.request_id, parsed.prompt, parsed.params,
                                                            deadline, parsed.service):
                now = time.perf_counter()
                if chunk.token_ids:
                    self.observe_tokens(gen, len(chunk.token_ids), now)
                    usage.completion_tokens += len(chunk.token_ids)
                msg = router_pb2.GenerateResponse(request_id=parsed.request_id, token_ids=chunk.token_ids,
                                                  text=detok.add(chunk.token_ids, final=chunk.finish_reason is not None),
                                                  logprobs=chunk.logprobs or (),
                                                  prompt_logprobs=chunk.prompt_logprobs or ())
                if chunk.finish_reason is not None:
                    finished = True
                    msg.finished = True
                    msg.finish_reason = chunk.finish_reason
                    usage.cached_tokens = gen.timing.cached_tokens
                    msg.usage.CopyFrom(usage)
                    msg.timings.CopyFrom(timings(gen, now))
                    self.observe_finish(gen, usage, now)
                yield msg
        except RouterError as exc:
            await abort_with(context, exc, parsed.request_id)
        except Exception:  # noqa: BLE001 - a bug: the client gets no internal text, the log gets it all
            log.exception("request %s failed", parsed.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {parsed.request_id})")
        finally:
            self.metrics.num_requests_running.dec()
            if not finished:
                self.metrics.request_failure.inc()

    # ---- parsing ------------------------------------------------------------------
    async def parse(self, request: router_pb2.GenerateRequest, principal: Principal | None) -> ValidatedRequest:
        """Every check, cheapest first, before anything is allocated or tokenized. Raises RouterError.
        principal: the caller, by its API key (None: none of the keys; the interceptor refuses
        those before any handler runs)."""
        if self.draining:
            raise RouterError("UNAVAILABLE", "the router is draining (shutting down)")
        if principal is None:
            raise RouterError("UNAUTHENTICATED", "missing or wrong API key (send authorization: Bearer KEY)")
        try:
            front = front_request(request, self.front)
            try:
                front.service = bound_to(front.service, principal)
            except ValueError as exc:   # a priority beyond the caller's grant
                raise RouterError("PERMISSION_DENIED", str(exc), field="priority") from None
            return await self.front.prepare(front)
        except InvalidRequest as exc:
            raise RouterError("INVALID_ARGUMENT", exc.message, field=exc.field, too_large=exc.too_large) from None

    # ---- metrics --------------------------------------------------------------------
    def observe_tokens(self, gen: Generation, n: int, now: float) -> None:
        t = gen.timing
        if t.first_token is None:
            t.first_token = now
            self.metrics.time_to_first_token_seconds.observe(now - t.start)
        elif t.last_token is not None:
            gap = (now - t.last_token) / n
            for _ in range(n):
                self.metrics.inter_token_latency_seconds.observe(gap)
        t.last_token = now
        self.metrics.generation_tokens.inc(n)

    def observe_finish(self, gen: Generation, usage: router_pb2.Usage, now: float) -> None:
        self.metrics.request_success.inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.e2e_request_latency_seconds.observe(now - gen.timing.start)
        self.metrics.observe_tpot(gen.timing.first_token, now, usage.completion_tokens)
        self.metrics.kv_transfer_seconds.observe(gen.timing.kv_transfer_ms / 1e3)


class RouterServicerFacade(RouterFacade):
    """RouterFacade over the gRPC router's servicer: the HTTP API shares its request front, its
    pending gate, its generator and its metrics, and sees nothing else of it."""

    def __init__(self, servicer: RouterServicer) -> None:
        self._servicer = servicer

    @property
    def serving(self) -> bool:
        return self._servicer.pool.serving and not self._servicer.draining

    @property
    def draining(self) -> bool:
        return self._servicer.draining

    @property
    def max_model_len(self) -> int:
        return self._servicer.max_model_len

    @property
    def limits(self) -> RequestLimits:
        return self._servicer.options.limits

    @property
    def tokenizer(self):
        return self._servicer.tokenizer

    @property
    def metrics_registry(self):
        return self._servicer.metrics.registry

    def receiving(self) -> ContextManager[None]:
        return self._servicer.pending.hold()

    async def prepare(self, request: FrontRequest) -> ValidatedRequest:
        return await self._servicer.front.prepare(request)

    async def tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        return await self._servicer.front.tokenize(request)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._servicer.front.detokenize(token_ids)

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, service: ServiceClass
                 ) -> AsyncIterator[tuple[Chunk, Generation]]:
        return self._servicer.generator.generate(request_id, prompt, params, service=service)

    def observe_tokens(self, gen: Generation, n: int, now: float) -> None:
        self._servicer.observe_tokens(gen, n, now)

    def observe_finish(self, gen: Generation, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        usage = router_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                 cached_tokens=gen.timing.cached_tokens)
        self._servicer.observe_finish(gen, usage, now)

    def request_started(self) -> None:
        self._servicer.metrics.num_requests_running.inc()

    def request_ended(self, finished: bool) -> None:
        self._servicer.metrics.num_requests_running.dec()
        if not finished:
            self._servicer.metrics.request_failure.inc()

    def request_refused(self) -> None:
        self._servicer.metrics.request_failure.inc()


def front_request(request: router_pb2.GenerateRequest, front: RequestFront) -> FrontRequest:
    """The gRPC request in the front's terms, after the counts it carries (request_id, stop_token_ids)."""
    rid = request.request_id or uuid.uuid4().hex
    front.check_request_id(rid)
    msg = request.params
    front.check_stop_token_ids(len(msg.stop_token_ids))
    which = request.WhichOneof("input")
    prompt = None if which is None else Prompt(text=request.text) if which == "text" else \
        Prompt(token_ids=request.token_ids.ids)   # the repeated field itself: measured before it is copied
    skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
    return FrontRequest(rid, params_from_proto(msg), prompt, skip_special_tokens=skip, service=service_class(request),
                        bad_words=list(msg.bad_words))


def service_class(request: router_pb2.GenerateRequest) -> ServiceClass:
    """The request's scheduling class; InvalidRequest naming the field when one is out of range."""
    try:
        return ServiceClass(request.priority, request.user, request.slo_ttft_ms or None, request.slo_tpot_ms or None,
                            request.session_id)
    except ValueError as exc:
        raise InvalidRequest(str(exc), str(exc).split(" ", 1)[0]) from None


def timings(gen: Generation, now: float) -> router_pb2.Timings:
    t = gen.timing
    out = router_pb2.Timings(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms, kv_transfer_ms=t.kv_transfer_ms,
                             first_decode_step_ms=t.first_decode_step_ms,
                             ttft_ms=((t.first_token or now) - t.start) * 1e3, e2e_ms=(now - t.start) * 1e3,
                             migrations=t.migrations, prefill_route=t.prefill_route,
                             estimated_local_ms=t.estimated_local_ms, estimated_remote_ms=t.estimated_remote_ms,
                             decode_cached_tokens=t.decode_cached_tokens, kv_bytes=t.kv_bytes,
                             kv_wire_bytes=t.kv_wire_bytes, kv_streams=t.kv_streams, kv_codec=t.kv_codec)
    if t.spec_decode is not None:
        out.spec_decode.CopyFrom(t.spec_decode)
    if t.threshold_tokens is not None and math.isfinite(t.threshold_tokens):
        out.local_prefill_threshold_tokens = min(int(t.threshold_tokens), 2**32 - 1)
    return out


async def abort_with(context: grpc.aio.ServicerContext, exc: RouterError, request_id: str | None = None) -> None:
    """End the call with exc's status; its internal detail goes to the log, under the request id."""
    if exc.detail is not None:
        log.warning("request %s: %s: %s", request_id, exc.message, exc.detail)
    trailing = ((RETRY_AFTER_KEY, str(int(exc.retry_after_s * 1e3))),) if exc.retry_after_s else ()
    await context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN), exc.public_message(request_id),
                        trailing_metadata=trailing)


async def serve_router(options: RouterOptions, host: str, port: int, metrics_port: int | None = None,
                       credentials: Credentials | None = None, api_key: str | None = None,
                       stop: asyncio.Event | None = None, resolver=None, on_start=None,
                       metrics_token: str | None = None, remote_workers: bool = False) -> None:
    """Run the router until stop is set (or SIGINT/SIGTERM), then drain. resolver: see
    WorkerPool; on_start(bound_port) runs once serving; metrics_token: /metrics wants it as a
    bearer token; remote_workers: workers at non-loopback addresses may join without mutual TLS
    (--insecure-internal-plane)."""

    credentials = credentials or Credentials()
    keys = api_keys(options.config, api_key)
    raise_fd_limit()   # before any server starts: the HTTP API's connection cap follows it
    check_port_free(host, port)
    tracing.configure("pdserve-router", options.config.otlp_endpoint, credentials=credentials,
                      insecure=options.config.otlp_insecure)
    gen_options = options.generation
    pool = WorkerPool(options.prefill, options.decode, options.colocated, credentials, resolver=resolver,
                      watch_kv=gen_options.routing == "kv-aware", kv_index_max_keys=gen_options.kv_index_max_keys,
                      dynamic=True)
    pool.start()
    membership = MembershipServicer(pool, MembershipSettings(
        options.config.drain_timeout_s, remote_workers=credentials.tls is not None or remote_workers))
    watcher = None
    try:
        await pool.wait_ready(options.config.ready_timeout_s)
        if options.workers_file:
            watcher = WorkersFileWatcher(options.workers_file, membership, options.config.drain_timeout_s)
            await watcher.start()
        metrics = RouterMetrics(model_name=options.model)
        servicer = RouterServicer(options, pool, metrics, keys)
        metrics.attach_routing(servicer.generator.placement)
        log.info("placement: %s", servicer.generator.placement.describe())
        http = None
        if options.config.http_port is not None:   # on this loop, before gRPC says SERVING
            from pdserve.services.api.http_server import start_http   # lazy: fastapi, uvicorn only when this runs
            http = await start_http(RouterServicerFacade(servicer), host, options.config.http_port,
                                    served_model_names(options.config, options.model), keys,
                                    options.limits.max_http_body_bytes, tls=credentials.tls,
                                    model_aliases=(Path(options.model).name, Path(options.model).resolve().name),
                                    allowed_hosts=options.config.allowed_hosts)
        # The public API wants the API key; the membership API, on the same port, the cluster token.
        interceptors = [keys.interceptor(exempt=(MEMBERSHIP_PREFIX,))] if keys.required else []
        interceptors += credentials.server_interceptors(only=(MEMBERSHIP_PREFIX,))
        server = await start_server([service_registration(router_pb2.DESCRIPTOR.services_by_name["Router"], servicer),
                                     service_registration(membership_pb2.DESCRIPTOR.services_by_name["Membership"],
                                                          membership)],
                                    host, port, interceptors=interceptors,
                                    credentials=credentials.server_credentials(require_client_cert=False))
        health = asyncio.create_task(_follow_health(server, pool, servicer))
        note = ""
        if metrics_port is not None:
            note = f", metrics on http://{host}:{start_metrics_server(metrics.registry, host, metrics_port, metrics_token)}/metrics"
        if http is not None:
            note += f", OpenAI-compatible HTTP API on {http.scheme}://{host}:{http.port}/v1"
        print(f"pdserve router listening on {host}:{server.port}{note}", flush=True)
        if on_start is not None:
            on_start(server.port)
        stop = stop or asyncio.Event()
        stop_on_signals(stop)
        try:
            await stop.wait()
            servicer.draining = True
            await server.set_serving(False)
            deadline = time.monotonic() + options.config.drain_timeout_s
            while servicer.generator.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            health.cancel()
            if http is not None:
                await http.stop()
            await server.server.stop(grace=1)
    finally:
        if watcher is not None:
            await watcher.stop()
        await membership.close()
        await pool.close()
        tracing.shutdown()


def api_keys(config: RouterConfig, api_key: str | None) -> ApiKeys:
    """The router's API keys: --api-keys-file's named keys (and the single key beside them, if
    given), else the single key, else none (an open API)."""
    if config.api_keys_file:
        return ApiKeys.load(config.api_keys_file, config.min_client_priority, single_key=api_key)
    return ApiKeys.of(api_key, config.min_client_priority)


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == API_KEY_HEADER:
            return value
    return None


def served_model_names(config: RouterConfig, model: str) -> tuple[str, ...]:
    """The HTTP API's model names, the reported one first: --served-model-name (`pdserve up` and
    `pdserve router` pass the --model argument as given when it is not set, as vLLM does), else the
    checkpoint directory's name. The directory's name is also accepted as an alias."""
    return config.served_model_name or (Path(model).resolve().name,)


async def _follow_health(server, pool: WorkerPool, servicer: RouterServicer) -> None:
    """The router is SERVING only while every role it needs has a healthy worker."""
    serving = None
    while True:
        now = pool.serving and not servicer.draining
        if now != serving:
            await server.set_serving(now)
            if serving is not None:
                log.warning("router is %s", "SERVING again" if now else "NOT_SERVING: a role has no healthy worker")
            serving = now
        await pool.wait_changed(1.0)
