"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.engine.quoting import quoted

MAX_LOGPROBS = 20   # vLLM's default max_logprobs
MAX_TOP_K = 2**31 - 1        # the wire's bounds (common.proto: top_k int32, token counts uint32)
MAX_TOKENS = 2**32 - 1
MAX_CACHE_SALT_CHARS = 256
PRIORITY_RANGE = (-(2**31), 2**31 - 1)   # the wire's int32 (common.proto: priority)
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38   # smaller (subnormal) reads as 0 in a process that flushes denormals


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy. top_k == 0 disables top-k; top_p == 1 disables top-p.
    A request with a seed samples reproducibly, whatever else shares its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0          # EOS and stop_token_ids do not end the request before this many tokens
    logprobs: int | None = None  # report the sampled token's logprob and this many top alternatives
    cache_salt: str | None = None  # prefix-cache namespace: blocks are shared only within one salt
    priority: int = 0            # lower is served first (vLLM's); a higher class may preempt a lower one

    def validate(self) -> None:
        """Raise ValueError naming the first field outside its limits."""
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {quoted(self.temperature)}")
        if not isinstance(self.top_p, (int, float)) or not (FLOAT32_MIN_NORMAL <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (and a normal float32: >= {FLOAT32_MIN_NORMAL:.4g}), "
                             f"got {quoted(self.top_p)}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it), got {quoted(self.top_k)}")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {quoted(self.max_tokens)}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0 or self.seed >= 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {quoted(self.seed)}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {quoted(self.min_tokens)}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {quoted(self.logprobs)}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt.isprintable()
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a non-empty printable string of at most {MAX_CACHE_SALT_CHARS} "
                             f"characters")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not PRIORITY_RANGE[0] <= self.priority <= PRIORITY_RANGE[1]:
            raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], "
                             f"got {quoted(self.priority)}")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {quoted(tok)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
