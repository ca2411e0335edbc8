"""Speculative decoding counters, with vLLM's meanings: drafts verified, draft tokens proposed,
draft tokens accepted, and accepted tokens per draft position."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [j]: drafts whose token j was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One draft of num_draft_tokens verified, its first num_accepted accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens each verification emits on average: the accepted ones plus the model's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, int]:
        """Flat integer counters (LLMEngine.stats()): spec_decode_num_* and ..._pos_<j> per position."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                **{f"spec_decode_num_accepted_tokens_pos_{j}": n for j, n in enumerate(self.accepted_per_position)}}
