"""What the load generator records of one request, and the sampling settings it sends: shared by
its gRPC client (grpc_backend.py) and its OpenAI HTTP client (openai_backend.py); and the failed
requests counted by kind of error (``error_counts``)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

MAX_ERROR_KIND_CHARS = 160   # of a normalized message: longer ones that agree this far count together
_REQUEST_ID = re.compile(r" ?\(request id [^)]*\)")   # pdserve's "(request id X; the router's log has ...)"
_HEX_ID = re.compile(r"\b(?=[0-9a-fA-F-]*\d)(?=[0-9a-fA-F-]*[a-fA-F])[0-9a-fA-F]{8,}(?:-[0-9a-fA-F]+)*\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_SLOT = "\0"


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0                  # e2el
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0               # seconds after the benchmark start
    error: str = ""
    finish_reason: str = ""
    kind: str = ""
    server_timings: dict[str, float] = field(default_factory=dict)   # the router's Timings, ms
    token_ids: list[int] = field(default_factory=list)   # the answer, as generated
    cached_tokens: int | None = None      # prompt tokens the server found cached; None: it did not say
    prefill_route: str = ""               # the router's Timings: "remote" | "local" | "colocated"
    decode_cached_tokens: int = 0         # prompt tokens the decode worker already held
    kv_bytes: int = 0                     # KV bytes shipped to the decode worker
    kv_wire_bytes: int = 0                # their size on the wire (encoded)
    error_s: float = 0.0                  # a failed request: from sending it to its error
    retry_after_s: float | None = None    # a refused one: the server's retry hint, when it gave one

    @property
    def tpot(self) -> float | None:
        if self.output_len > 1:
            return (self.latency - self.ttft) / (self.output_len - 1)
        return None


@dataclass(slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": self.temperature, "ignore_eos": self.ignore_eos}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        return out


def settle(res: RequestResult, finished: bool, unfinished: str) -> RequestResult:
    """Classify a request whose stream ended without raising: a failure (res.error) when it never
    finished (unfinished: the message), was aborted, or produced no tokens; else a success."""
    if not finished:
        res.error = unfinished
    elif res.finish_reason == "abort":
        res.error = "finish_reason=abort"
    elif res.output_len == 0:
        res.error = "no output tokens"
    else:
        res.success = True
    return res


def error_counts(errors: Iterable[str]) -> dict[str, int]:
    """Failed requests by kind, most frequent first: {kind: count}. A kind is the error's status
    (``HTTP 429``, a gRPC code, an exception type, as the backends write it) and its message with
    request ids taken out; numbers that differ between its requests read N (``within Ns``), numbers
    they all share stay (``max_queued_requests=4096``). "" (a success) is not counted."""
    groups: dict[str, list[list[str]]] = {}   # the message with numbers as slots -> each one's numbers
    for error in errors:
        if not error:
            continue
        text = _HEX_ID.sub("ID", _REQUEST_ID.sub("", error.replace(_SLOT, ""))).strip()
        shape = _NUMBER.sub(_SLOT, text)
        if len(shape) > MAX_ERROR_KIND_CHARS:
            shape = shape[:MAX_ERROR_KIND_CHARS - 3] + "..."
        groups.setdefault(shape, []).append(_NUMBER.findall(text)[:shape.count(_SLOT)])
    counts: dict[str, int] = {}
    for shape, numbers in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        slots = iter([values[0] if len(set(values)) == 1 else "N" for values in zip(*numbers)])
        counts[re.sub(re.escape(_SLOT), lambda _: next(slots), shape)] = len(numbers)
    return counts
