"""The router's OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``, ``/version``.

It runs in the router's process, on the router's event loop, next to the grpc.aio server, and
sends every request through the same ``Generator`` (admission queue, disaggregated or
colocated placement, migration) as the gRPC API; ``RouterServicer`` supplies the tokenizer,
limits and metrics. Nothing here knows how tokens are produced.

Why FastAPI + uvicorn: uvicorn is an asyncio ASGI server whose ``Server.serve()`` runs as one
more task on the router's loop (its signal handling is turned off: the router owns SIGTERM and
drains), with keep-alive, HTTP/1.1 streaming and back-pressure done right; FastAPI (on
Starlette) gives the routing and request objects; with ``httptools`` installed uvicorn parses
and frames HTTP in C (measured: the router then spends less CPU per streamed token on HTTP than
on gRPC). They are what vLLM's OpenAI server runs on,
so clients and load generators (``openai``, ``vllm bench serve``) see the behaviour they were
written against. Request bodies are parsed here, not by pydantic models, so that a body is
capped before it is parsed, unknown fields are ignored as OpenAI does, and every error names
its field in OpenAI's error shape.

Behaviour:

* API key (when one is set): ``Authorization: Bearer KEY``, compared in constant time before
  anything else is done (``/health`` stays open, as gRPC health does); 401 otherwise.
* Errors: ``{"error": {"message", "type", "param", "code"}}``; 400 bad input (naming the
  field), 401 API key, 404 unknown model or path, 413 body over ``max_http_body_bytes`` (read
  with a byte cap before parsing) or prompt over ``max_prompt_bytes``, 429 admission queue full
  (with ``Retry-After``), 503 no healthy worker or draining.
* ``stop`` strings are matched in the detokenized text across token boundaries; the text from
  the stop string on is never sent, the request is aborted on its workers at once and finishes
  with ``"stop"``. ``n`` choices are independent requests (with a seed: seed + i).
* ``logprobs`` (completions: an int; chat: ``logprobs`` + ``top_logprobs``): the workers
  report each sampled token's logprob in the raw model distribution and the top alternatives
  (engine/logprobs.py); they are formatted here as OpenAI does.
* A client that disconnects (streaming or not) cancels its request: the Generator's
  cancellation path aborts it on every worker and frees its blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine import SamplingParams
from engine.sampling_params import MAX_LOGPROBS
from engine.validation import validate_request
from services.detokenizer import IncrementalDetokenizer
from services.errors import RouterError
from services.ports import reuse_port

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4                   # OpenAI's limit
OPEN_PATHS = ("/health",)              # no API key needed (orchestrators probe it)
STATUS_OF_CODE = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400,
                  "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                  "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
                  "ABORTED": 500, "DATA_LOSS": 500, "INTERNAL": 500, "UNIMPLEMENTED": 501}
TYPE_OF_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                  404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                  503: "service_unavailable_error"}
# Sampling fields pdserve does not implement: accepted only at their neutral value.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "best_of": None,
           "echo": False, "suffix": None, "logit_bias": None, "tools": None, "functions": None,
           "response_format": None}
NEUTRAL_OK = {"best_of": (1,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
              "response_format": ({"type": "text"},), "suffix": ("",)}


# ---- errors -----------------------------------------------------------------------------------

class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPE_OF_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_router(cls, exc: RouterError) -> "HTTPError":
        status = STATUS_OF_CODE.get(exc.code, 500)
        headers = {}
        if exc.retry_after_s:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        param = _param_of(exc.message) if status == 400 else None
        return cls(status, exc.message, param, exc.code.lower(), headers)


def _param_of(message: str) -> str | None:
    """The field a validation message is about (the engine's messages start with it)."""
    word = message.split(" ", 1)[0].strip(":(")
    known = {"temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "min_tokens", "prompt",
             "output", "request_id", "ignore_eos"}
    if word in known:
        return word
    if message.startswith("prompt tokens") or message.startswith("prompt has"):
        return "prompt"
    return None


# ---- request parsing --------------------------------------------------------------------------

def _field(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """body[name] if present and not null, checked against types (bool is not an int here)."""
    value = body.get(name)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        raise HTTPError(400, f"{name} must be of type {'/'.join(t.__name__ for t in types)}, got a boolean", name)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, types):
        raise HTTPError(400, f"{name} must be of type {'/'.join(t.__name__ for t in types)}, "
                             f"got {type(value).__name__}", name)
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise HTTPError(400, f"{name} must be a list of integers", name)
    return value


@dataclass(slots=True)
class Prompt:
    """One prompt: token ids, or text still to tokenize."""

    text: str | None = None
    token_ids: list[int] | None = None


@dataclass(slots=True)
class ParsedBody:
    prompts: list[Prompt]
    params: SamplingParams
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    skip_special_tokens: bool
    model: str
    max_tokens_given: bool
    chat: bool = False
    messages: list[dict] = field(default_factory=list)
    add_generation_prompt: bool = True


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise HTTPError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if any(not s for s in stop):
        raise HTTPError(400, "stop strings must not be empty", "stop")
    return stop


def _completion_prompts(body: dict) -> list[Prompt]:
    prompt = body.get("prompt")
    if prompt is None:
        raise HTTPError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise HTTPError(400, "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [Prompt(token_ids=prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [Prompt(text=p) for p in prompt]
    if all(isinstance(p, list) and p for p in prompt):
        return [Prompt(token_ids=_int_list(p, "prompt")) for p in prompt]
    raise HTTPError(400, "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                    "prompt")


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):   # content parts: only text is understood
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise HTTPError(400, f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**m, "content": content})
    return out


def parse_body(body: dict, chat: bool, default_model: str) -> ParsedBody:
    """Every field, checked for type and OpenAI's limits; the engine's own rules come after
    tokenizing (validate_request). Raises HTTPError 400 naming the field."""
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in NEUTRAL_OK.get(name, ()):
            raise HTTPError(400, f"{name}={value!r} is not supported by pdserve", name)
    model = _field(body, "model", str, default_model)
    max_tokens = _field(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int)
    params = SamplingParams(temperature=_field(body, "temperature", float, 1.0),
                            top_p=_field(body, "top_p", float, 1.0),
                            top_k=_field(body, "top_k", int, 0),
                            max_tokens=16 if max_tokens is None else max_tokens,
                            seed=_field(body, "seed", int),
                            stop_token_ids=_int_list(body.get("stop_token_ids") or [], "stop_token_ids"),
                            ignore_eos=_field(body, "ignore_eos", bool, False),
                            min_tokens=_field(body, "min_tokens", int, 0))
    if chat:   # logprobs: bool, top_logprobs: how many alternatives
        top = _field(body, "top_logprobs", int)
        if _field(body, "logprobs", bool, False):
            params.logprobs = top or 0
        elif top is not None:
            raise HTTPError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    else:      # logprobs: how many alternatives (0: only the sampled token's)
        params.logprobs = _field(body, "logprobs", int)
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise HTTPError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {params.logprobs}", name)
    if params.top_k < 0:   # vLLM's -1: disabled
        params.top_k = 0 if params.top_k == -1 else params.top_k
    n = _field(body, "n", int, 1)
    if n < 1:
        raise HTTPError(400, f"n must be >= 1, got {n}", "n")
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict)
    if options is not None and not stream:
        raise HTTPError(400, "stream_options is only allowed with stream=true", "stream_options")
    _field(body, "user", str)
    parsed = ParsedBody(prompts=[], params=params, n=n, stop=_stop_strings(body), stream=stream,
                        include_usage=bool(options and options.get("include_usage")),
                        skip_special_tokens=_field(body, "skip_special_tokens", bool, True), model=model,
                        max_tokens_given=max_tokens is not None, chat=chat)
    if chat:
        parsed.messages = _chat_messages(body)
        parsed.add_generation_prompt = _field(body, "add_generation_prompt", bool, True)
    else:
        parsed.prompts = _completion_prompts(body)
    return parsed


# ---- stop strings ------------------------------------------------------------------------------

class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries. Text that could be the
    start of a stop string is held back until it is known not to be one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""

    def _held(self, buf: str) -> int:
        """Length of the longest end of buf that begins a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), held, -1):
                if buf.endswith(s[:k]):
                    held = k
                    break
        return held

    def add(self, text: str, final: bool, check: bool = True) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended it). check=False: no stop yet (min_tokens)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        if check:
            hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.pending = ""
                return buf[:min(hits)], True
        if final:
            self.pending = ""
            return buf, False
        cut = len(buf) - self._held(buf)
        self.pending = buf[cut:]
        return buf[:cut], False


# ---- one choice ------------------------------------------------------------------------------

@dataclass(slots=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list | None = None      # common_pb2.TokenLogprob per token, when asked


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    first_of_prompt: bool      # counts the prompt's tokens in usage (once per prompt, not per n)


# ---- the app -------------------------------------------------------------------------------

class OpenAIServer:
    def __init__(self, servicer, served_model_name: str | Sequence[str], api_key: str | None = None,
                 max_body_bytes: int = 8 << 20, model_aliases: Sequence[str] = ()) -> None:
        """served_model_name: one name or several, as vLLM's --served-model-name: the first is the
        one reported, /v1/models lists them all, every one is accepted; model_aliases: accepted
        too, not listed (the checkpoint directory's name)."""
        self.servicer = servicer
        names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
        self.served_model_names = names
        self.served_model_name = names[0]
        self.accepted_model_names = frozenset((*names, *model_aliases))
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.app = self._build_app()

    # ---- plumbing --------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HTTPError)
        async def _http_error(request: Request, exc: HTTPError):
            return exc.response()

        @app.exception_handler(404)
        async def _not_found(request: Request, exc):
            return HTTPError(404, f"no route {request.url.path}", code="not_found").response()

        @app.exception_handler(405)
        async def _not_allowed(request: Request, exc):
            return HTTPError(405, f"method {request.method} not allowed on {request.url.path}").response()

        @app.get("/health")
        async def health():
            serving = self.servicer.pool.serving and not self.servicer.draining
            return Response(status_code=200 if serving else 503)

        @app.get("/version")
        async def version():
            from importlib.metadata import PackageNotFoundError, version as pkg_version
            try:
                return {"version": pkg_version("pdserve")}
            except PackageNotFoundError:
                return {"version": "unknown"}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.servicer.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card(name) for name in self.served_model_names]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            self._check_model(name)
            return self._model_card(name if name in self.served_model_names else self.served_model_name)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, chat=True)

        return app

    def asgi(self) -> Callable:
        """The app behind the API-key check (before routing or reading the body)."""
        app = self.app
        if not self.api_key:
            return app
        expected = f"Bearer {self.api_key}".encode()

        async def guarded(scope, receive, send):
            if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
                given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
                if not hmac.compare_digest(given, expected):
                    err = HTTPError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    await err.response()(scope, receive, send)
                    return
            await app(scope, receive, send)
        return guarded

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": self.servicer.options.model, "parent": None, "max_model_len": self.servicer.max_model_len}

    def _check_model(self, name: str) -> None:
        if name not in self.accepted_model_names:
            raise HTTPError(404, f"The model `{name}` does not exist (this server serves "
                                 f"`{self.served_model_name}`)", "model", "model_not_found")

    async def _read_json(self, request: Request) -> dict:
        """The body, refused (413) as soon as it passes the cap, before any parsing."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise HTTPError(413, f"request body has {length} bytes; the limit is {limit} (max_http_body_bytes)",
                            code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body is over {limit} bytes (max_http_body_bytes)",
                                code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    # ---- handlers ----------------------------------------------------------------------
    async def _handle(self, request: Request, chat: bool) -> Response:
        started = False   # once generating, each choice counts its own failure (_run_choice)
        try:
            if self.servicer.draining:
                raise RouterError("UNAVAILABLE", "the router is draining (shutting down)")
            parsed = parse_body(await self._read_json(request), chat, self.served_model_name)
            self._check_model(parsed.model)
            choices = await _until_disconnect(request, self._prepare(parsed))
            started = True
            if parsed.stream:
                return await self._stream(request, parsed, choices)
            return await _until_disconnect(request, self._complete(parsed, choices))
        except (RouterError, HTTPError) as exc:
            if not started:
                self.servicer.metrics.request_failure.inc()
            return (HTTPError.from_router(exc) if isinstance(exc, RouterError) else exc).response()
        except ClientGone:   # nobody to answer; the request was cancelled on its workers
            return Response(status_code=499)

    async def _prepare(self, parsed: ParsedBody) -> list[Choice]:
        """Tokenize and validate every prompt; one Choice per (prompt, i < n)."""
        limits = self.servicer.options.limits
        if parsed.chat:
            prompts = [await self._render_chat(parsed.messages, parsed.add_generation_prompt)]
        else:
            prompts = [await self._tokens(p) for p in parsed.prompts]
        n_choices = len(prompts) * parsed.n
        if n_choices > limits.max_choices:
            raise HTTPError(400, f"{len(prompts)} prompt(s) x n={parsed.n} = {n_choices} choices; the limit is "
                                 f"{limits.max_choices} (max_choices)", "n")
        max_len = self.servicer.max_model_len
        base = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        choices = []
        for p_index, ids in enumerate(prompts):
            params = dataclasses.replace(parsed.params, stop_token_ids=list(parsed.params.stop_token_ids))
            if parsed.chat and not parsed.max_tokens_given:   # chat default: the rest of the context
                params.max_tokens = max(1, max_len - len(ids))
            if len(params.stop_token_ids) > limits.max_stop_token_ids:
                raise HTTPError(400, f"stop_token_ids has {len(params.stop_token_ids)} entries; the limit is "
                                     f"{limits.max_stop_token_ids} (max_stop_token_ids)", "stop_token_ids")
            try:
                validate_request(ids, params, self.servicer.model_config.vocab_size, max_len)
            except ValueError as exc:
                msg = str(exc)
                raise HTTPError(400, msg, _param_of(msg) or ("messages" if parsed.chat else None)) from None
            for i in range(parsed.n):
                p = dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids))
                if p.seed is not None:
                    p.seed = (p.seed + i) % 2**63
                k = p_index * parsed.n + i
                choices.append(Choice(k, f"{base}-{k}", ids, p, i == 0))
        return choices

    async def _tokens(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            if len(prompt.token_ids) > self.servicer.max_model_len:
                raise HTTPError(400, f"prompt has {len(prompt.token_ids)} tokens; max_model_len is "
                                     f"{self.servicer.max_model_len}", "prompt")
            return prompt.token_ids
        return await self._encode(prompt.text, "prompt", add_special_tokens=True)

    async def _encode(self, text: str, what: str, add_special_tokens: bool) -> list[int]:
        limit = self.servicer.options.limits.max_prompt_bytes
        if len(text) > limit or len(text.encode()) > limit:
            raise HTTPError(413, f"{what} has more than {limit} bytes (max_prompt_bytes)", what, "request_too_large")
        tok = self.servicer.tokenizer
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self.servicer._tokenize, functools.partial(
            tok.encode, text, add_special_tokens=add_special_tokens))
        if len(ids) > self.servicer.max_model_len:
            raise HTTPError(400, f"{what} has {len(ids)} tokens; max_model_len is {self.servicer.max_model_len}",
                            what)
        return ids

    async def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        tok = self.servicer.tokenizer
        if not getattr(tok, "chat_template", None):
            raise HTTPError(400, f"model {self.served_model_name} has no chat template (tokenizer_config.json "
                                 f"chat_template or chat_template.jinja); use /v1/completions", "messages",
                            "no_chat_template")
        limit = self.servicer.options.limits.max_prompt_bytes
        size = sum(len(m["content"].encode()) for m in messages)
        if size > limit:
            raise HTTPError(413, f"messages have more than {limit} bytes (max_prompt_bytes)", "messages",
                            "request_too_large")
        loop = asyncio.get_running_loop()
        try:
            text = await loop.run_in_executor(self.servicer._tokenize, functools.partial(
                tok.apply_chat_template, messages, tokenize=False, add_generation_prompt=add_generation_prompt))
        except Exception as exc:  # noqa: BLE001 - a template error is the request's (jinja raises anything)
            raise HTTPError(400, f"chat template failed: {type(exc).__name__}: {exc}", "messages") from None
        return await self._encode(text, "messages", add_special_tokens=False)

    def _logprobs(self, parsed: ParsedBody, d: Delta, text_offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for a Delta's tokens: completions' {tokens, token_logprobs,
        top_logprobs, text_offset} or chat's {content: [{token, logprob, bytes, top_logprobs}]}.
        As vLLM: the sampled token's logprob is always there, besides the top alternatives."""
        if parsed.params.logprobs is None:
            return None
        tok = self.servicer.tokenizer
        pairs = list(zip(d.token_ids, d.logprobs or ()))
        if parsed.chat:
            def entry(token_id: int, logprob: float) -> dict:
                text = _token_text(tok, token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**entry(t, lp.logprob), "top_logprobs": [
                entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]} for t, lp in pairs]}
        tokens = [_token_text(tok, t) for t, _ in pairs]
        offsets, top = [], []
        for (t, lp), text in zip(pairs, tokens):
            offsets.append(text_offset)
            text_offset += len(text)
            alternatives = {_token_text(tok, i): v for i, v in zip(lp.top_token_ids, lp.top_logprobs)}
            alternatives.setdefault(text, lp.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in pairs], "top_logprobs": top,
                "text_offset": offsets}

    # ---- generation ----------------------------------------------------------------------
    async def _run_choice(self, choice: Choice, stop: list[str], skip_special: bool) -> AsyncIterator[Delta]:
        """One choice through the Generator: text deltas, stop strings applied; the last Delta
        has finish_reason and usage. Leaving early (stop string, cancel) aborts it on the workers."""
        servicer = self.servicer
        detok = IncrementalDetokenizer(servicer.tokenizer, skip_special)
        matcher = StopMatcher(stop)
        completion = 0
        servicer.metrics.num_requests_running.inc()
        finished = False
        gen_iter = servicer.generator.generate(choice.request_id, choice.prompt, choice.params)
        try:
            async with contextlib.aclosing(gen_iter):
                async for chunk, gen in gen_iter:
                    now = time.perf_counter()
                    if chunk.token_ids:
                        servicer._observe_tokens(gen, len(chunk.token_ids), now)
                        completion += len(chunk.token_ids)
                    if chunk.finish_reason == "abort":
                        raise RouterError("ABORTED", f"request {choice.request_id} was aborted")
                    final = chunk.finish_reason is not None
                    text = detok.add(chunk.token_ids, final=final)
                    text, hit = matcher.add(text, final, check=completion >= choice.params.min_tokens)
                    if hit or final:
                        finished = True
                        usage = _usage_proto(len(choice.prompt), completion, gen.timing.cached_tokens)
                        servicer._observe_finish(gen, usage, now)
                        yield Delta(choice.index, text, list(chunk.token_ids), "stop" if hit else chunk.finish_reason,
                                    len(choice.prompt) if choice.first_of_prompt else 0, completion,
                                    gen.timing.cached_tokens if choice.first_of_prompt else 0, chunk.logprobs)
                        return   # a stop string: aclosing ends the generation, which aborts it on its workers
                    yield Delta(choice.index, text, list(chunk.token_ids), logprobs=chunk.logprobs)
        finally:
            servicer.metrics.num_requests_running.dec()
            if not finished:
                servicer.metrics.request_failure.inc()

    async def _complete(self, parsed: ParsedBody, choices: list[Choice]) -> JSONResponse:
        async def collect(choice: Choice) -> tuple[str, Delta]:
            texts, last, token_ids, logprobs = [], None, [], []
            async for delta in self._run_choice(choice, parsed.stop, parsed.skip_special_tokens):
                texts.append(delta.text)
                token_ids += delta.token_ids
                logprobs += delta.logprobs or ()
                last = delta
            last.token_ids, last.logprobs = token_ids, logprobs
            return "".join(texts), last

        results = await _gather_or_cancel([collect(c) for c in choices])
        created = int(time.time())
        rid = choices[0].request_id.rsplit("-", 1)[0]
        usage = _usage(sum(d.prompt_tokens for _, d in results), sum(d.completion_tokens for _, d in results),
                       sum(d.cached_tokens for _, d in results))
        if parsed.chat:
            body = {"id": rid, "object": "chat.completion", "created": created, "model": self.served_model_name,
                    "choices": [{"index": d.index, "message": {"role": "assistant", "content": text},
                                 "logprobs": self._logprobs(parsed, d), "finish_reason": d.finish_reason}
                                for text, d in results],
                    "usage": usage}
        else:
            body = {"id": rid, "object": "text_completion", "created": created, "model": self.served_model_name,
                    "choices": [{"index": d.index, "text": text, "logprobs": self._logprobs(parsed, d),
                                 "finish_reason": d.finish_reason} for text, d in results],
                    "usage": usage}
        return JSONResponse(body)

    async def _stream(self, request: Request, parsed: ParsedBody, choices: list[Choice]) -> Response:
        """Server-sent events. The status is decided by the first event: an error before any
        token (queue full, no worker, a worker refusing the request) is an HTTP error."""
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in self._run_choice(choice, parsed.stop, parsed.skip_special_tokens):
                    queue.put_nowait(delta)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            first = await _until_disconnect(request, queue.get())
        except BaseException:
            await _cancel(tasks)
            raise
        if isinstance(first, BaseException):
            await _cancel(tasks)
            raise first
        rid = choices[0].request_id.rsplit("-", 1)[0]
        created = int(time.time())
        obj = "chat.completion.chunk" if parsed.chat else "text_completion"

        def event(payload_choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> bytes:
            payload = {"id": rid, "object": obj, "created": created, "model": self.served_model_name,
                       "choices": payload_choices}
            if parsed.include_usage:
                payload["usage"] = usage if with_usage else None
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        offsets = [0] * len(choices)   # text_offset of the next token, per choice

        def choice_event(d: Delta) -> dict:
            logprobs = self._logprobs(parsed, d, offsets[d.index])
            if logprobs is not None and not parsed.chat:
                offsets[d.index] += sum(len(t) for t in logprobs["tokens"])
            if parsed.chat:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                return {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish_reason}
            return {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}

        async def events() -> AsyncIterator[bytes]:
            totals = [0, 0, 0]
            try:
                if parsed.chat:   # the role comes first, once per choice, as OpenAI sends it
                    for c in choices:
                        yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                item, open_choices = first, len(tasks)
                while True:
                    if item is None:
                        open_choices -= 1
                        if open_choices == 0:
                            break
                    elif isinstance(item, RouterError) or isinstance(item, HTTPError):
                        err = item if isinstance(item, HTTPError) else HTTPError.from_router(item)
                        yield b"data: " + json.dumps(err.body(), separators=(",", ":")).encode() + b"\n\n"
                        break
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        if item.finish_reason is not None:
                            totals[0] += item.prompt_tokens
                            totals[1] += item.completion_tokens
                            totals[2] += item.cached_tokens
                        yield event([choice_event(item)])
                    item = await queue.get()
                if parsed.include_usage:
                    yield event([], _usage(*totals), with_usage=True)
                yield b"data: [DONE]\n\n"
            finally:
                await _cancel(tasks)

        return SSEResponse(events())


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage_proto(prompt: int, completion: int, cached: int):
    from pdserve.v1 import router_pb2
    return router_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


# ---- cancellation ----------------------------------------------------------------------------

class ClientGone(Exception):
    """The client disconnected; its work was cancelled."""


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await awaitable, cancelling it if the client disconnects meanwhile (then ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel([task, watcher])
        raise
    if task.done():
        await _cancel([watcher])
        return task.result()
    await _cancel([task])
    raise ClientGone()


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _gather_or_cancel(coros: list[Awaitable]) -> list[Any]:
    """All results; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _cancel([t for t in tasks if not t.done()])


class SSEResponse(Response):
    """text/event-stream from an async iterator of bytes. The iterator runs as a task next to a
    watch on the connection: when the client disconnects, the task is cancelled at once (its
    cleanup aborts the requests), even while no event is due."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:   # no body, so no Content-Length
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            async with contextlib.aclosing(self.events) as events:
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        body = asyncio.create_task(pump())
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel([body, watcher])   # a finished task stays as it is
        if not body.cancelled() and body.exception() is not None:
            if not isinstance(body.exception(), OSError):   # a write to a closed connection is a disconnect
                raise body.exception()


# ---- the server ------------------------------------------------------------------------------

# How long an idle keep-alive connection stays open. Longer than the idle timeout of client pools
# (aiohttp 15-60 s, httpx 5 s): a client that reuses a connection the server is closing at that
# moment gets "Server disconnected" for a request the server never saw, so the client must be the
# side that gives up first. uvicorn's default is 5 s. Bounded, so idle sockets cannot pile up.
HTTP_KEEP_ALIVE_S = 75


class _EmbeddedServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the router handles signals (and drains)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:   # uvicorn < 0.29
        pass


@dataclass(eq=False)
class HTTPServer:
    server: uvicorn.Server
    task: asyncio.Task
    port: int
    scheme: str = "http"

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 5.0)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down regardless
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def start_http(servicer, host: str, port: int, served_model_name: str | Sequence[str],
                     api_key: str | None = None, max_body_bytes: int = 8 << 20, tls=None,
                     model_aliases: Sequence[str] = ()) -> HTTPServer:
    """Serve the OpenAI-compatible API on host:port (0: any free port) on the running loop;
    returns once it accepts connections. Raises OSError if the port is taken. tls (a
    services.security.TLSFiles): HTTPS with the router's certificate, as its gRPC API has
    (clients are not asked for a certificate; the API key is what authenticates them)."""
    api = OpenAIServer(servicer, served_model_name, api_key, max_body_bytes, model_aliases=model_aliases)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port(port):   # reserved for us by `pdserve up` (services/ports.py)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"HTTP port {host}:{port} is not available ({exc.strerror})") from None
    sock.listen(2048)
    sock.setblocking(False)
    ssl_files = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)} if tls is not None else {}
    config = uvicorn.Config(api.asgi(), log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, server_header=False,
                            timeout_keep_alive=HTTP_KEEP_ALIVE_S, **ssl_files)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()   # raises the start-up error
            raise OSError(f"HTTP server on {host}:{port} stopped during start-up")
        await asyncio.sleep(0.01)
    return HTTPServer(server, task, sock.getsockname()[1], "https" if tls is not None else "http")
