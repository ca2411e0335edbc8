"""Adaptive draft depth: how many of its drafted tokens each sequence verifies this step, chosen so
that the step's tokens per millisecond are as high as the sequences' recent acceptance says.

Each sequence keeps an estimate of its acceptance rate a (the chance that a draft token is accepted
once the ones before it were): decayed counts of accepted tokens and of first rejections, over a
prior (PRIOR_ACCEPTANCE, PRIOR_WEIGHT). Its draft token j is then accepted with probability a^j
(a geometric model) and costs one more row of the forward pass. The step's cost is a line in its
decode rows, base_ms + ms_per_row * rows, fitted from this engine's decode-only steps (plain and
verifying, ``observe_step``); until a spread of row counts identifies it, ms_per_row is
PRIOR_ROW_SHARE of a row's average.

``choose`` takes the candidate rows of every decoding sequence, most probable first, while each
adds more expected tokens per millisecond than the step yields on average so far (p * T > ms_per_row
* N, N the expected tokens and T the cost of the rows taken): a deep draft for a sequence that
copies, none for one whose drafts are rejected, and fewer in a large batch, whose step is already
worth many tokens. A sequence whose draft is passed over decays its counts (PASSED_OVER_DECAY)
towards the prior, so text that starts copying later is tried again. A step that several
sequences wait for is lengthened by drafts by at most SHARED_STEP_STRETCH of its plain cost (the
others' inter-token gap); a lone sequence's drafts only lengthen its own. Which tokens a sequence emits
never depends on its drafts (engine/spec_decode/verify.py), so the depth changes the speed only.

With adaptive_depth off, drafts are verified whole while the step's budget lasts."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sequence import Sequence
from pdserve.engine.step_cost import StepCost

PRIOR_ACCEPTANCE = 0.6     # a sequence's acceptance rate before it verified anything ...
PRIOR_WEIGHT = 1.0         # ... worth this many observations
ACCEPTANCE_DECAY = 0.8     # per verification: its counts' memory, ~5 verifications
PASSED_OVER_DECAY = 0.95   # per step its draft is passed over: back towards the prior in ~20 steps
PRIOR_ROW_SHARE = 0.1      # a row's marginal cost, as a share of an average row, before the fit
ROW_FIT_DECAY = 0.99       # the step-cost line forgets over ~100 decode steps
SHARED_STEP_STRETCH = 0.5  # drafts lengthen a step of several decodes by at most this share of its plain cost
ROW_FIT_SPREAD = 1.0       # rows must spread by this much (standard deviation) to identify the line


@dataclass(slots=True)
class DraftState:
    """One sequence's speculation (Sequence.draft_state): its decayed acceptance counts, and the
    plain counts of its verifications (reported with the request)."""

    accepted: float = 0.0
    rejected: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


def draft_state(seq: Sequence) -> DraftState:
    if not isinstance(seq.draft_state, DraftState):
        seq.draft_state = DraftState()
    return seq.draft_state


class DraftDepth:
    """The draft depths of one engine's decoding sequences."""

    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive
        self.row_cost = StepCost(decay=ROW_FIT_DECAY, min_spread=ROW_FIT_SPREAD)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """seq verified a draft of drafted tokens, of which the first accepted were accepted."""
        state = draft_state(seq)
        state.num_drafts += 1
        state.num_draft_tokens += drafted
        state.num_accepted_tokens += accepted
        state.accepted = state.accepted * ACCEPTANCE_DECAY + accepted
        state.rejected = state.rejected * ACCEPTANCE_DECAY + (accepted < drafted)

    def observe_step(self, rows: int, ms: float) -> None:
        """A decode-only step of rows rows (decodes and draft tokens) took ms."""
        self.row_cost.observe(rows, ms)

    def costs(self) -> tuple[float, float]:
        """(base_ms, ms_per_row) of a decode step; any scale before the first step (only the ratio matters)."""
        line = self.row_cost.line()
        if line is not None:
            return line
        if not self.row_cost.fitted:
            return 1.0 - PRIOR_ROW_SHARE, PRIOR_ROW_SHARE
        _, ms_per_row = self.row_cost.coefficients()   # the average row, through the origin
        return (1.0 - PRIOR_ROW_SHARE) * ms_per_row, PRIOR_ROW_SHARE * ms_per_row

    def may_pay(self, seqs: list[Sequence]) -> list[bool]:
        """Whether a draft of each decoding sequence could pay in this step: its acceptance above
        what the step's first draft row must be worth. One that cannot is passed over without
        asking the proposer (whose lookup would run every step for text that copies nothing)."""
        if not self.adaptive:
            return [True] * len(seqs)
        base_ms, ms_per_row = self.costs()
        floor = ms_per_row * len(seqs) / (base_ms + ms_per_row * len(seqs))
        out = []
        for seq in seqs:
            out.append(draft_state(seq).acceptance > floor)
            if not out[-1]:
                _pass_over(seq)
        return out

    def choose(self, seqs: list[Sequence], drafts: list[list[int]], budget: int) -> list[int]:
        """How many tokens of drafts[i] seqs[i] verifies this step (at most budget in all)."""
        if not self.adaptive:
            keep = []
            for draft in drafts:
                keep.append(min(len(draft), budget))
                budget -= keep[-1]
            return keep
        base_ms, ms_per_row = self.costs()
        candidates = []   # (probability, sequence index, depth)
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            a, p = draft_state(seq).acceptance, 1.0
            for j in range(1, len(draft) + 1):
                p *= a
                candidates.append((p, i, j))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        keep = [0] * len(drafts)
        tokens, ms = float(len(seqs)), base_ms + ms_per_row * len(seqs)
        # a step several sequences wait for is lengthened by drafts by a bounded share only
        max_ms = ms * (1.0 + SHARED_STEP_STRETCH) if len(seqs) > 1 else float("inf")
        for p, i, j in candidates[:budget]:
            if p * ms <= ms_per_row * tokens or ms + ms_per_row > max_ms:
                break
            keep[i] = j   # most probable first: j is keep[i] + 1
            tokens += p
            ms += ms_per_row
        for seq, draft, n in zip(seqs, drafts, keep):
            if draft and not n:
                _pass_over(seq)
        return keep


def _pass_over(seq: Sequence) -> None:
    """seq drafts nothing this step: its estimate drifts back towards the prior."""
    state = draft_state(seq)
    state.accepted *= PASSED_OVER_DECAY
    state.rejected *= PASSED_OVER_DECAY
