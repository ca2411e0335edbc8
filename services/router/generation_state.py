"""What the router knows of one request while it generates: its tokens so far, where it may
hold state, its timing breakdown, and the chunks it streams to the client."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine import SamplingParams
from pdserve.v1 import common_pb2
from pdserve.services.router.slo import ServiceClass
from pdserve.services.router.worker_pool import WorkerHandle


@dataclass(slots=True)
class Timing:
    start: float
    first_token: float | None = None
    last_token: float | None = None
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    first_decode_step_ms: float = 0.0
    cached_tokens: int = 0
    migrations: int = 0
    prefill_route: str = ""             # "remote" | "local" | "colocated"
    estimated_local_ms: float = 0.0
    estimated_remote_ms: float = 0.0
    threshold_tokens: float | None = None
    decode_cached_tokens: int = 0
    kv_bytes: int = 0
    kv_wire_bytes: int = 0              # kv_bytes' size on the wire (encoded)
    kv_streams: int = 0
    kv_codec: str = ""
    spec_decode: common_pb2.SpecDecodeCounts | None = None   # from the decode worker that finished it


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[common_pb2.TokenLogprob] | None = None   # one per token, when params.logprobs is set
    # on the first chunk, when params.prompt_logprobs is set: one per prompt token after the first
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None


@dataclass(eq=False)
class Generation:
    """One request as the router follows it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    timing: Timing
    generated: list[int] = field(default_factory=list)
    workers: set[WorkerHandle] = field(default_factory=set)   # where it may hold state now
    failed: set[str] = field(default_factory=set)              # workers it left after a fault
    aborted: bool = False
    deadline: float | None = None      # the client's own deadline (monotonic), when it gave one
    service: ServiceClass = field(default_factory=ServiceClass)   # its priority, client and latency targets
    arrived: float = field(default_factory=time.monotonic)
    trace: Any = None                  # its root span (services/common/tracing.py), None when tracing is off
    unplaced_tokens: int = 0           # admitted by prediction, prompt not yet on a worker (SloGate)

    @property
    def worker_request_id(self) -> str:
        """The id the workers know this attempt by, inside its caller's scope (two API keys' equal
        ids never meet on a worker): a late abort of an earlier attempt can never hit the current
        one, even on the same worker."""
        scoped = f"{self.service.principal}/{self.request_id}" if self.service.principal else self.request_id
        return scoped if not self.timing.migrations else f"{scoped}@{self.timing.migrations}"

    @property
    def n_tokens(self) -> int:
        """The tokens a new attempt prefills: the prompt and every token already sent."""
        return len(self.prompt) + len(self.generated)
