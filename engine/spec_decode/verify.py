"""Greedy verification: a draft's tokens are accepted while each equals the model's greedy token
at the position before it; the model's token at the first mismatch (after a full acceptance:
the bonus token) follows them. The tokens emitted are exactly those plain greedy decoding gives."""
from __future__ import annotations


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many draft tokens are accepted. targets[j]: the model's token after the verified row j
    (row 0: the sequence's last accepted token; row j > 0: draft[j - 1]); len(targets) == len(draft) + 1."""
    n = 0
    for proposed, target in zip(draft, targets):
        if proposed != target:
            break
        n += 1
    return n


def greedy_verify(draft: list[int], targets: list) -> list:
    """The tokens a verification step emits, in order: targets[:accepted + 1] (the targets
    themselves, so a sampled token's logprob travels with it)."""
    return targets[:accepted_length(draft, [int(t) for t in targets]) + 1]
