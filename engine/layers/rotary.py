"""Rotary position embedding with the rope types Llama and Qwen checkpoints use."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, rope_type: str, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, rope_type: str = "default",
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, rope_type, scaling or {})
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], positions: [T]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> x * cos + rotate_half(x) * sin, at each row's position.

        rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated), exactly (a sign
        flip is exact), which saves a negation and a concatenation. The per-position tables are
        looked up once per positions tensor (one step), not once per layer."""
        step = self._step
        if step is None or step[0] is not positions or step[1] != x.dtype:
            half = x.shape[-1] // 2
            cos = self.cos[positions].to(x.dtype).unsqueeze(1)
            sin = self.sin[positions].to(x.dtype).unsqueeze(1)
            sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            step = self._step = (positions, x.dtype, cos, sin)
        cos, sin = step[2], step[3]
        return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(sin))

