"""One engine's speculative decoding: the proposer a SpeculativeConfig names, each sequence's
adaptive draft depth, and the counters. The scheduler asks it for drafts; the engine tells it
what each verification accepted and which sequences left."""
from __future__ import annotations

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.depth import DraftDepth, DraftState
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.proposer import Proposer, make_proposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """proposer: the one config names unless given (tests)."""
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.depth = DraftDepth(config.adaptive_depth)
        self.stats = SpecDecodeStats()

    def drafts(self, seqs: list[Sequence], rooms: list[int], budget: int) -> list[list[int]]:
        """A draft for each decoding sequence (rooms[i]: tokens seqs[i] may draft at most; []:
        none), at most budget tokens in all, as deep as each pays (engine/spec_decode/depth.py)."""
        k = self.config.num_speculative_tokens
        proposed = [self.proposer.propose(seq, min(room, k, budget)) if room > 0 and budget > 0 and worth else []
                    for seq, room, worth in zip(seqs, rooms, self.depth.may_pay(seqs))]
        # a constrained sequence drafts only what its grammar allows (engine/structured/state.py)
        proposed = [seq.grammar.valid_prefix(draft) if draft and seq.grammar is not None else draft
                    for seq, draft in zip(seqs, proposed)]
        return [draft[:n] for draft, n in zip(proposed, self.depth.choose(seqs, proposed, budget))]

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.stats.observe(drafted, accepted)
        self.depth.observe(seq, drafted, accepted)

    def observe_step(self, rows: int, ms: float) -> None:
        """A decode-only step (plain or verifying) of rows rows took ms."""
        self.depth.observe_step(rows, ms)

    def finished(self, seq: Sequence) -> None:
        self.proposer.finished(seq)


def request_counts(seq: Sequence) -> tuple[int, int, int]:
    """seq's (drafts, draft tokens, accepted tokens) on this engine: zeros when it never drafted."""
    state = seq.draft_state
    if not isinstance(state, DraftState):
        return (0, 0, 0)
    return (state.num_drafts, state.num_draft_tokens, state.num_accepted_tokens)
