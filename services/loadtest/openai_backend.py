"""`pdserve bench serve --backend openai|openai-chat`: the load generator's client for an
OpenAI-compatible HTTP API (pdserve's router with --http-port, vLLM, SGLang), so that one load
generator measures all of them. Streaming /v1/completions or /v1/chat/completions over SSE, one
HTTP/1.1 connection per request, standard library only.

Timing, as the gRPC client's and vLLM's: TTFT is the arrival of the first SSE chunk that carries
text; every later text-carrying chunk adds one ITL gap (a chunk of several tokens is one gap); e2el
ends at ``data: [DONE]``. Output tokens: the usage chunk's ``completion_tokens`` (asked for with
``stream_options.include_usage``), else one per text chunk. Token-id prompts go to
/v1/completions as they are (exact input lengths); ``openai-chat`` sends their decoded text as one
user message, and the input length is then the server's ``usage.prompt_tokens``.

Multi-turn sessions (services/loadtest/multi_turn.py) need the answer's token ids: with
``return_token_ids`` the body asks for them (vLLM's extension: each streamed choice carries its
delta's ``token_ids``), and a chunk with ids but no text (a character not complete yet) counts as a
token-carrying chunk. With ``send_session_id`` a request of a session carries pdserve's
``session_id`` body field (other servers ignore it; off by default). Cached prompt tokens come from
the usage chunk's ``prompt_tokens_details.cached_tokens`` when the server gives it (vLLM with
``--enable-prompt-tokens-details``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from pdserve.engine.settings import ENV
from pdserve.services.loadtest.datasets import SampleRequest
from pdserve.services.loadtest.results import RequestResult, Sampling, settle

BACKENDS = ("pdserve", "openai", "openai-chat")   # pdserve: the router's gRPC API
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
MAX_HEADER_BYTES = 64 << 10
MAX_EVENT_BYTES = 16 << 20      # one SSE event (a chunk of text and logprobs) at most
MAX_ERROR_BODY = 4096           # bytes of an error response kept for the message


@dataclass(slots=True)
class Endpoint:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, base_url: str) -> "Endpoint":
        """http(s)://HOST[:PORT][/v1]: vLLM's --base-url, with or without its /v1."""
        u = urllib.parse.urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url must be http(s)://HOST[:PORT], got {base_url!r}")
        if u.path.rstrip("/") not in ("", "/v1"):
            raise ValueError(f"--base-url takes no path but /v1 (the endpoint follows from --backend), got {base_url!r}")
        return cls(u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        try:
            doc = json.loads(body)
            err = doc.get("error", doc) if isinstance(doc, dict) else {}
            message = err.get("message") if isinstance(err, dict) else str(err)
        except ValueError:
            message = None
        super().__init__(f"HTTP {status}: {message or body[:200].decode(errors='replace')}")


async def _open(ep: Endpoint, method: str, path: str, body: bytes | None, headers: dict[str, str]):
    """Send one request; returns (reader, writer, status, response headers lower-cased)."""
    ctx = ssl.create_default_context() if ep.scheme == "https" else None
    reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=ctx, limit=MAX_EVENT_BYTES)
    head = [f"{method} {path} HTTP/1.1", f"Host: {ep.host}:{ep.port}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
    await writer.drain()
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        writer.close()
        raise ConnectionError(f"not an HTTP response from {ep.url}: {status_line[:80]!r}")
    resp_headers: dict[str, str] = {}
    size = 0
    while True:
        line = await reader.readline()
        size += len(line)
        if size > MAX_HEADER_BYTES:
            writer.close()
            raise ConnectionError(f"response headers from {ep.url} over {MAX_HEADER_BYTES} bytes")
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        resp_headers[name.strip().lower()] = value.strip()
    return reader, writer, int(parts[1]), resp_headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives (chunked, sized, or until the connection closes)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            if size > MAX_EVENT_BYTES:
                raise ConnectionError(f"a response chunk of {size} bytes (limit {MAX_EVENT_BYTES})")
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        n = int(headers["content-length"])
        if n > MAX_EVENT_BYTES:
            raise ConnectionError(f"a response body of {n} bytes (limit {MAX_EVENT_BYTES})")
        yield await reader.readexactly(n)
    else:
        while data := await reader.read(65536):
            yield data


async def _read_all(reader: asyncio.StreamReader, headers: dict[str, str], limit: int) -> bytes:
    out = b""
    async for data in _body(reader, headers):
        out += data
        if len(out) > limit:
            break
    return out[:limit]


class OpenAIBackend:
    """Streams requests to one OpenAI-compatible server. chat: /v1/chat/completions."""

    def __init__(self, base_url: str, model: str | None = None, chat: bool = False, api_key: str | None = None,
                 timeout: float | None = 600.0, send_session_id: bool = False, return_token_ids: bool = False) -> None:
        self.endpoint = Endpoint.parse(base_url)
        self.model, self.chat, self.timeout = model, chat, timeout
        self.send_session_id, self.return_token_ids = send_session_id, return_token_ids
        key = api_key or ENV.OPENAI_API_KEY.get() or ENV.API_KEY.get()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def get_json(self, path: str) -> Any:
        reader, writer, status, headers = await asyncio.wait_for(
            _open(self.endpoint, "GET", path, None, self.headers), 30)
        try:
            body = await asyncio.wait_for(_read_all(reader, headers, MAX_EVENT_BYTES), 30)
        finally:
            writer.close()
        if status != 200:
            raise HTTPStatusError(status, body[:MAX_ERROR_BODY])
        return json.loads(body)

    async def models(self) -> list[dict[str, Any]]:
        """The cards of GET /v1/models."""
        return list((await self.get_json("/v1/models")).get("data") or [])

    def payload(self, req: SampleRequest, sampling: Sampling) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": sampling.temperature}
        if self.chat:
            if not isinstance(req.prompt, str):
                raise ValueError("openai-chat needs text prompts (prepare_chat_prompts decodes token ids)")
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.expected_output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.expected_output_len
        if sampling.top_p is not None:
            body["top_p"] = sampling.top_p
        if sampling.top_k is not None:
            body["top_k"] = sampling.top_k       # an extension vLLM, SGLang and pdserve accept
        if sampling.ignore_eos:
            body["ignore_eos"] = True            # likewise
        if self.return_token_ids:
            body["return_token_ids"] = True      # vLLM's: each choice's token_ids
        if self.send_session_id and req.session_id:
            body["session_id"] = req.session_id  # pdserve's
        return body

    async def events(self, body: dict[str, Any]) -> AsyncIterator[tuple[float, str]]:
        """(arrival time, data) of each SSE event of one streamed request."""
        path = ENDPOINTS["openai-chat" if self.chat else "openai"]
        reader, writer, status, headers = await _open(self.endpoint, "POST", path, json.dumps(body).encode(),
                                                      {**self.headers, "Accept": "text/event-stream"})
        try:
            if status != 200:
                raise HTTPStatusError(status, await _read_all(reader, headers, MAX_ERROR_BODY))
            buf = b""
            async for data in _body(reader, headers):
                now = time.perf_counter()
                buf += data.replace(b"\r\n", b"\n")
                if len(buf) > MAX_EVENT_BYTES:
                    raise ConnectionError(f"an SSE event over {MAX_EVENT_BYTES} bytes")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
                    if lines:
                        yield now, b"\n".join(lines).decode()
        finally:
            writer.close()

    async def send(self, req: SampleRequest, request_id: str, sampling: Sampling, bench_start: float
                   ) -> RequestResult:
        """One request, timed as the module says; failures are recorded, never raised."""
        res = RequestResult(prompt_len=max(req.prompt_len, 0), kind=req.kind)
        st = time.perf_counter()
        res.start_time = st - bench_start
        try:
            if self.timeout is None:
                done = await self._stream(res, req, sampling, st)
            else:
                done = await asyncio.wait_for(self._stream(res, req, sampling, st), self.timeout)
        except asyncio.TimeoutError:
            res.error = f"timeout: no [DONE] within {self.timeout:g}s"
            return res
        except Exception as exc:  # noqa: BLE001 - a benchmark records, it does not crash
            res.error = str(exc) if isinstance(exc, HTTPStatusError) else f"{type(exc).__name__}: {exc}"
            return res
        return settle(res, done, "stream ended without data: [DONE]")

    async def _stream(self, res: RequestResult, req: SampleRequest, sampling: Sampling, st: float) -> bool:
        async with contextlib.aclosing(self.events(self.payload(req, sampling))) as events:
            return await self._read(res, req, events, st)

    async def _read(self, res: RequestResult, req: SampleRequest, events, st: float) -> bool:
        chunks, last, usage = 0, st, None
        async for now, data in events:
            if data == "[DONE]":
                res.latency = now - st
                if usage and usage.get("completion_tokens") is not None:
                    res.output_len = int(usage["completion_tokens"])
                    if req.prompt_len < 0 and usage.get("prompt_tokens") is not None:
                        res.prompt_len = int(usage["prompt_tokens"])
                else:
                    res.output_len = chunks
                res.cached_tokens = cached_tokens(usage)
                return True
            doc = json.loads(data)
            if "error" in doc or doc.get("object") == "error":
                err = doc.get("error", doc)
                raise RuntimeError(err.get("message", err) if isinstance(err, dict) else err)
            usage = doc.get("usage") or usage
            for choice in doc.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                ids = choice.get("token_ids") or ()
                res.token_ids.extend(int(t) for t in ids)
                if text or ids:
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
        return False


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, when the server reports it."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if value is not None else None


@dataclass(slots=True)
class ServerInfo:
    """What the workload needs to know of the server (the gRPC path reads it from GetModelInfo)."""

    model_name: str
    vocab_size: int
    eos_token_id: int | None
    max_model_len: float


async def server_info(backend: OpenAIBackend, tokenizer_dir: str | None, need_vocab: bool):
    """The served model (backend.model, else the first of /v1/models) and its tokenizer, which
    makes random prompts: tokenizer_dir, else the model name when it is a local directory (as
    `vllm bench serve --model PATH` does). Returns (ServerInfo, tokenizer or None)."""
    cards = await backend.models()
    if backend.model is None:
        if not cards:
            raise ValueError(f"{backend.endpoint.url}/v1/models lists no model: pass --model NAME")
        backend.model = cards[0]["id"]
    card = next((c for c in cards if c.get("id") == backend.model), {})
    tokenizer_dir = tokenizer_dir or (backend.model if os.path.isdir(backend.model) else None)
    tokenizer, vocab, eos = None, 0, None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        vocab, eos = len(tokenizer), tokenizer.eos_token_id
        config = os.path.join(tokenizer_dir, "config.json")
        if os.path.isfile(config):   # a padded vocabulary: ids past the tokenizer's are not words
            with open(config) as f:
                vocab = min(vocab, int(json.load(f).get("vocab_size") or vocab))
    elif need_vocab:
        raise ValueError(f"random prompts need the model's tokenizer: pass --tokenizer DIR (the model "
                         f"{backend.model!r} is not a local directory)")
    max_len = card.get("max_model_len") or float("inf")
    return ServerInfo(backend.model, vocab, eos, max_len), tokenizer


def prepare_chat_prompts(requests: Sequence[SampleRequest], tokenizer) -> list[SampleRequest]:
    """Token-id prompts as text (one user message each); their length is then the server's count."""
    if tokenizer is None and any(not isinstance(r.prompt, str) for r in requests):
        raise ValueError("openai-chat with token-id prompts needs the model's tokenizer: pass --tokenizer DIR")
    return [r if isinstance(r.prompt, str) else
            SampleRequest(tokenizer.decode(r.prompt), -1, r.expected_output_len, r.kind) for r in requests]
