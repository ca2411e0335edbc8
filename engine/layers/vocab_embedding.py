"""Vocabulary-parallel embedding: each rank holds a slice of the rows (padded to a multiple of
the rank count); a token outside the slice looks up zeros, and an all-reduce adds the one rank's
row to the others' zeros (exact)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.linear import TensorSource
from pdserve.engine.parallel import TPGroup, padded_split


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        start, end, per = padded_split(vocab_size, group.rank, group.size)
        self.vocab_range, self.group = (start, end), group
        self.weight = nn.Parameter(torch.zeros(per, hidden_size), requires_grad=False)

    def load(self, name: str, tensor: TensorSource, shard_id: int | None) -> None:
        start, end = self.vocab_range
        self.weight.data[:end - start].copy_(tensor[start:end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, end = self.vocab_range
        outside = (input_ids < start) | (input_ids >= end)
        local = (input_ids - start).masked_fill_(outside, 0)
        x = F.embedding(local, self.weight).masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(x)
