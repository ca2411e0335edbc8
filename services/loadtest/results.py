"""What the load generator records of one request, and the sampling settings it sends: shared by
its gRPC client (grpc_backend.py) and its OpenAI HTTP client (openai_backend.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
