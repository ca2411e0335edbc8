"""Log-probabilities of sampled tokens, for requests that ask (SamplingParams.logprobs), and of
prompt tokens (SamplingParams.prompt_logprobs: each prompt token's, given the tokens before it).

As vLLM reports them by default ("raw_logprobs"): log_softmax of the model's raw logits, before
temperature, top-k or top-p; the sampled token's logprob plus the ``logprobs`` most likely
tokens. The sampler attaches them to the token it returns (``SampledToken``: an int that
carries them), so they travel from the sampler to the engine's step results with nothing in
between changing; requests that do not ask pay nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCORE_ROWS = 256   # prompt rows turned into float32 log-probabilities at a time (memory)


@dataclass(slots=True)
class TokenLogprob:
    logprob: float                                         # of the sampled token
    top_ids: list[int] = field(default_factory=list)       # the most likely tokens, most likely first
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0     # the token's rank in the distribution, 1 for the most likely (prompt tokens; 0: not computed)


class SampledToken(int):
    """A sampled token id carrying its TokenLogprob."""

    logprob: TokenLogprob

    def __new__(cls, token_id: int, logprob: TokenLogprob) -> "SampledToken":
        obj = super().__new__(cls, token_id)
        obj.logprob = logprob
        return obj


def attach_logprobs(logits: torch.Tensor, tokens: list[int], params: list) -> list[int]:
    """tokens, with the rows whose params ask for logprobs turned into SampledTokens."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return tokens
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows], device=logprobs.device)]
    k = min(max(params[i].logprobs for i in rows), logprobs.shape[-1])
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.cpu().tolist(), top_ids.cpu().tolist()
    out = list(tokens)
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = SampledToken(tokens[i], TokenLogprob(chosen[j], top_ids[j][:n], top_vals[j][:n]))
    return out


def logprob_of(token: int) -> TokenLogprob | None:
    return getattr(token, "logprob", None)


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Row i of logits is the model's prediction after a prompt position; targets[i] the prompt
    token that followed it. Its logprob, rank and the k most likely tokens, per row."""
    out: list[TokenLogprob] = []
    for at in range(0, len(targets), SCORE_ROWS):
        logprobs = torch.log_softmax(logits[at:at + SCORE_ROWS].float(), dim=-1)
        target = torch.tensor(targets[at:at + SCORE_ROWS], device=logprobs.device)
        chosen = logprobs.gather(1, target[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        for lp, rank, ids, vals in zip(chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_vals.tolist()):
            out.append(TokenLogprob(lp, ids, vals, rank))
    return out


class PromptScorer:
    """Turns a step's scored prompt rows (StepPlan.scored: per prefill segment, its batch index,
    first position and row count; they follow the sampled rows) into prompt logprobs, fed their
    logits in row order, a slice at a time."""

    def __init__(self, seqs: list, plan) -> None:
        self.num_sampled = len(plan.sample_seqs)
        self.scores: dict[int, list[TokenLogprob]] = {}
        self._segments = [(i, seqs[i].token_ids[first + 1:first + 1 + rows], seqs[i].params.prompt_logprobs)
                          for i, first, rows in plan.scored]
        self._segment, self._done = 0, 0   # the segment being fed, and its rows already scored

    def add(self, logits: torch.Tensor) -> None:
        at = 0
        while at < len(logits):
            i, targets, k = self._segments[self._segment]
            n = min(len(targets) - self._done, len(logits) - at)
            self.scores.setdefault(i, []).extend(
                prompt_token_logprobs(logits[at:at + n], targets[self._done:self._done + n], k))
            at += n
            self._done += n
            if self._done == len(targets):
                self._segment, self._done = self._segment + 1, 0
