"""Linear layers: packed projections loaded shard by shard, and W8A16 weight-only int8."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). With shard_sizes, several checkpoint tensors pack into one weight
    (q/k/v or gate/up), so one matmul replaces several."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False) -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        out = sum(self.shard_sizes)
        self.in_features, self.out_features = in_features, out
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.qweight: torch.Tensor | None = None   # int8 [out, in] after quantize_w8a16()
        self.scale: torch.Tensor | None = None     # [out], one scale per output channel

    def _shard_slice(self, shard_id: int | None) -> slice:
        if shard_id is None:
            return slice(0, self.out_features)
        start = sum(self.shard_sizes[:shard_id])
        return slice(start, start + self.shard_sizes[shard_id])

    def load(self, name: str, tensor: torch.Tensor, shard_id: int | None) -> None:
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a bias the model does not expect: {name}")
        dst = target.data[self._shard_slice(shard_id)]
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
        dst.copy_(tensor)

    def quantize_w8a16(self) -> None:
        """Replace the weight by int8 values and a per-output-channel scale (symmetric)."""
        w = self.weight.data.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(self.weight.dtype)
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias
