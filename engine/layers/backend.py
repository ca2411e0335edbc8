"""The ops a decoder layer runs besides its GEMMs, one implementation per backend.

``TorchBackend`` is the reference: plain torch ops, on any device (CUDA included, where
flash-attn serves attention when installed). ``NativeCpuBackend`` runs the same ops through the
fused kernels of ``engine.layers.cpu_kernels`` with the same rounding points, so results match
the torch path up to float32 summation order. ``select_backend`` picks one once, at model load;
the modules only ever call ``self.backend.<op>``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.layers import cpu_kernels
from engine.layers.attention import AttentionMetadata, DecodeGroup
from engine.layers.norm import rms_norm

if TYPE_CHECKING:
    from engine.layers.attention import Attention
    from engine.models.llama import SelfAttention

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x (in place where possible), and its RMS norm."""
        residual = residual.add_(x)
        return rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gate_up.split([inter, inter], dim=-1)
        return F.silu(gate).mul_(up)

    def qkv_rope_store(self, layer: "SelfAttention", qkv: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k norms and rotary on the fused qkv rows, K/V stored to the cache; returns q, k, v."""
        nq, nkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        # q and k heads side by side ([T, nq + nkv, d]), so norm and rotary run once for both.
        qk = qkv[:, :layer.q_size + layer.kv_size].view(-1, nq + nkv, d)
        v = qkv[:, layer.q_size + layer.kv_size:].view(-1, nkv, d)
        if layer.q_norm is not None:
            weight = torch.cat([layer.q_norm.weight.expand(nq, d), layer.k_norm.weight.expand(nkv, d)])
            qk = rms_norm(qk, weight, layer.q_norm.eps)
        qk = layer.rotary.rotate(positions, qk)
        q, k, v = qk[:, :nq], qk[:, nq:], v.contiguous()
        layer.attn.store(k, v, meta.slot_mapping)
        return q, k, v

    def attention(self, attn: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (already in the cache). Returns [T, H, D]."""
        return attn.attend(q, k, v, meta)

    def prepare_decode(self, runner, decode_seqs: list, lens: list[int], meta: AttentionMetadata) -> None:
        """Decode-row attention metadata (rows sorted by context length)."""
        bs, dev = runner.block_size, runner.device
        nd = len(decode_seqs)
        if dev.type == "cpu":
            # Up to 4 groups of >= 8 rows (rows are sorted by length): each gathers and attends over
            # its own longest context only, instead of every row padding to the batch's longest.
            n_groups = max(1, min(4, nd // 8))
            bounds = [nd * g // n_groups for g in range(n_groups + 1)]
            rows = 0
            for a, b in zip(bounds, bounds[1:]):
                width = -(-lens[b - 1] // bs)
                flat: list[int] = []
                for s in decode_seqs[a:b]:
                    table = s.block_table[:width]
                    flat.extend(table)
                    if len(table) < width:
                        flat.extend([0] * (width - len(table)))
                past_end = torch.arange(width * bs)[None, :] >= torch.tensor(lens[a:b])[:, None]
                mask = torch.zeros(past_end.shape, dtype=runner.dtype).masked_fill_(past_end, float("-inf"))
                meta.decode_groups.append(DecodeGroup(a, b, torch.tensor(flat, dtype=torch.int64), mask[:, None, None, :]))
                rows = max(rows, len(flat))
            meta.decode_kv_buffers = runner.decode_buffers(rows)
            return
        max_blocks = max(len(s.block_table) for s in decode_seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in decode_seqs]
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)
        meta.decode_context_lens = ctx
        meta.decode_mask = (torch.arange(max_blocks * bs, device=dev)[None, :] < ctx[:, None])[:, None, None, :]


class NativeCpuBackend(TorchBackend):
    """The fused CPU kernels (float32 or bf16 activations; the KV cache float32 or bf16)."""

    name = "native-cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1 or x.dtype != weight.dtype:
            return rms_norm(x, weight, eps)
        return cpu_kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.stride(-1) != 1 or not residual.is_contiguous() or x.dtype != residual.dtype:
            return super().add_rms_norm(x, residual, weight, eps)
        return cpu_kernels.add_rms_norm(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        if not gate_up.is_contiguous():
            return super().silu_mul(gate_up, inter)
        return cpu_kernels.silu_mul(gate_up)

    def qkv_rope_store(self, layer: "SelfAttention", qkv: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rot = layer.rotary
        if not qkv.is_contiguous() or rot.cos.dtype != qkv.dtype:
            return super().qkv_rope_store(layer, qkv, positions, meta)
        nq, nkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        attn = layer.attn
        qn, kn = layer.q_norm, layer.k_norm
        cpu_kernels.qkv_rope_store(
            qkv, positions, rot.cos, rot.sin, qn.weight if qn is not None else None,
            kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0, nq, nkv, d,
            attn.k_cache, attn.v_cache, meta.slot_mapping)
        q = qkv[:, :layer.q_size].view(-1, nq, d)
        k = qkv[:, layer.q_size:layer.q_size + layer.kv_size].view(-1, nkv, d)
        v = qkv[:, layer.q_size + layer.kv_size:].view(-1, nkv, d)
        return q, k, v

    def attention(self, attn: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decode
        if nd and not meta.prefills:
            return cpu_kernels.decode_attention(q, attn.k_cache, attn.v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, attn.scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        if nd:
            out[:nd] = cpu_kernels.decode_attention(q[:nd], attn.k_cache, attn.v_cache, meta.decode_block_tables,
                                                    meta.decode_context_lens, attn.scale)
        amx = cpu_kernels.prefill_attention_supported(q.dtype, attn.k_cache, attn.head_dim)
        for seg in meta.prefills:
            if amx:   # straight from the cache blocks, cached prefix or not
                n = seg.token_end - seg.token_start
                cpu_kernels.prefill_attention(q[seg.token_start:seg.token_end], attn.k_cache, attn.v_cache,
                                              seg.block_table, seg.context_len - n, attn.scale,
                                              out[seg.token_start:seg.token_end])
            else:
                out[seg.token_start:seg.token_end] = attn.prefill_sdpa(q, k, v, seg)
        return out

    def prepare_decode(self, runner, decode_seqs: list, lens: list[int], meta: AttentionMetadata) -> None:
        bs = runner.block_size
        width = -(-lens[-1] // bs)   # rows are sorted by length
        meta.decode_native = True
        meta.decode_block_tables = torch.tensor(
            [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in decode_seqs],
            dtype=torch.int64)
        meta.decode_context_lens = torch.tensor(lens, dtype=torch.int32)


TORCH = TorchBackend()


def select_backend(device: torch.device, kv_cache: torch.Tensor, head_dim: int,
                   compute_dtype: torch.dtype) -> TorchBackend:
    """The backend for this model: the native CPU kernels where they build and cover the model's
    dtypes, else torch. Decided once, at model load."""
    if device.type != "cpu":
        return TORCH
    if compute_dtype not in cpu_kernels.DTYPE_CODES:
        return TORCH
    if not cpu_kernels.supports(kv_cache, head_dim):
        return TORCH
    return NativeCpuBackend()
