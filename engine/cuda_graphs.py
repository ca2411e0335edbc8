"""CUDA graphs for decode steps: one captured graph per padded batch size.

Decode-only batches have static shapes once the batch is padded to a captured size and
block tables are padded to max_model_len. Padding rows write their K/V into the spare
block past the pool and attend to one token, so they never touch real sequences.
Only built on CUDA devices; importing this module is free on CPU.
"""
from __future__ import annotations

import bisect
from typing import Protocol

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.attention import AttentionMetadata
from pdserve.engine.model_config import ModelConfig


class GraphedRunner(Protocol):
    """What the graphs need from the model runner that replays them."""

    device: torch.device
    block_size: int
    num_kv_blocks: int
    compute_dtype: torch.dtype
    model_config: ModelConfig
    config: EngineConfig
    model: torch.nn.Module


class DecodeGraphs:
    def __init__(self, runner: GraphedRunner, max_batch: int) -> None:
        self.runner = runner
        dev, bs = runner.device, runner.block_size
        max_len = runner.config.max_model_len or runner.model_config.max_position_embeddings
        self.max_blocks = -(-max_len // bs)
        self.sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s <= max_batch]
        if max_batch not in self.sizes:
            self.sizes.append(max_batch)
        top = self.sizes[-1]
        self.spare_block = runner.num_kv_blocks       # the block past the pool
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((top,), self.spare_block * bs, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((top, self.max_blocks), self.spare_block, dtype=torch.int64, device=dev)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.key_index = torch.arange(self.max_blocks * bs, device=dev)
        self.hidden = torch.zeros(top, runner.model_config.hidden_size, dtype=runner.compute_dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        ctx = self.context_lens[:b]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], num_decode=b,
            decode_block_tables=self.block_tables[:b], decode_context_lens=ctx,
            decode_mask=(self.key_index[None, :] < ctx[:, None])[:, None, None, :])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model = self.runner.model
        for b in reversed(self.sizes):
            # The mask is built inside the graph so replays recompute it from context_lens.
            self.hidden[:b] = model(self.input_ids[:b], self.positions[:b], self._meta(b))   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:b] = model(self.input_ids[:b], self.positions[:b], self._meta(b))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
            torch.cuda.synchronize()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.runner.block_size
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:b] = self.spare_block * bs
        self.slot_mapping[:n] = meta.slot_mapping
        self.block_tables[:b] = self.spare_block
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:n, :width] = meta.decode_block_tables
        self.context_lens[:b] = 1
        self.context_lens[:n] = meta.decode_context_lens
        self.graphs[b].replay()
        return self.hidden[:n]
