"""Python clients for the router: blocking (Client) and asyncio (AsyncClient).

Every call first waits, up to connect_timeout, for the channel to be connected: a fail-fast gRPC
call on a channel that is still connecting, or in reconnect backoff after one failed attempt,
fails at once with UNAVAILABLE although the router is up. A router that cannot be reached
within connect_timeout fails the call with UNAVAILABLE ("no connection ... within N s")."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.engine.settings import ENV
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.common.proofs import API_KEY_HEADER
from pdserve.services.common.proof_interceptors import metadata_interceptors
from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.common.proto_convert import structured_to_proto

CONNECT_TIMEOUT_S = 5.0


class RouterUnreachable(grpc.RpcError):
    """No connection to the router within the connect timeout (code UNAVAILABLE, like any RpcError)."""

    def __init__(self, address: str, timeout: float) -> None:
        super().__init__(f"no connection to the router at {address} within {timeout:g}s")
        self._details = str(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def _api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Bearer credentials for the router's API key (the argument, else $PDSERVE_API_KEY)."""
    key = api_key if api_key is not None else ENV.API_KEY.get()
    return ((API_KEY_HEADER, f"Bearer {key}"),) if key else ()


@dataclass(slots=True)
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float | str | None] = field(default_factory=dict)   # the router's Timings
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)   # per token, when asked
    # per prompt token after the first, when asked (prompt_logprobs)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)

    def add(self, msg: router_pb2.GenerateResponse) -> None:
        self.request_id = msg.request_id
        self.token_ids.extend(msg.token_ids)
        self.text += msg.text
        self.logprobs.extend(msg.logprobs)
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        if msg.finished:
            self.finish_reason = msg.finish_reason
            self.usage = {"prompt_tokens": msg.usage.prompt_tokens, "completion_tokens": msg.usage.completion_tokens,
                          "cached_tokens": msg.usage.cached_tokens}
            t = msg.timings
            self.timings = {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "kv_transfer_ms": t.kv_transfer_ms,
                            "first_decode_step_ms": t.first_decode_step_ms, "ttft_ms": t.ttft_ms, "e2e_ms": t.e2e_ms,
                            "migrations": t.migrations, "prefill_route": t.prefill_route,
                            "estimated_local_ms": t.estimated_local_ms, "estimated_remote_ms": t.estimated_remote_ms,
                            "local_prefill_threshold_tokens": (t.local_prefill_threshold_tokens
                                                               if t.HasField("local_prefill_threshold_tokens") else None),
                            "decode_cached_tokens": t.decode_cached_tokens, "kv_bytes": t.kv_bytes,
                            "kv_wire_bytes": t.kv_wire_bytes, "kv_streams": t.kv_streams, "kv_codec": t.kv_codec,
                            **spec_decode_timings(t)}


def spec_decode_timings(t: router_pb2.Timings) -> dict[str, int]:
    """The request's speculative decoding counts, with vLLM's names (empty: no speculation)."""
    if not t.HasField("spec_decode"):
        return {}
    s = t.spec_decode
    return {"spec_decode_num_drafts": s.num_drafts, "spec_decode_num_draft_tokens": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_accepted_tokens}


def build_request(prompt: str | Sequence[int], *, request_id: str = "", max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop_token_ids: Sequence[int] = (), ignore_eos: bool | None = None,
                  skip_special_tokens: bool | None = None, priority: int = 0, user: str = "",
                  slo_ttft_ms: float = 0.0, slo_tpot_ms: float = 0.0, session_id: str = "",
                  min_tokens: int | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                  min_p: float | None = None, logit_bias: dict[int, float] | None = None,
                  bad_words: Sequence[str] = (), structured_outputs: StructuredOutputsParams | dict | None = None,
                  logprobs: int | None = None, prompt_logprobs: int | None = None) -> router_pb2.GenerateRequest:
    """Only the parameters given are set; the rest take the server's defaults. priority (lower
    first; within the API key's grant), user (OpenAI's end-user id; the fair-share key is the API
    key's principal) and the latency targets (ms; 0: the deployment's): the request's scheduling
    class (services/router/slo.py); session_id: its multi-turn conversation
    (services/router/routes.py, SessionTable). Penalties, min_p, logit_bias, bad_words (strings,
    tokenized by the router) and structured_outputs (a StructuredOutputsParams, or a dict of its
    fields: {"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}) as vLLM's;
    logprobs and prompt_logprobs: how many top alternatives to report with each generated and
    each prompt token's logprob."""
    params = common_pb2.SamplingParams(stop_token_ids=list(stop_token_ids), bad_words=list(bad_words))
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("seed", seed), ("ignore_eos", ignore_eos), ("skip_special_tokens", skip_special_tokens),
                        ("min_tokens", min_tokens), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("repetition_penalty", repetition_penalty),
                        ("min_p", min_p), ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(params, name, value)
    if logit_bias:
        params.logit_bias.update(logit_bias)
    if structured_outputs is not None:
        spec = structured_outputs if isinstance(structured_outputs, StructuredOutputsParams) \
            else StructuredOutputsParams(**structured_outputs)
        params.structured_outputs.CopyFrom(structured_to_proto(spec))
    req = router_pb2.GenerateRequest(request_id=request_id, params=params, priority=priority, user=user,
                                     slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, session_id=session_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


class Client(contextlib.AbstractContextManager):
    """Blocking client: Client("127.0.0.1:50051").generate("Hello", max_tokens=16).
    api_key: the router's API key (default: $PDSERVE_API_KEY, if set)."""

    def __init__(self, address: str, timeout: float | None = None, api_key: str | None = None,
                 root_certificates: bytes | None = None, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        """root_certificates: the CA (PEM) of a router serving TLS; None: plaintext. timeout: of
        each call; connect_timeout: the longest wait for a connection before a call."""
        self.address, self.connect_timeout = address, connect_timeout
        self.channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates),
                                            options=channel_options())
                        if root_certificates else grpc.insecure_channel(address, options=channel_options()))
        self.metadata = _api_key_metadata(api_key)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout = timeout

    def _connected(self) -> None:
        """A health check that waits for the connection (grpc.channel_ready_future would leave a
        polling thread behind that fails when the channel closes): any answer means connected."""
        try:
            health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                                                           timeout=self.connect_timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RouterUnreachable(self.address, self.connect_timeout) from None

    def generate_stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[router_pb2.GenerateResponse]:
        self._connected()
        yield from self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = Completion(kwargs.get("request_id", ""))
        for msg in self.generate_stream(prompt, **kwargs):
            out.add(msg)
        return out

    def abort(self, request_id: str) -> bool:
        self._connected()
        return self.stub.Abort(common_pb2.AbortRequest(request_id=request_id), metadata=self.metadata).found

    def model_info(self) -> router_pb2.ModelInfo:
        self._connected()
        return self.stub.GetModelInfo(router_pb2.ModelInfoRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __exit__(self, *exc: object) -> None:   # __enter__ (returns the client) from AbstractContextManager
        self.close()


class AsyncClient:
    """asyncio client for load tests: same calls, awaited."""

    def __init__(self, address: str, timeout: float | None = None, api_key: str | None = None,
                 root_certificates: bytes | None = None, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.address, self.connect_timeout = address, connect_timeout
        metadata = _api_key_metadata(api_key)
        interceptors = metadata_interceptors(metadata) if metadata else None
        self.channel = (grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates),
                                                options=channel_options(), interceptors=interceptors)
                        if root_certificates else
                        grpc.aio.insecure_channel(address, options=channel_options(), interceptors=interceptors))
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout = timeout

    async def _connected(self) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), self.connect_timeout)
        except asyncio.TimeoutError:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=str(RouterUnreachable(self.address, self.connect_timeout))) from None

    async def generate_stream(self, prompt: str | Sequence[int], **kwargs) -> AsyncIterator[router_pb2.GenerateResponse]:
        await self._connected()
        async for msg in self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout):
            yield msg

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = Completion(kwargs.get("request_id", ""))
        async for msg in self.generate_stream(prompt, **kwargs):
            out.add(msg)
        return out

    async def abort(self, request_id: str) -> bool:
        await self._connected()
        return (await self.stub.Abort(common_pb2.AbortRequest(request_id=request_id))).found

    async def model_info(self) -> router_pb2.ModelInfo:
        await self._connected()
        return await self.stub.GetModelInfo(router_pb2.ModelInfoRequest())

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
