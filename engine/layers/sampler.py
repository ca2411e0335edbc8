"""Token sampling: greedy, temperature, min-p, top-k, top-p, reproducible per-request seeds.

Sampling inverts the CDF: with the probabilities in token-id order, the token is the first
whose cumulative probability (float64) exceeds U * total, U ~ Uniform[0, 1); one draw per row.
A seeded request draws U from a generator keyed by (seed, output index), so its tokens do not
depend on what else shares the batch, or on preemption and recompute.

With ``native=True`` (the native CPU backend) greedy and plain-temperature rows are sampled by
the C++ kernel (``cpu_kernels.sample``): the same rule over the same U draws, on the bf16 or
float32 logits as they are, without the float copy, the full softmax tensor and the float64
cumsum; rows with min-p / top-k / top-p keep the torch path below.

Filters follow vLLM V1's order (vllm/v1/sample/sampler.py, Sampler.sample): temperature, then
min-p (an argmax-invariant logits processor: tokens whose probability is below min_p x the
largest become impossible), then top-k, then top-p over what is left. Greedy rows ignore them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.layers import cpu_kernels
from pdserve.engine.layers.logits_processors import apply_logits_processors
from pdserve.engine.structured import bitmask
from pdserve.engine.logprobs import attach_logprobs
from pdserve.engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
TOP_P_CANDIDATES = 1024   # top-p without top-k looks at this many of the largest logits before sorting a row


def _row_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index) % (2**63)


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether a (non-greedy) row takes the torch filter path."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0



@dataclass(slots=True)
class LogitsContext:
    """The rows' history and constraints, for a step where some row processes its logits
    (engine/logits_context.py builds it): prompt_ids[i] / output_ids[i] for row i (empty for a
    row that does not need them); bitmask[k]: the grammar's allowed tokens for row mask_rows[k]."""

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    stop_token_ids: frozenset[int]
    bitmask: torch.Tensor | None = None
    mask_rows: list[int] | None = None


class Sampler:
    def __init__(self, seed: int = 0, native: bool = False) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.native = native
        self._row_gen = torch.Generator()
        self._one = torch.empty(1, dtype=torch.float64)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
                 context: LogitsContext | None = None) -> list[int]:
        """logits: [B, V]; output_index[i]: how many tokens row i has generated so far; context:
        penalties, biases and grammars to apply first (None: none). Rows whose params ask for
        logprobs get their token as an engine.logprobs.SampledToken, its logprobs those of the
        raw logits (vLLM's default, raw_logprobs)."""
        processed = logits if context is None else self._process(logits, params, context)
        tokens = self._sample_tokens(processed, params, output_index)
        return attach_logprobs(logits, tokens, params) if any(p.logprobs is not None for p in params) else tokens

    @staticmethod
    def _process(logits: torch.Tensor, params: list[SamplingParams], context: LogitsContext) -> torch.Tensor:
        """A copy with the logits processors applied (float32, when a row has any), then the
        grammar's bitmask. A constrained row left with nothing allowed (min_tokens or bad_words
        against a grammar that allows only those tokens) is sampled under its grammar alone."""
        processed = [p.processes_logits for p in params]
        if any(processed):
            out = logits.float()
            if out.data_ptr() == logits.data_ptr():
                out = out.clone()
            apply_logits_processors(out, params, context.prompt_ids, context.output_ids, context.stop_token_ids)
        else:
            out = logits.clone()
        if context.bitmask is None:
            return out
        rows = context.mask_rows
        if len(rows) == out.shape[0]:   # every row constrained (rows are 0..B-1 in order)
            bitmask.apply(out, context.bitmask)
        else:
            index = torch.tensor(rows, dtype=torch.long)
            part = out[index]
            bitmask.apply(part, context.bitmask)
            out[index] = part
        for k, r in enumerate(rows):
            if processed[r] and bool(torch.isneginf(out[r]).all()):
                alone = logits[r:r + 1].to(out.dtype)
                bitmask.apply(alone, context.bitmask[k:k + 1])
                out[r] = alone[0]
        return out

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
        filtered = [i for i in rows if _filters(params[i], vocab)]
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
        filtered = [i for i, p in enumerate(params) if _filters(p, vocab)]
        if filtered:
            probs[filtered] = self._filter(logits[filtered] / temps[filtered], [params[i] for i in filtered])
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        # The first token whose cumulative mass exceeds u * total: it always has nonzero probability.
        tokens = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
        return tokens.clamp_(max=vocab - 1)

    @staticmethod
    def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Min-p, then top-k, then top-p over the renormalized rest; returns probabilities in
        token-id order (zero outside; not renormalized after min-p alone or top-p: the CDF's total
        does that). Row by row, by partial selection rather than a sort of the vocabulary:
        * min-p (vLLM's MinPLogitsProcessor): softmax of the row; tokens whose probability is
          below min_p x the largest (float32) are left out (-inf before top-k / top-p);
        * top-k: the k largest logits (topk), softmax over them;
        * top-p alone: the TOP_P_CANDIDATES largest, their probabilities against the whole row's
          log-sum-exp; when they hold more than top_p every other token is outside, else the
          whole row is sorted.
        A row's result depends on its own logits and parameters only."""
        vocab = scaled.shape[-1]
        out = torch.zeros(scaled.shape, dtype=torch.float32, device=scaled.device)
        for i, p in enumerate(params):
            row = scaled[i].float()
            if p.min_p > 0.0:
                probs = row.softmax(dim=-1)
                out_of_min_p = probs < probs.max() * torch.tensor(p.min_p, dtype=torch.float32)
                if not (0 < p.top_k < vocab or p.top_p < 1.0):
                    out[i] = probs.masked_fill_(out_of_min_p, 0.0)
                    continue
                row = row.masked_fill(out_of_min_p, float("-inf"))
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
