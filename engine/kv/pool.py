"""The narrow view of a worker's paged KV pool that the KV connector works through.

The connector reserves, receives, exports and frees hand-off blocks; it never touches the block
manager or the model runner itself, only this: allocate a received sequence's blocks, free a
sequence's blocks, read and write block bytes, the pool's block layout, and the chain hashes a
transfer checks blocks against.
"""
from __future__ import annotations

from typing import Protocol

import torch

from pdserve.engine.kv.block_manager import BlockManager, salt_root, transfer_block_hashes
from pdserve.engine.sequence import Sequence


class BlockStorage(Protocol):
    """Where the blocks' bytes live (the model runner's KV cache tensors): their layout, and
    reads and writes by block id."""

    block_shape: torch.Size
    dtype: torch.dtype
    kv_dtype_name: str
    kv_bytes_per_block: int

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...
    def read_block_pieces(self, block_ids: list[int]) -> list[tuple[int, int, torch.Tensor]]: ...
    def block_views(self, block_ids: list[int]) -> list[torch.Tensor] | None: ...
    def block_slabs(self, block_ids: list[int]) -> list[memoryview] | None: ...
    def write_block(self, block_id: int, data: torch.Tensor, head_start: int = 0) -> None: ...
    def write_blocks(self, block_ids: list[int], data: torch.Tensor, head_start: int = 0) -> None: ...


class KVBlockPool:
    def __init__(self, block_manager: BlockManager, runner: BlockStorage) -> None:
        self._blocks = block_manager
        self._runner = runner
        self.block_size = block_manager.block_size

    # ---- blocks ----------------------------------------------------------------------------
    def allocate_for_receive(self, seq: Sequence, reserve_blocks: int = 0) -> int:
        """Blocks for the whole sequence, the leading ones this pool holds computed shared.
        Returns the tokens those shared blocks cover; raises NoFreeBlocks (keeping reserve_blocks free)."""
        return self._blocks.allocate(seq, max_cached_tokens=seq.num_tokens, receiving=True,
                                     reserve_blocks=reserve_blocks)

    def free(self, seq: Sequence) -> None:
        """Give the sequence's blocks back (computed ones stay in the prefix cache). A sequence in
        a running forward pass keeps them; the engine frees them when that pass ends."""
        if not seq.in_flight:
            self._blocks.free(seq)

    def transfer_hashes(self, seq: Sequence) -> list[int]:
        """The chain hash of every block of the sequence, the partial last one included."""
        return transfer_block_hashes(seq.token_ids, self.block_size, salt_root(seq.params.cache_salt))

    # ---- bytes -----------------------------------------------------------------------------
    def read(self, block_ids: list[int]) -> torch.Tensor:
        return self._runner.read_blocks(block_ids)

    def read_pieces(self, block_ids: list[int]) -> list[tuple[int, int, torch.Tensor]]:
        return self._runner.read_block_pieces(block_ids)

    def views(self, block_ids: list[int]) -> list[torch.Tensor] | None:
        return self._runner.block_views(block_ids)

    def slabs(self, block_ids: list[int]) -> list[memoryview] | None:
        """The blocks' bytes as writable views, in the wire's order (ModelRunner.block_slabs); None
        where the pool cannot hand them out."""
        return self._runner.block_slabs(block_ids)

    def write(self, block_id: int, data: torch.Tensor, head_start: int = 0) -> None:
        self._runner.write_block(block_id, data, head_start=head_start)

    def write_many(self, block_ids: list[int], data: torch.Tensor, head_start: int = 0) -> None:
        """data: [len(block_ids), L, 2, bs, heads, D], the blocks' heads from head_start."""
        self._runner.write_blocks(block_ids, data, head_start=head_start)

    # ---- layout ----------------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """(layers, 2, block_size, kv_heads, head_dim) of one whole block."""
        return tuple(self._runner.block_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._runner.dtype

    @property
    def dtype_name(self) -> str:
        return self._runner.kv_dtype_name

    @property
    def bytes_per_block(self) -> int:
        return self._runner.kv_bytes_per_block
