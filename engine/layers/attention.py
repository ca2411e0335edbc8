"""Attention over the paged KV cache.

The cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim] for K and for V.
A step's tokens are laid out decodes first (one token each), then prefill segments. New K/V
are written to their slots first, then every query attends to its sequence's cached context.

Implementations: flash-attn on CUDA when it is installed; torch scaled_dot_product_attention
everywhere else (decode rows on CPU over gathered blocks in length groups). The native CPU
backend (engine/layers/backend.py) calls the kernels of engine/layers/cpu_kernels.py instead,
which read the cache blocks in place. All read the same cache layout. Attention runs in the
compute dtype for prefill (over K/V rounded to the cache dtype) and in the cache dtype for the
SDPA decode path; the native kernels compute in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional CUDA kernels; absent on CPU machines
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # type: ignore
    HAS_FLASH_ATTN = True
except Exception:  # ImportError, or a broken CUDA install
    HAS_FLASH_ATTN = False


@dataclass(slots=True)
class PrefillSegment:
    token_start: int                   # first row of this segment in the step's tokens
    token_end: int
    context_len: int                   # tokens of this sequence with KV after the step
    block_table: torch.Tensor          # [num_blocks_of_seq] int64
    mask_dtype: torch.dtype = torch.float32
    _mask: torch.Tensor | None = None

    @property
    def cached_len(self) -> int:
        """Tokens of the sequence already in the cache before this segment."""
        return self.context_len - (self.token_end - self.token_start)

    def causal_mask(self) -> torch.Tensor | None:
        """Additive [n, context_len] mask (0 / -inf) of a segment after a cached prefix; None when
        the segment starts the sequence (causal from position 0). Built on first use and kept for
        the step's other layers: only the sdpa path reads it."""
        start = self.cached_len
        if start == 0:
            return None
        if self._mask is None:
            dev = self.block_table.device
            future = (torch.arange(self.context_len, device=dev)[None, :]
                      > torch.arange(start, self.context_len, device=dev)[:, None])
            self._mask = torch.zeros(future.shape, dtype=self.mask_dtype, device=dev).masked_fill_(future, float("-inf"))
        return self._mask


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) of the step, gathered and attended together (CPU path). Rows are
    grouped by context length so each group pads its keys only to its own longest context."""
    start: int
    end: int
    block_ids: torch.Tensor            # [(end - start) * num_blocks] int64: the rows' block tables, padded
    mask: torch.Tensor                 # [end - start, 1, 1, num_blocks * block_size] additive float (0 / -inf)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                      # [num_tokens] int64: block_id * block_size + offset
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None # [num_decode, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None = None # [num_decode] int32
    decode_mask: torch.Tensor | None = None         # [num_decode, 1, 1, max_blocks * block_size]: bool (True:
                                                    # attend) or float (additive: 0 / -inf) in the cache dtype
    # CPU: decode rows in length groups (used instead of decode_block_tables / decode_mask when set), and
    # reusable [rows, block_size * num_kv_heads * head_dim] buffers each layer's decode gather writes
    # into (the same for every layer and group of a step); None: allocate per gather.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode_kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # CPU: decode attention by the native backend (engine/layers/backend.py) straight from the
    # cache blocks, with decode_block_tables / decode_context_lens; no gather, no mask.
    decode_native: bool = False
    # CPU, batch-invariant mode: every row's (block table, context length), built on first use
    # (engine/layers/backend.py _row_tables).
    row_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)
    # flash-attn varlen inputs for the prefill part (CUDA only)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    prefill_block_tables: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Stores k, v in the cache; returns [T, H, D]."""
        self.store(k, v, meta.slot_mapping)
        return self.attend(q, k, v, meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache, where k, v of this step are already stored."""
        if HAS_FLASH_ATTN and q.is_cuda and self.k_cache.shape[1] % 256 == 0:
            return self._flash(q, meta)   # flash-attn's paged kernels need block_size % 256 == 0
        out = torch.empty_like(q)
        if meta.num_decode:
            out[:meta.num_decode] = self._decode_sdpa(q[:meta.num_decode], meta)
        for seg in meta.prefills:
            out[seg.token_start:seg.token_end] = self.prefill_sdpa(q, k, v, seg)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        dtype = self.k_cache.dtype
        self.k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(dtype))
        self.v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(dtype))

    def _gather(self, cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Whole blocks of the cache, in ids order: [len(ids), block_size * num_kv_heads * head_dim]."""
        flat = cache.view(cache.shape[0], -1)
        if out is None:
            return flat.index_select(0, ids)
        return torch.index_select(flat, 0, ids, out=out[:ids.numel()])

    def _decode_sdpa(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kbuf, vbuf = meta.decode_kv_buffers or (None, None)
        if not meta.decode_groups:
            return self._decode_rows(q, meta.decode_block_tables.reshape(-1), meta.decode_mask, kbuf, vbuf)
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            out[g.start:g.end] = self._decode_rows(q[g.start:g.end], g.block_ids, g.mask, kbuf, vbuf)
        return out

    def _decode_rows(self, q: torch.Tensor, block_ids: torch.Tensor, mask: torch.Tensor,
                     kbuf: torch.Tensor | None, vbuf: torch.Tensor | None) -> torch.Tensor:
        """One query token per row against its row's blocks (block_ids: the rows' padded tables, flat).
        Runs in the cache dtype: memory-bound, so converting the gathered K/V would cost more than it saves."""
        b = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        keys = self._gather(self.k_cache, block_ids, kbuf).view(b, -1, hkv, d).transpose(1, 2)
        values = self._gather(self.v_cache, block_ids, vbuf).view(b, -1, hkv, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.to(keys.dtype).unsqueeze(2), keys, values, attn_mask=mask,
                                             scale=self.scale, enable_gqa=hkv != self.num_heads)
        return out.squeeze(2)

    def prefill_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment) -> torch.Tensor:
        """Runs in q's (compute) dtype over K/V as the cache holds them (rounded to its dtype), so
        a prefix-cache hit and a recompute see the same keys."""
        hkv, d = self.num_kv_heads, self.head_dim
        dtype, cache_dtype = q.dtype, self.k_cache.dtype
        qs = q[seg.token_start:seg.token_end].transpose(0, 1).unsqueeze(0)
        mask = seg.causal_mask()
        if mask is None:   # no cached prefix: attend within the segment's own K/V
            keys = k[seg.token_start:seg.token_end]
            values = v[seg.token_start:seg.token_end]
            if cache_dtype != dtype:
                keys, values = keys.to(cache_dtype).to(dtype), values.to(cache_dtype).to(dtype)
        else:
            keys = self._gather(self.k_cache, seg.block_table, None).view(-1, hkv, d)[:seg.context_len].to(dtype)
            values = self._gather(self.v_cache, seg.block_table, None).view(-1, hkv, d)[:seg.context_len].to(dtype)
        out = F.scaled_dot_product_attention(
            qs, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=hkv != self.num_heads)
        return out.squeeze(0).transpose(0, 1)

    def _flash(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.contiguous()   # q may be a view into the fused q/k tensor
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = flash_attn_with_kvcache(
                q[:nd].unsqueeze(1), self.k_cache, self.v_cache,
                cache_seqlens=meta.decode_context_lens, block_table=meta.decode_block_tables.to(torch.int32),
                softmax_scale=self.scale, causal=True).squeeze(1)
        if meta.prefills:
            out[nd:] = flash_attn_varlen_func(
                q[nd:], self.k_cache, self.v_cache,
                cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                softmax_scale=self.scale, causal=True, block_table=meta.prefill_block_tables)
        return out
