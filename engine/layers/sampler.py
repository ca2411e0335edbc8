"""Token sampling: greedy, temperature, top-k, top-p, reproducible per-request seeds.

Sampling uses the exponential-race form of the Gumbel trick: argmax(p / E) with E ~ Exp(1)
draws from p. A seeded request draws E from a generator keyed by (seed, output index), so
its tokens do not depend on what else shares the batch, or on preemption and recompute.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def _row_generator(seed: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * _MIX + index) % (2**63))
    return g


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
        """logits: [B, V]; output_index[i]: how many tokens row i has generated so far."""
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            sampled = self._sample(logits[rows], [params[i] for i in rows], [output_index[i] for i in rows])
            tokens[rows] = sampled
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        sorted_logits, sorted_ids = (logits / temps).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        outside = (probs.cumsum(dim=-1) - probs) > top_p   # mass before this token already covers top_p
        probs = probs.masked_fill(outside, 0.0)
        noise = torch.empty_like(probs)
        for i, p in enumerate(params):
            gen = self.generator if p.seed is None else _row_generator(p.seed, output_index[i])
            noise[i].exponential_(generator=gen)
        choice = (probs / noise).argmax(dim=-1, keepdim=True)
        return sorted_ids.gather(1, choice).squeeze(1)
