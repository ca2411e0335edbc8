"""Verification: a draft's tokens are accepted while each equals the token the model samples at
the row before it; the sampled token at the first mismatch (after a full acceptance: the bonus
token) follows them.

Greedy: the sampled token is the argmax, so the tokens emitted are exactly those of plain greedy
decoding.

Sampling (temperature, top-k, top-p): this is rejection sampling, exact for the proposers here,
whose drafts are single tokens with no distribution of their own (q is a point mass on the draft
token d). Speculative sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and, on a
rejection, draws from the residual max(0, p - q) renormalised: p with d removed. Drawing t ~ p and
accepting iff t == d does both: P(accept) = p(d), and a rejected t is distributed as p given t != d.
Each row draws with the uniform plain decoding would use at that output index (a seeded request:
keyed by (seed, index), engine/layers/sampler.py), so a seeded request emits the very tokens it
emits without speculation, and an unseeded one follows the plain distribution."""
from __future__ import annotations


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many draft tokens are accepted. targets[j]: the token sampled after the verified row j
    (row 0: the sequence's last accepted token; row j > 0: draft[j - 1]); len(targets) == len(draft) + 1."""
    n = 0
    for proposed, target in zip(draft, targets):
        if proposed != target:
            break
        n += 1
    return n


def verify(draft: list[int], targets: list) -> list:
    """The tokens a verification step emits, in order: targets[:accepted + 1] (the targets
    themselves, so a sampled token's logprob travels with it)."""
    return targets[:accepted_length(draft, [int(t) for t in targets]) + 1]
