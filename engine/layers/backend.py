"""The ops a decoder layer runs besides its GEMMs, one implementation per backend.

``TorchBackend`` is the reference: plain torch ops, on any device (CUDA included, where
flash-attn serves attention when installed). ``NativeCpuBackend`` runs the same ops through the
fused kernels of ``engine.layers.cpu_kernels`` with the same rounding points, so results match
the torch path up to float32 summation order. ``select_backend`` picks one once, at model load;
the modules only ever call ``self.backend.<op>``.
"""
from __future__ import annotations

import logging
from typing import Protocol, TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.engine.layers import cpu_kernels
from pdserve.engine.layers.attention import AttentionMetadata, DecodeGroup
from pdserve.engine.layers.linear import AMX_KERNEL_MAX_ROWS
from pdserve.engine.layers.norm import rms_norm

if TYPE_CHECKING:
    from pdserve.engine.layers.attention import Attention
    from pdserve.engine.layers.rotary import RotaryEmbedding


class QKVLayer(Protocol):
    """What a backend reads of an attention layer (a model's self-attention) to split its fused
    QKV projection, normalise, rotate and store K/V."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int
    kv_size: int
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    rotary: "RotaryEmbedding"
    attn: "Attention"

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

    def qkv_rope_store(self, layer: QKVLayer, qkv: torch.Tensor, positions: torch.Tensor,
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

    def decode_model(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor | None:
        """The whole decode step's final hidden states in one fused call, or None: run layer by layer."""
        return None

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


class FusedDecode:
    """A bf16 model's decode path as one native call (cpu_kernels.decode_forward): every weight,
    norm and cache pointer gathered once; scratch reused across steps. Only for models whose
    linears all run one GEMM the call has: the AMX kernel (tuned mode's for up to
    AMX_KERNEL_MAX_ROWS rows on AMX, batch-invariant mode's for every row count there), or
    linear_bf16dot (bf16 weights without bias or scales: batch-invariant mode's GEMM without AMX,
    and tuned mode's where it is the CPU's fastest). In batch-invariant mode it is the GEMM the
    per-op path runs, beside the same per-row kernels in the same order, so a row's result is the
    same bit for bit whichever path a step takes. build() returns None otherwise."""

    PTRS = ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gu_w", "gu_b", "down_w", "down_b",
            "q_norm", "k_norm", "k_cache", "v_cache", "qkv_s", "o_s", "gu_s", "down_s")

    def __init__(self, model, layers: torch.Tensor, linear_kind: str, max_rows: int | None) -> None:
        cfg = model.config
        self.model = model
        self.layers = layers
        self.linear_kind = linear_kind
        self.max_rows = max_rows   # None: any rows (the per-op path runs the same GEMM for them all)
        self.num_layers, self.hidden, self.inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.nq, self.nkv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.rotary = model.model.layers[0].self_attn.rotary
        self.norm = model.model.norm
        self.scratch = torch.empty(0, dtype=torch.bfloat16)

    @staticmethod
    def _weight(lin, linear_kind: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The packed weight and per-column scale the fused call reads for this linear, or None."""
        if linear_kind == "amx" and lin.invariant_kernel == "amx":
            return lin.packed_invariant, lin.scale if lin.qweight is not None else None
        if linear_kind == "amx":
            return None if lin.packed_amx is None else (lin.packed_amx, lin.amx_scale)
        if (lin.invariant_kernel != "bf16dot" or lin.bias is not None or lin.qweight is not None
                or lin.packed_invariant.shape[0] * 32 != lin.out_features):
            return None
        return lin.packed_invariant, None

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        if getattr(model, "tp_size", 1) > 1:   # the fused call has no all-reduce between layers
            return None
        first = model.model.layers[0].self_attn.qkv_proj
        kind = "amx" if first.packed_amx is not None or first.invariant_kernel == "amx" else "bf16dot"
        # tuned mode's AMX kernel serves up to AMX_KERNEL_MAX_ROWS rows, oneDNN the rest
        max_rows = AMX_KERNEL_MAX_ROWS if first.packed_amx is not None else None
        ptrs: list[int] = []
        for layer in model.model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            linears = (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [cls._weight(lin, kind) for lin in linears]
            if any(w is None for w in weights) or sa.attn.k_cache.dtype != torch.bfloat16:
                return None
            if (sa.rotary.cos.dtype != torch.bfloat16 or layer.input_layernorm.weight.dtype != torch.bfloat16
                    or model.model.embed_tokens.weight.dtype != torch.bfloat16):
                return None

            def addr(t):
                return t.data_ptr() if t is not None else 0
            (qkv_w, qkv_s), (o_w, o_s), (gu_w, gu_s), (down_w, down_s) = weights
            ptrs += [addr(layer.input_layernorm.weight), addr(layer.post_attention_layernorm.weight),
                     addr(qkv_w), addr(sa.qkv_proj.bias), addr(o_w), addr(sa.o_proj.bias), addr(gu_w),
                     addr(mlp.gate_up_proj.bias), addr(down_w), addr(mlp.down_proj.bias),
                     addr(sa.q_norm.weight if sa.q_norm is not None else None),
                     addr(sa.k_norm.weight if sa.k_norm is not None else None),
                     addr(sa.attn.k_cache), addr(sa.attn.v_cache), addr(qkv_s), addr(o_s), addr(gu_s), addr(down_s)]
        return cls(model, torch.tensor(ptrs, dtype=torch.int64), kind, max_rows)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = x.shape[0]
        width = self.hidden * 3 + (self.nq + 2 * self.nkv) * self.head_dim + self.nq * self.head_dim + 3 * self.inter
        if self.scratch.numel() < m * width:
            self.scratch = torch.empty(max(m, 16) * width, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        attn = self.model.model.layers[0].self_attn
        qn = attn.q_norm
        cpu_kernels.decode_forward(
            m, self.num_layers, self.hidden, self.nq, self.nkv, self.head_dim, self.inter, self.layers, self.eps,
            qn.eps if qn is not None else 0.0, self.rotary.cos, self.rotary.sin, positions, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_context_lens, attn.attn.k_cache.shape[1], attn.attn.scale, x,
            self.norm.weight, out, self.scratch, self.linear_kind)
        return out


class NativeCpuBackend(TorchBackend):
    """The fused CPU kernels (float32 or bf16 activations; the KV cache float32 or bf16).

    batch_invariant: every query row of a step, decode or prefill, attends through the decode
    kernel, which walks the row's blocks in order and reduces over its context_len keys the same
    way whatever the other rows are (the prefill kernels and sdpa tile queries and keys by the
    chunk's shape). With the linears' invariant GEMM (engine/layers/linear.py) and the per-row
    elementwise kernels, a row's logits depend only on its sequence. Decode-only steps may run as
    one fused call (FusedDecode) of those same kernels. Tuned mode attends prompts the same way
    where no native prefill kernel serves their dtype and the decode kernel beats sdpa
    (cpu_kernels.prompt_rows_beat_sdpa)."""

    name = "native-cpu"

    def __init__(self, batch_invariant: bool = False) -> None:
        self._fused: dict[int, FusedDecode | None] = {}
        self.batch_invariant = batch_invariant

    def decode_model(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor | None:
        # Decode-only steps of a bf16 model on one thread (the fused call has no thread split).
        if meta.prefills or not meta.decode_native or torch.get_num_threads() != 1:
            return None
        key = id(model)
        if key not in self._fused:
            self._fused[key] = FusedDecode.build(model)
        fused = self._fused[key]
        if fused is None or (fused.max_rows is not None and input_ids.shape[0] > fused.max_rows):
            return None
        return fused(model.model.embed_tokens(input_ids), positions, meta)

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

    def qkv_rope_store(self, layer: QKVLayer, qkv: torch.Tensor, positions: torch.Tensor,
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
        native = bool(meta.prefills) and cpu_kernels.prefill_attention_supported(q.dtype, attn.k_cache, attn.head_dim)
        if meta.prefills and (self.batch_invariant or (
                not native and cpu_kernels.prompt_rows_beat_sdpa(q.dtype, attn.k_cache, attn.head_dim))):
            # every row, prompt or decode, through the decode kernel
            tables, lens = _row_tables(meta)
            return cpu_kernels.decode_attention(q, attn.k_cache, attn.v_cache, tables, lens, attn.scale)
        if nd and not meta.prefills:
            return cpu_kernels.decode_attention(q, attn.k_cache, attn.v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, attn.scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        if nd:
            out[:nd] = cpu_kernels.decode_attention(q[:nd], attn.k_cache, attn.v_cache, meta.decode_block_tables,
                                                    meta.decode_context_lens, attn.scale)
        for seg in meta.prefills:
            if native:   # straight from the cache blocks, cached prefix or not
                cpu_kernels.prefill_attention(q[seg.token_start:seg.token_end], attn.k_cache, attn.v_cache,
                                              seg.block_table, seg.cached_len, attn.scale,
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


def _row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the step as a decode row: [rows, max_blocks] block tables and the context
    length each row attends over (a prefill row at position p: p + 1 keys). Built once per step
    (kept on meta for the other layers)."""
    if meta.row_tables is not None:
        return meta.row_tables
    tables: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    if meta.num_decode:
        tables += list(meta.decode_block_tables)
        lens.append(meta.decode_context_lens.to(torch.int32))
    width = max([t.numel() for t in tables] + [seg.block_table.numel() for seg in meta.prefills])
    rows = torch.zeros(meta.num_decode + sum(s.token_end - s.token_start for s in meta.prefills), width,
                       dtype=torch.int64)
    for i, t in enumerate(tables):
        rows[i, :t.numel()] = t
    for seg in meta.prefills:
        rows[seg.token_start:seg.token_end, :seg.block_table.numel()] = seg.block_table
        lens.append(torch.arange(seg.cached_len + 1, seg.context_len + 1, dtype=torch.int32))
    meta.row_tables = (rows, torch.cat(lens))
    return meta.row_tables


TORCH = TorchBackend()


def select_backend(device: torch.device, kv_cache: torch.Tensor, head_dim: int,
                   compute_dtype: torch.dtype, batch_invariant: bool = False) -> TorchBackend:
    """The backend for this model: the native CPU kernels where they build and cover the model's
    dtypes, else torch. Decided once, at model load."""
    if device.type != "cpu":
        return TORCH
    if compute_dtype not in cpu_kernels.DTYPE_CODES:
        return TORCH
    if not cpu_kernels.supports(kv_cache, head_dim):
        return TORCH
    return NativeCpuBackend(batch_invariant)
