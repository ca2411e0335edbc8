"""OpenAI's HTTP protocol at the router: request bodies in, responses and server-sent events out.

Request bodies are read with a byte cap and a deadline, parsed, every field checked for
type and limit, in OpenAI's error shape (HTTPError), before anything is tokenized.

Counts come first (prompts x n, messages, stop strings, token ids), then the bytes of every
string the request hands on (each prompt, every string of every message: role and name
included, each stop string), so that a body's cost to the router is bounded by its size and
the limits, whatever its shape. front_requests hands the parsed body to the request front
(services/api/request_front.py), which tokenizes and applies the engine's own rules.

Streaming and cancellation: a request whose client disconnects is
cancelled at once (its cleanup aborts the generation on every worker), and server-sent events
(framed by sse_event) from an async iterator that is cancelled the moment the connection goes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from pdserve.engine import SamplingParams
from pdserve.engine.quoting import capped, quoted
from pdserve.engine.sampling_params import MAX_LOGPROBS, StructuredOutputsParams
from pdserve.services.api.request_front import FrontRequest, Prompt, field_of_message
from pdserve.services.api.openai_sampling import apply_sampling_fields
from pdserve.services.api.request_limits import InvalidRequest, RequestLimits, check_count, utf8_size
from pdserve.services.api.tool_calls import (Tool, ToolChoice, guided_schema, parse_parallel_tool_calls,
                                             parse_tool_choice, parse_tools)
from pdserve.services.api.tool_messages import validate_tool_messages
from pdserve.services.router.errors import RouterError
from pdserve.services.router.slo import ServiceClass


log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4                   # OpenAI's limit
STATUS_OF_CODE = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400,
                  "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                  "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
                  "ABORTED": 500, "DATA_LOSS": 500, "INTERNAL": 500, "UNIMPLEMENTED": 501}
TYPE_OF_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                  404: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                  415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error",
                  503: "service_unavailable_error"}
# Fields pdserve does not implement: accepted only at their neutral value.
NEUTRAL = {"best_of": None, "suffix": None, "functions": None, "function_call": None}
NEUTRAL_OK = {"best_of": (1,), "functions": ([],), "suffix": ("",)}
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
MAX_TEMPLATE_KWARGS = 16
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                                      "continue_final_message", "return_dict", "chat_template", "tools_in_user_message"})


# ---- errors -----------------------------------------------------------------------------------

class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = capped(message)   # whatever a check quoted, the client reads a bounded message
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPE_OF_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII JSON: a message that quotes the client (a model name with a lone surrogate) still encodes
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")

    @classmethod
    def from_router(cls, exc: RouterError, request_id: str | None = None) -> "HTTPError":
        """exc in OpenAI's shape; its internal detail goes to the log, under the request id."""
        if exc.detail is not None:
            log.warning("request %s: %s: %s", request_id, exc.message, exc.detail)
        status = 413 if exc.too_large else STATUS_OF_CODE.get(exc.code, 500)
        headers = {}
        if exc.retry_after_s:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        param = (exc.field or field_of_message(exc.message)) if status in (400, 413) else None
        code = "request_too_large" if exc.too_large else exc.code.lower()
        return cls(status, exc.public_message(request_id), param, code, headers)

    @classmethod
    def from_invalid(cls, exc: InvalidRequest) -> "HTTPError":
        """A request front's refusal: 413 for a size limit, else 400, naming the field."""
        return cls(413 if exc.too_large else 400, exc.message, exc.field, exc.code)


def http_error(exc: RouterError | HTTPError | InvalidRequest, request_id: str) -> HTTPError:
    """Any refusal in OpenAI's error shape."""
    if isinstance(exc, RouterError):
        return HTTPError.from_router(exc, request_id)
    return HTTPError.from_invalid(exc) if isinstance(exc, InvalidRequest) else exc


# ---- reading the body ----------------------------------------------------------------------------

async def read_json(request: Request, limit: int, timeout_s: float) -> dict:
    """The body as a JSON object: refused (413) as soon as it passes limit bytes, before any
    parsing; (408) if it has not all arrived within timeout_s; (400) if it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"request body has {length} bytes; the limit is {limit} (max_http_body_bytes)",
                        code="request_too_large")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body is over {limit} bytes (max_http_body_bytes)",
                                code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"request body did not arrive within {timeout_s:g}s (http_body_timeout_s)",
                        code="request_timeout") from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise HTTPError(400, "request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return body


# ---- request parsing --------------------------------------------------------------------------

def typed_field(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """body[name] if present and not null, checked against types (bool is not an int here)."""
    value = body.get(name)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        raise HTTPError(400, f"{name} must be of type {'/'.join(t.__name__ for t in types)}, got a boolean", name)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise HTTPError(400, f"{name} is out of range, got {quoted(value)}", name) from None
    if not isinstance(value, types):
        raise HTTPError(400, f"{name} must be of type {'/'.join(t.__name__ for t in types)}, "
                             f"got {type(value).__name__}", name)
    return value


def int_list(value: Any, name: str, max_len: int | None = None, setting: str = "max_model_len") -> list[int]:
    if not isinstance(value, list):
        raise HTTPError(400, f"{name} must be a list of integers", name)
    if max_len is not None and len(value) > max_len:   # the length before the scan
        raise HTTPError(400, f"{name} has {len(value)} token ids; the limit is {max_len} ({setting})", name)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise HTTPError(400, f"{name} must be a list of integers", name)
    return value


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
    service: ServiceClass = field(default_factory=ServiceClass)
    bad_words: list[str] = field(default_factory=list)
    structured_field: str | None = None   # the body's field the output constraint came from
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    template_kwargs: dict = field(default_factory=dict)
    echo: bool = False                    # completions: the prompt leads the text (and logprobs)
    echo_only: bool = False               # echo with max_tokens=0: the prompt alone, nothing generated
    prompt_logprobs: int | None = None    # vLLM's prompt_logprobs field: reported in its shape


def _stop_strings(body: dict, limits: RequestLimits) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise HTTPError(400, "stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise HTTPError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "stop must be a string or a list of strings", "stop")
    if any(not s for s in stop):
        raise HTTPError(400, "stop strings must not be empty", "stop")
    for s in stop:
        try:
            size = len(s.encode())   # the body's cap bounds this
        except UnicodeEncodeError:
            raise HTTPError(400, "stop is not valid Unicode: a lone surrogate", "stop") from None
        if size > limits.max_stop_bytes:
            raise HTTPError(400, f"stop has a string of {size} bytes; the limit is {limits.max_stop_bytes} "
                                 f"(max_stop_bytes)", "stop")
    return stop


def _choices_limit(n_prompts: int, n: int, limits: RequestLimits) -> None:
    """Before any prompt is looked at further: prompts x n within max_choices."""
    if n_prompts > limits.max_choices:
        raise HTTPError(400, f"prompt has {n_prompts} prompts; the limit is {limits.max_choices} (max_choices)",
                        "prompt")
    if n_prompts * n > limits.max_choices:
        raise HTTPError(400, f"{n_prompts} prompt(s) x n={n} = {n_prompts * n} choices; the limit is "
                             f"{limits.max_choices} (max_choices)", "n")


def _completion_prompts(body: dict, n: int, limits: RequestLimits, max_prompt_tokens: int | None) -> list[Prompt]:
    prompt = body.get("prompt")
    if prompt is None:
        raise HTTPError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        _choices_limit(1, n, limits)
        utf8_size(prompt, "prompt", limits.max_prompt_bytes)
        return [Prompt(text=prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise HTTPError(400, "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        _choices_limit(1, n, limits)
        return [Prompt(token_ids=int_list(prompt, "prompt", max_prompt_tokens))]
    _choices_limit(len(prompt), n, limits)
    if all(isinstance(p, str) for p in prompt):
        for p in prompt:
            utf8_size(p, "prompt", limits.max_prompt_bytes)
        return [Prompt(text=p) for p in prompt]
    if all(isinstance(p, list) and p for p in prompt):
        return [Prompt(token_ids=int_list(p, "prompt", max_prompt_tokens)) for p in prompt]
    raise HTTPError(400, "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                    "prompt")


def _chat_messages(body: dict, limits: RequestLimits) -> list[dict]:
    """The messages with their text content; every string a template may print is counted
    against max_prompt_bytes, and values of other types (which no text template needs) are
    dropped, so that rendering costs what the body's size allows."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", "messages")
    if len(messages) > limits.max_chat_messages:
        raise HTTPError(400, f"messages has {len(messages)} messages; the limit is {limits.max_chat_messages} "
                             f"(max_chat_messages)", "messages")
    budget = limits.max_prompt_bytes - validate_tool_messages(messages, limits.max_prompt_bytes)
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
        kept = {k: v for k, v in m.items() if isinstance(k, str) and isinstance(v, str)}
        kept["content"] = content
        for key, value in kept.items():
            budget -= len(key) + utf8_size(value, "messages", limits.max_prompt_bytes)
            if budget < 0:
                raise HTTPError(413, f"messages have more than {limits.max_prompt_bytes} bytes (max_prompt_bytes)",
                                "messages", "request_too_large")
        if m.get("tool_calls"):   # checked and counted by validate_tool_messages
            kept["tool_calls"] = m["tool_calls"]
        out.append(kept)
    return out


def parse_body(body: dict, chat: bool, default_model: str, limits: RequestLimits | None = None,
               max_prompt_tokens: int | None = None) -> ParsedBody:
    """Every field, checked for type and limits (counts before sizes, sizes before any work);
    the engine's own rules come after tokenizing (validate_request). Raises HTTPError naming the
    field. max_prompt_tokens: the longest token-id prompt (max_model_len)."""
    try:
        return _parse_body(body, chat, default_model, limits or RequestLimits(), max_prompt_tokens)
    except InvalidRequest as exc:   # a shared check (services/api/request_limits.py)
        raise HTTPError.from_invalid(exc) from None


def _parse_body(body: dict, chat: bool, default_model: str, limits: RequestLimits,
                max_prompt_tokens: int | None) -> ParsedBody:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in NEUTRAL_OK.get(name, ()):
            raise HTTPError(400, f"{name}={quoted(value)} is not supported by pdserve", name)
    model = typed_field(body, "model", str, default_model)
    max_tokens = typed_field(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = typed_field(body, "max_tokens", int)
    stop_ids = body.get("stop_token_ids") or []
    if isinstance(stop_ids, list):
        check_count(len(stop_ids), "stop_token_ids", limits.max_stop_token_ids, "max_stop_token_ids")
    params = SamplingParams(temperature=typed_field(body, "temperature", float, 1.0),
                            top_p=typed_field(body, "top_p", float, 1.0),
                            top_k=typed_field(body, "top_k", int, 0),
                            seed=typed_field(body, "seed", int),
                            stop_token_ids=int_list(stop_ids, "stop_token_ids"),
                            ignore_eos=typed_field(body, "ignore_eos", bool, False),
                            min_tokens=typed_field(body, "min_tokens", int, 0),
                            cache_salt=typed_field(body, "cache_salt", str))
    if max_tokens is not None:   # else SamplingParams' default (a chat request: the rest of the context)
        params.max_tokens = max_tokens
    bad_words, structured_field = apply_sampling_fields(body, params)
    if chat:   # logprobs: bool, top_logprobs: how many alternatives
        top = typed_field(body, "top_logprobs", int)
        if typed_field(body, "logprobs", bool, False):
            params.logprobs = top or 0
        elif top is not None:
            raise HTTPError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    else:      # logprobs: how many alternatives (0: only the sampled token's)
        params.logprobs = typed_field(body, "logprobs", int)
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise HTTPError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {params.logprobs}", name)
    echo, echo_only, prompt_logprobs = _prompt_scoring(body, chat, params, max_tokens)
    if params.top_k < 0:   # vLLM's -1: disabled
        params.top_k = 0 if params.top_k == -1 else params.top_k
    n = typed_field(body, "n", int, 1)
    if n < 1:
        raise HTTPError(400, f"n must be >= 1, got {n}", "n")
    stream = typed_field(body, "stream", bool, False)
    options = typed_field(body, "stream_options", dict)
    if options is not None and not stream:
        raise HTTPError(400, "stream_options is only allowed with stream=true", "stream_options")
    parsed = ParsedBody(prompts=[], params=params, n=n, stop=_stop_strings(body, limits), stream=stream,
                        include_usage=bool(options and options.get("include_usage")),
                        skip_special_tokens=typed_field(body, "skip_special_tokens", bool, True), model=model,
                        max_tokens_given=max_tokens is not None, chat=chat, service=_service_class(body),
                        bad_words=bad_words, structured_field=structured_field, echo=echo, echo_only=echo_only,
                        prompt_logprobs=prompt_logprobs)
    if chat:
        _choices_limit(1, n, limits)
        parsed.messages = _chat_messages(body, limits)
        parsed.add_generation_prompt = typed_field(body, "add_generation_prompt", bool, True)
        _chat_tools(body, parsed)
        parsed.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"), limits)
    else:
        for name in CHAT_ONLY:
            if body.get(name) not in (None, [], {}):
                raise HTTPError(400, f"{name} is for /v1/chat/completions only", name)
        parsed.prompts = _completion_prompts(body, n, limits, max_prompt_tokens)
    return parsed


def _prompt_scoring(body: dict, chat: bool, params: SamplingParams,
                    max_tokens: int | None) -> tuple[bool, bool, int | None]:
    """echo (completions), vLLM's prompt_logprobs (not streamed, as vLLM), and what they ask of
    the workers: the prompt's logprobs with as many alternatives as either shows. echo with
    max_tokens=0 scores the prompt alone (one token is generated and dropped, as vLLM does)."""
    echo = typed_field(body, "echo", bool, False)
    if echo and chat:
        raise HTTPError(400, "echo is for /v1/completions only", "echo")
    shown = typed_field(body, "prompt_logprobs", int)
    if shown is not None:
        if not 0 <= shown <= MAX_LOGPROBS:
            raise HTTPError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {shown}", "prompt_logprobs")
        if body.get("stream"):
            raise HTTPError(400, "prompt_logprobs is not available with stream=true", "prompt_logprobs")
    asked = [k for k in (shown, params.logprobs if echo else None) if k is not None]
    if asked:
        params.prompt_logprobs = max(asked)
    echo_only = echo and max_tokens == 0
    if echo_only:
        params.max_tokens = 1
    return echo, echo_only, shown


def _chat_tools(body: dict, parsed: ParsedBody) -> None:
    """tools, tool_choice, parallel_tool_calls; a forced call (tool_choice "required" or a named
    function) becomes the output's JSON-schema constraint (services/api/tool_calls.py)."""
    parsed.tools = parse_tools(body.get("tools"))
    parsed.tool_choice = parse_tool_choice(body.get("tool_choice"), parsed.tools)
    schema = guided_schema(parsed.tools, parsed.tool_choice, parse_parallel_tool_calls(body.get("parallel_tool_calls")))
    if schema is None:
        return
    if parsed.params.structured_outputs is not None:
        raise HTTPError(400, f"tool_choice={parsed.tool_choice.mode} forces a tool call's JSON; it cannot be combined "
                             f"with {parsed.structured_field}", "tool_choice")
    parsed.params.structured_outputs = StructuredOutputsParams(json=schema)
    parsed.structured_field = "tools"


def _template_kwargs(value: Any, limits: RequestLimits) -> dict:
    """chat_template_kwargs (enable_thinking=False, ...): at most MAX_TEMPLATE_KWARGS scalar values
    under identifier names, none that the front sets itself."""
    if value is None:
        return {}
    name = "chat_template_kwargs"
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise HTTPError(400, f"{name} must be an object of at most {MAX_TEMPLATE_KWARGS} entries", name)
    for key, v in value.items():
        if not isinstance(key, str) or not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise HTTPError(400, f"{name} may not set {quoted(key)}", name)
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise HTTPError(400, f"{name}.{key} must be a string, number, boolean or null", name)
        if isinstance(v, str):
            utf8_size(v, name, limits.max_stop_bytes, "max_stop_bytes")
    return dict(value)


def _service_class(body: dict) -> ServiceClass:
    """vLLM's `priority` (lower first), OpenAI's `user` (the session without a session_id),
    pdserve's latency targets `slo_ttft_ms` / `slo_tpot_ms` (services/router/slo.py) and its
    `session_id` (services/router/routes.py, SessionTable)."""
    values = (typed_field(body, "priority", int, 0), typed_field(body, "user", str, ""),
              typed_field(body, "slo_ttft_ms", float), typed_field(body, "slo_tpot_ms", float),
              typed_field(body, "session_id", str, ""))
    try:
        return ServiceClass(*values)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise HTTPError(400, str(exc), name) from None


def front_requests(parsed: ParsedBody, request_id: str) -> list[FrontRequest]:
    """The body's prompts (a chat: its messages) in the request front's terms, one per prompt."""
    def one(prompt: Prompt | None = None, messages: list[dict] | None = None) -> FrontRequest:
        return FrontRequest(request_id, parsed.params, prompt, messages, parsed.add_generation_prompt,
                            parsed.max_tokens_given, parsed.skip_special_tokens, parsed.service,
                            bad_words=parsed.bad_words, structured_field=parsed.structured_field,
                            tools=parsed.tools, template_kwargs=parsed.template_kwargs)
    if parsed.chat:
        return [one(messages=parsed.messages)]
    return [one(prompt) for prompt in parsed.prompts]


SSE_DONE = b"data: [DONE]\n\n"   # OpenAI's end of a stream


def sse_event(payload: dict) -> bytes:
    """One server-sent event: compact JSON on one data line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ClientGone(Exception):
    """The client disconnected; its work was cancelled."""


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await awaitable, cancelling it if the client disconnects meanwhile (then ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel_all([task, watcher])
        raise
    if task.done():
        await cancel_all([watcher])
        return task.result()
    await cancel_all([task])
    raise ClientGone()


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(coros: list[Awaitable]) -> list[Any]:
    """All results; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await cancel_all([t for t in tasks if not t.done()])


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
            await cancel_all([body, watcher])   # a finished task stays as it is
        if not body.cancelled() and body.exception() is not None:
            if not isinstance(body.exception(), OSError):   # a write to a closed connection is a disconnect
                raise body.exception()
