"""vLLM V1's logits processing, in place on the float32 logits before sampling.

What each step does to row i (params[i]; prompt_ids[i]; output_ids[i], the tokens generated
before this row, any speculative-draft prefix included), in vLLM V1's order
(vllm/v1/sample/sampler.py, Sampler.apply_logits_processors, whose class docstring lists it;
the two built-in non-argmax-invariant processors run in BUILTIN_LOGITS_PROCESSORS' order,
vllm/v1/sample/logits_processor/__init__.py):

1. bad words (vllm/v1/sample/ops/bad_words.py): for each word w, when len(w) == 1 or the
   output ends with w[:-1], the logit of w[-1] becomes -inf.
2. min tokens (MinTokensLogitsProcessor, logits_processor/builtin.py): while
   len(output_ids[i]) < min_tokens, the logits of ``stop_ids`` (the engine's EOS ids) and of
   params.stop_token_ids become -inf.
3. logit bias (LogitBiasLogitsProcessor): bias added to its token's logit (one float32 add).
4. penalties (vllm/model_executor/layers/utils.py, apply_penalties), in this order:
   a. repetition, over the tokens of the prompt and of the output: a logit > 0 is divided by
      the penalty, any other multiplied by it (vLLM's CUDA kernel, csrc/sampler.cu; its torch
      fallback multiplies by 1/penalty, which can differ in the last bit);
   b. frequency: logit -= frequency_penalty * (the token's count in the output);
   c. presence: logit -= presence_penalty * (1 if the token is in the output else 0).

Temperature, min-p, top-k and top-p come after, in the sampler (layers/sampler.py).

Bad-word and stop tokens >= V can never be sampled and are skipped; a logit_bias id >= V is a
ValueError. Penalties touch only the tokens in the prompt or output (for any other token every
step is a no-op), so their cost is O(B x tokens), vocabulary-sized work none; rows whose params
do not process logits are left bit-identical.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from pdserve.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[Sequence[int]],
                            output_ids: list[Sequence[int]], stop_ids: Collection[int]) -> None:
    """Apply bad words, min tokens, logit bias and the penalties (module docstring) to ``logits``
    (float32 CPU, [B, V], row i for params[i]) in place."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return
    vocab = logits.shape[-1]
    bias = _logit_bias(rows, params, vocab)   # checked before anything is written
    _mask_tokens(logits, rows, params, output_ids, stop_ids, vocab)
    if bias is not None:   # a row's ids are distinct (dict keys): one float32 add per entry
        logits[bias[0], bias[1]] += bias[2]
    penalized = [i for i in rows if _has_penalties(params[i]) and (len(prompt_ids[i]) or len(output_ids[i]))]
    if penalized:
        _apply_penalties(logits, penalized, params, prompt_ids, output_ids, vocab)


def _has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _mask_tokens(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                 output_ids: list[Sequence[int]], stop_ids: Collection[int], vocab: int) -> None:
    """Steps 1 and 2: the bad words' last tokens and, before min_tokens, the stop tokens -> -inf.
    Both only write -inf, so one indexed write does them together (vLLM's order is kept)."""
    at_rows: list[int] = []
    at_ids: list[int] = []
    for i in rows:
        p, out = params[i], output_ids[i]
        for word in p.bad_words_token_ids or ():
            n = len(word) - 1
            if word[-1] < vocab and n <= len(out) and (n == 0 or list(out[len(out) - n:]) == word[:-1]):
                at_rows.append(i)
                at_ids.append(word[-1])
        if len(out) < p.min_tokens:
            for tok in {*stop_ids, *p.stop_token_ids}:
                if tok < vocab:
                    at_rows.append(i)
                    at_ids.append(tok)
    if at_rows:
        logits[at_rows, at_ids] = _NEG_INF


def _logit_bias(rows: list[int], params: list[SamplingParams],
                vocab: int) -> tuple[list[int], list[int], torch.Tensor] | None:
    """(rows, token ids, biases) of every logit_bias entry; ValueError for an id outside the vocabulary."""
    at_rows: list[int] = []
    at_ids: list[int] = []
    biases: list[float] = []
    for i in rows:
        bias = params[i].logit_bias
        if bias:
            outside = [tok for tok in bias if tok >= vocab]
            if outside:
                raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary (size {vocab})")
            at_rows.extend([i] * len(bias))
            at_ids.extend(bias)
            biases.extend(bias.values())
    return (at_rows, at_ids, torch.tensor(biases, dtype=torch.float32)) if at_rows else None


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     prompt_ids: list[Sequence[int]], output_ids: list[Sequence[int]], vocab: int) -> None:
    """Step 4 on the rows' prompt and output tokens only (every row here has at least one).

    seen [n, width]: row r's prompt then output tokens, padded by repeating its last token (a
    duplicate position, so the write back stores the same value twice). The output counts come
    from one scatter_add of seen into a [n, V] table, weighted 1 at output positions and 0 at
    prompt and pad positions (so no pad column is needed), gathered back at seen. The logits
    are read and written by one gather and one scatter on their flat view."""
    parts = [_ids(seq) for i in rows for seq in (prompt_ids[i], output_ids[i])]
    prompt_lens = torch.tensor([len(a) for a in parts[0::2]], dtype=torch.int64).unsqueeze(1)
    lens = prompt_lens + torch.tensor([len(a) for a in parts[1::2]], dtype=torch.int64).unsqueeze(1)
    n, width = len(rows), int(lens.max())
    col = torch.arange(width, dtype=torch.int64).unsqueeze(0)
    ids = torch.from_numpy(np.concatenate(parts))
    at_ids = lens.cumsum(0) - lens + torch.minimum(col, lens - 1)
    seen = ids.index_select(0, at_ids.view(-1)).view(n, width)   # (take / [] would go multi-threaded)
    in_output = (col >= prompt_lens) & (col < lens)
    # Only the seen positions of the count table are zeroed, counted and read: filling all of
    # [n, V] would cost more than the rest together (and be torch's one multi-threaded op here).
    counts = torch.empty(n, vocab, dtype=torch.int32).scatter_(1, seen, 0)
    counts.scatter_add_(1, seen, in_output.to(torch.int32))
    count = counts.gather(1, seen).float()   # each seen token's count in the output

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], dtype=torch.float32).unsqueeze(1)

    # a flat gather / scatter: far faster than 2-D advanced indexing
    work = logits if logits.is_contiguous() else logits.contiguous()
    flat = work.view(-1)
    at = (torch.tensor(rows, dtype=torch.int64).unsqueeze(1) * vocab + seen).view(-1)
    x = flat.gather(0, at).view(n, width)
    if any(params[i].repetition_penalty != 1.0 for i in rows):
        rep = column("repetition_penalty")
        x = torch.where(x > 0, x / rep, x * rep)
    if any(params[i].frequency_penalty != 0.0 for i in rows):
        x -= column("frequency_penalty") * count
    if any(params[i].presence_penalty != 0.0 for i in rows):
        x -= column("presence_penalty") * (count > 0)
    flat.scatter_(0, at, x.view(-1))
    if work is not logits:
        logits.copy_(work)


def _ids(seq: Sequence[int]) -> np.ndarray:
    """Token ids as int64 (an int64 numpy array, e.g. a caller's cached prompt, is used as it is)."""
    if isinstance(seq, np.ndarray) and seq.dtype == np.int64:
        return seq
    return np.fromiter(seq, dtype=np.int64, count=len(seq))
