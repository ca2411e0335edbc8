"""The router's OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``, ``/version``, and vLLM's ``/tokenize`` and ``/detokenize``
(services/api/tokenize_endpoints.py).

It runs in the router's process, on the router's event loop, next to the grpc.aio server, and
sends every request through the same ``Generator`` (admission queue, disaggregated or
colocated placement, migration) as the gRPC API, and every prompt through the same request front
(services/api/request_front.py: limits, tokenizing, chat template, validation); a ``RouterFacade``
(services/api/router_facade.py) supplies them and the metrics, and is all it sees of the router.
Nothing here knows how tokens are produced. The body is parsed, and server-sent events framed, in
services/api/openai_protocol.py; stop strings are matched by services/api/detokenizer.StopMatcher.

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
  anything else is done (``/health`` stays open, as gRPC health does); 401 otherwise. Without
  one, only ``Host`` values a DNS-rebinding page cannot send are answered (localhost, IP
  addresses, ``--allowed-hosts``); 421 otherwise. Generation and (de)tokenize requests must be
  ``application/json`` (415): a web page can POST ``text/plain`` cross-origin unasked.
* Errors: ``{"error": {"message", "type", "param", "code"}}``; 400 bad input (naming the
  field), 401 API key, 404 unknown model or path, 408 body not in within
  ``http_body_timeout_s``, 413 body over ``max_http_body_bytes`` (read with a byte cap before
  parsing) or prompt over ``max_prompt_bytes``, 429 admission queue full or too many requests
  being received (``max_pending_requests``; with ``Retry-After``), 503 no healthy worker or
  draining. Clients never read a worker's address or an internal error's text: those go to
  the router's log under the request id the message gives.
* ``/v1/models``: ``root`` is the served name, never the checkpoint's path on disk.
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
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.engine import SamplingParams
from pdserve.engine.quoting import quoted
from pdserve.services.api import prompt_scores
from pdserve.services.api.chat_output import ChatOutput, ChatOutputSpec
from pdserve.services.api.detokenizer import IncrementalDetokenizer, StopMatcher
from pdserve.services.api.http_connections import OPEN_PATHS, RequestGuard, bounded_protocol
from pdserve.services.api.openai_protocol import (ClientGone, HTTPError, ParsedBody, SSE_DONE, SSEResponse, cancel_all,
    front_requests, gather_or_cancel, http_error, parse_body, read_json, sse_event, until_disconnect)
from pdserve.services.api.principals import ApiKeys, bound_to
from pdserve.services.api.request_limits import InvalidRequest
from pdserve.services.api.router_facade import RouterFacade
from pdserve.services.api.tokenize_endpoints import TokenizeEndpoints
from pdserve.services.api.tool_parsers import parser_for_template
from pdserve.services.common.ports import reuse_port
from pdserve.services.router.errors import RouterError
from pdserve.services.router.slo import ServiceClass

log = logging.getLogger(__name__)



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
    prompt_logprobs: list | None = None   # on a choice's first Delta: per prompt token after the first, when asked


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    first_of_prompt: bool      # counts the prompt's tokens in usage (once per prompt, not per n)
    service: ServiceClass = field(default_factory=ServiceClass)
    output: ChatOutputSpec | None = None   # chat: what its text is parsed for (reasoning, tool calls)
    echo_text: str = ""        # completions with echo: the prompt's text, which leads its text
    echo_only: bool = False    # echo with max_tokens=0: the prompt alone


# ---- the app -------------------------------------------------------------------------------

class OpenAIServer:
    def __init__(self, router: RouterFacade, served_model_name: str | Sequence[str],
                 api_key: ApiKeys | str | None = None, max_body_bytes: int = 8 << 20, model_aliases: Sequence[str] = (),
                 allowed_hosts: str | None = None) -> None:
        """served_model_name: one name or several, as vLLM's --served-model-name: the first is the
        one reported, /v1/models lists them all, every one is accepted; model_aliases: accepted
        too, not listed (the checkpoint directory's name); allowed_hosts: see RouterConfig."""
        self.router = router
        names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
        self.served_model_names = names
        self.served_model_name = names[0]
        self.accepted_model_names = frozenset((*names, *model_aliases))
        self.guard = RequestGuard(api_key, allowed_hosts)
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
            return Response(status_code=200 if self.router.serving else 503)

        @app.get("/version")
        async def version():
            from importlib.metadata import PackageNotFoundError, version as pkg_version
            try:
                return {"version": pkg_version("pdserve")}
            except PackageNotFoundError:
                return {"version": "unknown"}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.router.metrics_registry), media_type=CONTENT_TYPE_LATEST)

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

        TokenizeEndpoints(self.router, self.served_model_name, self._check_model, self.max_body_bytes).add_routes(app)
        return app

    def asgi(self) -> Callable:
        """The app behind the checks made before routing or reading the body (RequestGuard)."""
        app, guard = self.app, self.guard

        async def guarded(scope, receive, send):
            if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
                err = guard.refusal(scope)
                if err is not None:
                    await err.response()(scope, receive, send)
                    return
            await app(scope, receive, send)
        return guarded

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": name, "parent": None, "max_model_len": self.router.max_model_len}

    def _check_model(self, name: str) -> None:
        if name not in self.accepted_model_names:
            raise HTTPError(404, f"The model {quoted(name)} does not exist (this server serves "
                                 f"`{self.served_model_name}`)", "model", "model_not_found")

    # ---- handlers ----------------------------------------------------------------------
    async def _handle(self, request: Request, chat: bool) -> Response:
        started = False   # once generating, each choice counts its own failure (_run_choice)
        base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            if self.router.draining:
                raise RouterError("UNAVAILABLE", "the router is draining (shutting down)")
            limits = self.router.limits
            with self.router.receiving():   # received, not yet in the admission queue
                body = await read_json(request, self.max_body_bytes, limits.http_body_timeout_s)
                parsed = parse_body(body, chat, self.served_model_name, limits, self.router.max_model_len)
                del body
                self._check_model(parsed.model)
                parsed.service = self._bound(request, parsed.service)
                choices = await until_disconnect(request, self._prepare(parsed, base))
            started = True
            if parsed.stream:
                return await self._stream(request, parsed, choices)
            return await until_disconnect(request, self._complete(parsed, choices))
        except (RouterError, HTTPError, InvalidRequest) as exc:
            if not started:
                self.router.request_refused()
            return http_error(exc, base).response()
        except ClientGone:   # nobody to answer; the request was cancelled on its workers
            return Response(status_code=499)
        except Exception:  # noqa: BLE001 - a bug: the client gets no internal text, the log gets it all
            log.exception("request %s failed", base)
            return HTTPError(500, f"internal error (request id {base})", code="internal_error").response()

    def _bound(self, request: Request, service: ServiceClass) -> ServiceClass:
        """The request's class under its caller's API key (the guard let only known keys in)."""
        principal = self.guard.keys.identify(request.headers.get("authorization"))
        if principal is None:   # the guard refuses these before any handler runs
            raise HTTPError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")
        try:
            return bound_to(service, principal)
        except ValueError as exc:
            raise HTTPError(403, str(exc), "priority", "permission_denied") from None

    async def _prepare(self, parsed: ParsedBody, base: str) -> list[Choice]:
        """Tokenize and validate every prompt through the request front (parse_body checked their
        number and sizes); one Choice per (prompt, i < n), with request ids base-k."""
        choices = []
        for p_index, request in enumerate(front_requests(parsed, base)):
            ready = await self.router.prepare(request)
            for i in range(parsed.n):
                p = dataclasses.replace(ready.params, stop_token_ids=list(ready.params.stop_token_ids))
                if p.seed is not None:
                    p.seed = (p.seed + i) % 2**63
                k = p_index * parsed.n + i
                choices.append(Choice(k, f"{base}-{k}", ready.prompt, p, i == 0, ready.service,
                                      self._output_spec(parsed, ready.reasoning_start) if parsed.chat else None,
                                      self._echo_text(parsed, request, ready.prompt), parsed.echo_only))
        return choices

    def _echo_text(self, parsed: ParsedBody, request, prompt: list[int]) -> str:
        if not parsed.echo:
            return ""
        if request.prompt is not None and request.prompt.text is not None:
            return request.prompt.text
        return self.router.tokenizer.decode(prompt, skip_special_tokens=False)

    def _output_spec(self, parsed: ParsedBody, reasoning_start: str | None) -> ChatOutputSpec:
        template = getattr(self.router.tokenizer, "chat_template", None)
        return ChatOutputSpec(parsed.tools, parsed.tool_choice,
                              parser_for_template(template if isinstance(template, str) else None), reasoning_start)

    def _logprobs(self, parsed: ParsedBody, d: Delta, text_offset: int = 0, prompt: list[int] | None = None
                  ) -> dict | None:
        """OpenAI's logprobs object for a Delta's tokens: completions' {tokens, token_logprobs,
        top_logprobs, text_offset} or chat's {content: [{token, logprob, bytes, top_logprobs}]}.
        As vLLM: the sampled token's logprob is always there, besides the top alternatives.
        prompt: with echo, the prompt whose logprobs (d.prompt_logprobs) lead, from text_offset."""
        if parsed.params.logprobs is None:
            return None
        tok = self.router.tokenizer
        if prompt is not None:
            lead = prompt_scores.echo_logprobs(tok, prompt, d.prompt_logprobs or (), parsed.params.logprobs)
            lead["text_offset"] = [text_offset + at for at in lead["text_offset"]]
            return prompt_scores.joined(lead, self._logprobs(parsed, d, text_offset + prompt_scores.text_length(lead)))
        pairs = list(zip(d.token_ids, d.logprobs or ()))
        if parsed.chat:
            def entry(token_id: int, logprob: float) -> dict:
                text = prompt_scores.token_text(tok, token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**entry(t, lp.logprob), "top_logprobs": [
                entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]} for t, lp in pairs]}
        tokens = [prompt_scores.token_text(tok, t) for t, _ in pairs]
        offsets, top = [], []
        for (t, lp), text in zip(pairs, tokens):
            offsets.append(text_offset)
            text_offset += len(text)
            alternatives = {prompt_scores.token_text(tok, i): v for i, v in zip(lp.top_token_ids, lp.top_logprobs)}
            alternatives.setdefault(text, lp.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in pairs], "top_logprobs": top,
                "text_offset": offsets}

    # ---- generation ----------------------------------------------------------------------
    async def _run_choice(self, choice: Choice, stop: list[str], skip_special: bool) -> AsyncIterator[Delta]:
        """One choice through the Generator: text deltas, stop strings applied; the last Delta
        has finish_reason and usage. Leaving early (stop string, cancel) aborts it on the workers."""
        router = self.router
        detok = IncrementalDetokenizer(router.tokenizer, skip_special)
        matcher = StopMatcher(stop)
        completion = 0
        prompt_lp = None
        router.request_started()
        finished = False
        gen_iter = router.generate(choice.request_id, choice.prompt, choice.params, choice.service)
        try:
            async with contextlib.aclosing(gen_iter):
                async for chunk, gen in gen_iter:
                    now = time.perf_counter()
                    if chunk.token_ids:
                        router.observe_tokens(gen, len(chunk.token_ids), now)
                        completion += len(chunk.token_ids)
                    if chunk.finish_reason == "abort":
                        raise RouterError("ABORTED", f"request {choice.request_id} was aborted")
                    final = chunk.finish_reason is not None
                    text = detok.add(chunk.token_ids, final=final)
                    text, hit = matcher.add(text, final, check=completion >= choice.params.min_tokens)
                    prompt_lp = prompt_lp or chunk.prompt_logprobs
                    ids, logprobs = list(chunk.token_ids), chunk.logprobs
                    if choice.echo_only:   # the prompt scored; the token generated to score it is not shown
                        text, ids, logprobs, hit = "", [], None, False
                    if hit or final:
                        finished = True
                        router.observe_finish(gen, len(choice.prompt), completion, now)
                        yield Delta(choice.index, text, ids, "stop" if hit else chunk.finish_reason,
                                    len(choice.prompt) if choice.first_of_prompt else 0,
                                    0 if choice.echo_only else completion,
                                    gen.timing.cached_tokens if choice.first_of_prompt else 0, logprobs, prompt_lp)
                        return   # a stop string: aclosing ends the generation, which aborts it on its workers
                    if not choice.echo_only:
                        yield Delta(choice.index, text, ids, logprobs=logprobs, prompt_logprobs=prompt_lp)
                        prompt_lp = None   # sent with the first Delta
        finally:
            router.request_ended(finished)

    async def _complete(self, parsed: ParsedBody, choices: list[Choice]) -> JSONResponse:
        async def collect(choice: Choice) -> tuple[str, Delta]:
            texts, last, token_ids, logprobs, prompt_lp = [choice.echo_text], None, [], [], None
            async for delta in self._run_choice(choice, parsed.stop, parsed.skip_special_tokens):
                texts.append(delta.text)
                token_ids += delta.token_ids
                logprobs += delta.logprobs or ()
                prompt_lp = prompt_lp or delta.prompt_logprobs
                last = delta
            last.token_ids, last.logprobs, last.prompt_logprobs = token_ids, logprobs, prompt_lp
            return "".join(texts), last

        results = await gather_or_cancel([collect(c) for c in choices])
        created = int(time.time())
        rid = choices[0].request_id.rsplit("-", 1)[0]
        usage = _usage(sum(d.prompt_tokens for _, d in results), sum(d.completion_tokens for _, d in results),
                       sum(d.cached_tokens for _, d in results))
        if parsed.chat:
            def chat_choice(choice: Choice, text: str, d: Delta) -> dict:
                output = ChatOutput(choice.output)
                message = output.message(text)
                return {"index": d.index, "message": message, "logprobs": self._logprobs(parsed, d),
                        "finish_reason": output.finish_reason(d.finish_reason)}
            body = {"id": rid, "object": "chat.completion", "created": created, "model": self.served_model_name,
                    "choices": [chat_choice(c, text, d) for c, (text, d) in zip(choices, results)],
                    "usage": usage}
            if parsed.prompt_logprobs is not None:   # vLLM's: the response's, as its one prompt's
                body["prompt_logprobs"] = self._prompt_logprobs(parsed, choices[0], results[0][1])
        else:
            def completion_choice(choice: Choice, text: str, d: Delta) -> dict:
                out = {"index": d.index, "text": text, "finish_reason": d.finish_reason,
                       "logprobs": self._logprobs(parsed, d, prompt=choice.prompt if parsed.echo else None)}
                if parsed.prompt_logprobs is not None:
                    out["prompt_logprobs"] = self._prompt_logprobs(parsed, choice, d)
                return out
            body = {"id": rid, "object": "text_completion", "created": created, "model": self.served_model_name,
                    "choices": [completion_choice(c, text, d) for c, (text, d) in zip(choices, results)],
                    "usage": usage}
        return JSONResponse(body)

    def _prompt_logprobs(self, parsed: ParsedBody, choice: Choice, d: Delta) -> list:
        return prompt_scores.vllm_prompt_logprobs(self.router.tokenizer, choice.prompt, d.prompt_logprobs or (),
                                                  parsed.prompt_logprobs)

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
            first = await until_disconnect(request, queue.get())
        except BaseException:
            await cancel_all(tasks)
            raise
        if isinstance(first, BaseException):
            await cancel_all(tasks)
            raise first
        rid = choices[0].request_id.rsplit("-", 1)[0]
        created = int(time.time())
        obj = "chat.completion.chunk" if parsed.chat else "text_completion"

        def event(payload_choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> bytes:
            payload = {"id": rid, "object": obj, "created": created, "model": self.served_model_name,
                       "choices": payload_choices}
            if parsed.include_usage:
                payload["usage"] = usage if with_usage else None
            return sse_event(payload)

        offsets = [0] * len(choices)   # text_offset of the next token, per choice
        outputs = [ChatOutput(c.output) for c in choices] if parsed.chat else []

        echoed = [False] * len(choices)   # completions with echo: the prompt leads a choice's first event

        def choice_events(d: Delta) -> list[dict]:
            """One event's choice per delta of d (a chat piece may hold content and a tool call);
            the logprobs go with the first, the finish reason with the last."""
            echo = parsed.echo and not echoed[d.index]
            logprobs = self._logprobs(parsed, d, offsets[d.index], prompt=choices[d.index].prompt if echo else None)
            if logprobs is not None and not parsed.chat:
                offsets[d.index] += sum(len(t) for t in logprobs["tokens"])
            if not parsed.chat:
                text = choices[d.index].echo_text + d.text if echo else d.text
                echoed[d.index] = True
                return [{"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}]
            output = outputs[d.index]
            deltas = output.feed(d.text)
            if d.finish_reason is not None:
                deltas += output.finish()
            if not deltas and (logprobs is not None or d.finish_reason is not None):
                deltas = [{}]
            events = [{"index": d.index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                       "finish_reason": None} for k, delta in enumerate(deltas)]
            if events and d.finish_reason is not None:
                events[-1]["finish_reason"] = output.finish_reason(d.finish_reason)
            return events

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
                    elif isinstance(item, (RouterError, HTTPError, InvalidRequest)):
                        err = http_error(item, rid)
                        yield sse_event(err.body())
                        break
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        if item.finish_reason is not None:
                            totals[0] += item.prompt_tokens
                            totals[1] += item.completion_tokens
                            totals[2] += item.cached_tokens
                        for payload in choice_events(item):
                            yield event([payload])
                    item = await queue.get()
                if parsed.include_usage:
                    yield event([], _usage(*totals), with_usage=True)
                yield SSE_DONE
            finally:
                await cancel_all(tasks)

        return SSEResponse(events())


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


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


async def start_http(router: RouterFacade, host: str, port: int, served_model_name: str | Sequence[str],
                     api_key: str | None = None, max_body_bytes: int = 8 << 20, tls=None,
                     model_aliases: Sequence[str] = (), allowed_hosts: str | None = None) -> HTTPServer:
    """Serve the OpenAI-compatible API on host:port (0: any free port) on the running loop;
    returns once it accepts connections. Raises OSError if the port is taken. tls (a
    services.common.security.TLSFiles): HTTPS with the router's certificate, as its gRPC API has
    (clients are not asked for a certificate; the API key is what authenticates them)."""
    api = OpenAIServer(router, served_model_name, api_key, max_body_bytes, model_aliases=model_aliases,
                       allowed_hosts=allowed_hosts)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port(port):   # reserved for us by `pdserve up` (services/common/ports.py)
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
                            timeout_keep_alive=HTTP_KEEP_ALIVE_S, http=bounded_protocol(), **ssl_files)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()   # raises the start-up error
            raise OSError(f"HTTP server on {host}:{port} stopped during start-up")
        await asyncio.sleep(0.01)
    return HTTPServer(server, task, sock.getsockname()[1], "https" if tls is not None else "http")
