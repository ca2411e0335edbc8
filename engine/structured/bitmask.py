"""Token bitmasks in xgrammar's layout (int32 words; bit b of word w allows token 32*w + b), made
here and applied to a step's constrained rows at once: each byte of the mask indexes a 256 x 8
table of 0 / -inf, added to the logits (-0.0 leaves a logit as it is, bit for bit). Measured on
CPU against xgrammar's apply_token_bitmask_inplace, a torch shift-and-mask unpack and numpy's
unpackbits: bench/bitmask_apply.py, docs/benchmarks.md."""
from __future__ import annotations

import torch

_BITS = torch.arange(8, dtype=torch.uint8)
_ALLOWED = ((torch.arange(256, dtype=torch.uint8).unsqueeze(-1) >> _BITS) & 1).bool()   # [256, 8]
_PENALTY = {}   # dtype -> [256, 8]: -0.0 where allowed, -inf where not


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """Every token allowed (all bits set) in every row."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _bytes(bitmask: torch.Tensor) -> torch.Tensor:
    """The mask's bytes as a flat index (index_select: advanced indexing measured ~3x slower)."""
    return bitmask.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    return _ALLOWED.index_select(0, _bytes(bitmask)).view(bitmask.shape[0], -1)[:, :vocab_size]


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [rows, V] in place: -inf where bitmask (one row each) forbids the token, the rest
    unchanged (a finite logit plus -0.0 is itself)."""
    table = _PENALTY.get(logits.dtype)
    if table is None:
        table = _PENALTY[logits.dtype] = torch.where(_ALLOWED, -0.0, float("-inf")).to(logits.dtype)
    vocab = logits.shape[-1]
    logits.add_(table.index_select(0, _bytes(bitmask)).view(bitmask.shape[0], -1)[:, :vocab])
