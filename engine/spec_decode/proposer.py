"""What the scheduler asks of a proposer, and the one a SpeculativeConfig names."""
from __future__ import annotations

from typing import Protocol

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.suffix import SuffixProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most max_tokens draft tokens to follow seq's tokens (verified ones only); it may keep
        what it needs between calls on seq.proposer_state."""
        ...

    def finished(self, seq: Sequence) -> None:
        """seq left this engine (finished, aborted, handed off or failed) with its verified tokens:
        a proposer that learns across requests takes them; one that does not ignores the call."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
