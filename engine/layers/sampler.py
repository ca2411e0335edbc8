"""Token sampling: greedy, temperature, top-k, top-p, reproducible per-request seeds.

Sampling inverts the CDF: with the probabilities in token-id order, the token is the first
whose cumulative probability (float64) exceeds U * total, U ~ Uniform[0, 1); one draw per row.
A seeded request draws U from a generator keyed by (seed, output index), so its tokens do not
depend on what else shares the batch, or on preemption and recompute.

With ``native=True`` (the native CPU backend) greedy and plain-temperature rows are sampled by
the C++ kernel (``cpu_kernels.sample``): the same rule over the same U draws, on the bf16 or
float32 logits as they are, without the float copy, the full softmax tensor and the float64
cumsum; rows with top-k / top-p keep the torch path below.
"""
from __future__ import annotations

import torch

from pdserve.engine.layers import cpu_kernels
from pdserve.engine.logprobs import attach_logprobs
from pdserve.engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
TOP_P_CANDIDATES = 1024   # top-p without top-k looks at this many of the largest logits before sorting a row


def _row_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index) % (2**63)



class Sampler:
    def __init__(self, seed: int = 0, native: bool = False) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.native = native
        self._row_gen = torch.Generator()
        self._one = torch.empty(1, dtype=torch.float64)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
        """logits: [B, V]; output_index[i]: how many tokens row i has generated so far. Rows whose
        params ask for logprobs get their token as an engine.logprobs.SampledToken."""
        tokens = self._sample_tokens(logits, params, output_index)
        return attach_logprobs(logits, tokens, params) if any(p.logprobs is not None for p in params) else tokens

    def _sample_tokens(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
        if self.native and logits.device.type == "cpu" and logits.dtype in cpu_kernels.DTYPE_CODES:
            return self._native(logits, params, output_index)
        logits = logits.float().cpu()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return logits.argmax(dim=-1).tolist()
        u = self._draw([params[i] for i in rows], [output_index[i] for i in rows])
        if len(rows) == len(params):
            return self._sample(logits, params, u).tolist()
        tokens = logits.argmax(dim=-1)
        tokens[rows] = self._sample(logits[rows], [params[i] for i in rows], u)
        return tokens.tolist()

    def _native(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
        vocab = logits.shape[-1]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        u = torch.zeros(len(params), dtype=torch.float64)
        if rows:   # drawn in row order, as the torch path draws them
            u[rows] = self._draw([params[i] for i in rows], [output_index[i] for i in rows])
        filtered = [i for i in rows if 0 < params[i].top_k < vocab or params[i].top_p < 1.0]
        temps = [0.0 if p.greedy or i in filtered else float(p.temperature) for i, p in enumerate(params)] \
            if filtered else [float(p.temperature) for p in params]
        tokens = cpu_kernels.sample(logits, torch.tensor(temps, dtype=torch.float32), u)
        if filtered:
            tokens[filtered] = self._sample(logits[filtered].float(), [params[i] for i in filtered], u[filtered])
        return tokens.tolist()

    def _draw(self, params: list[SamplingParams], output_index: list[int]) -> torch.Tensor:
        """U ~ Uniform[0, 1) per row (float64): the row's own generator when it has a seed (one
        generator object reseeded per row: the same stream as a fresh one, without the construction)."""
        one, values = self._one, []
        for i, p in enumerate(params):
            if p.seed is None:
                one.uniform_(generator=self.generator)
            else:
                self._row_gen.manual_seed(_row_seed(p.seed, output_index[i]))
                one.uniform_(generator=self._row_gen)
            values.append(one.item())
        return torch.tensor(values, dtype=torch.float64)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        probs = (logits / temps).softmax(dim=-1)
        filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if filtered:
            probs[filtered] = self._filter(logits[filtered] / temps[filtered], [params[i] for i in filtered])
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        # The first token whose cumulative mass exceeds u * total: it always has nonzero probability.
        tokens = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
        return tokens.clamp_(max=vocab - 1)

    @staticmethod
    def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Top-k, then top-p over the renormalized rest; returns probabilities in token-id order
        (zero outside; not renormalized after top-p: the CDF's total does that). Row by row, by
        partial selection rather than a sort of the vocabulary:
        * top-k: the k largest logits (topk), softmax over them;
        * top-p alone: the TOP_P_CANDIDATES largest, their probabilities against the whole row's
          log-sum-exp; when they hold more than top_p every other token is outside, else the
          whole row is sorted.
        A row's result depends on its own logits and parameters only."""
        vocab = scaled.shape[-1]
        out = torch.zeros(scaled.shape, dtype=torch.float32, device=scaled.device)
        for i, p in enumerate(params):
            row = scaled[i].float()
            if 0 < p.top_k < vocab:
                values, ids = row.topk(p.top_k)
                probs = values.softmax(dim=-1)
            else:
                values, ids = row.topk(min(TOP_P_CANDIDATES, vocab))
                probs = (values - row.logsumexp(dim=-1)).exp()
                if ids.numel() < vocab and probs.sum() <= p.top_p:   # the tail may still be inside
                    values, ids = row.sort(descending=True)
                    probs = values.softmax(dim=-1)
            if p.top_p < 1.0:
                probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) > p.top_p, 0.0)   # mass before covers top_p
            out[i].scatter_(0, ids, probs)
        return out.to(scaled.dtype)
