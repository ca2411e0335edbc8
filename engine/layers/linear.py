"""Linear layers: packed projections loaded shard by shard, and W8A16 weight-only int8."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers import cpu_kernels
from pdserve.engine.parallel import padded_split

# Row counts up to this use the bf16-weight kernel when it is set up (decode steps); more rows
# (prefill) use the oneDNN float32 GEMM, which is faster once weights are reused across rows.
# The kernel may set a lower bound for the ISA it was built for (AVX2: 4 rows).
BF16_KERNEL_MAX_ROWS = 128
# bf16 compute on AMX: row counts up to this use the AMX kernel over weights packed on huge pages
# (decode steps stream the weights; measured 1.2-1.4x oneDNN's prepacked GEMM at 1-64 rows);
# more rows (prefill) use oneDNN's prepacked GEMM, which blocks better for large row counts.
AMX_KERNEL_MAX_ROWS = 64
CHECK_COLUMNS = 256   # output columns a freshly packed batch-invariant weight is checked on
# A pre-quantized W8A16 checkpoint (config.json quant_method pdserve_w8a16, as
# engine/checkpoints/gguf_checkpoint.py writes it) holds <linear>.weight in int8 and this tensor
# beside it: one float scale per output row.
W8A16_SCALE = "weight_scale"


class TensorSource(Protocol):
    """A checkpoint tensor as the loader hands it over: a tensor, or a lazy slice of the file
    (safetensors' get_slice), where indexing reads only the elements asked for."""

    def __getitem__(self, index) -> torch.Tensor: ...


def materialize(source: TensorSource) -> torch.Tensor:
    """The whole tensor behind source."""
    return source if isinstance(source, torch.Tensor) else source[...]


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
        # int8 [out, in] after quantize_w8a16() or hold_int8(), and [out], one scale per output
        # channel: buffers, so the scale takes the model's dtype with it (model.to)
        self.register_buffer("qweight", None, persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.packed: torch.Tensor | None = None    # oneDNN-blocked copy of weight after pack_for_cpu()
        self.packed_bf16: torch.Tensor | None = None   # cpu_kernels bf16 layout, after pack_for_cpu(bf16_weights=True)
        self.bf16_max_rows = 0                          # rows up to which packed_bf16 is used (any count once
                                                        # the float32 weight is dropped)
        self.packed_amx: torch.Tensor | None = None    # cpu_kernels AMX tile layout, after pack_for_cpu(amx=True)
        self.amx_scale: torch.Tensor | None = None     # w8a16: the scale packed_amx (int8) is multiplied by
        self.packed_invariant: torch.Tensor | None = None   # cpu_kernels layout for every row count, after
                                                            # pack_invariant() (batch-invariant mode)
        self.invariant_kernel = ""   # the GEMM packed_invariant is laid out for: "amx" (amx_linear), "bf16dot"
                                     # (linear_bf16dot; both bf16 rows) or "bf16w" (linear_bf16w, float32 rows)

    def _shard_slice(self, shard_id: int | None) -> slice:
        if shard_id is None:
            return slice(0, self.out_features)
        start = sum(self.shard_sizes[:shard_id])
        return slice(start, start + self.shard_sizes[shard_id])

    def load(self, name: str, tensor: TensorSource, shard_id: int | None) -> None:
        if self.qweight is not None and name in ("weight", W8A16_SCALE):
            self._load_int8(name, materialize(tensor), self._shard_slice(shard_id))
            return
        tensor = materialize(tensor)
        if name == W8A16_SCALE or tensor.dtype == torch.int8:
            raise ValueError(f"int8 checkpoint tensor {name} for a linear layer not set up for it (hold_int8)")
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a bias the model does not expect: {name}")
        dst = target.data[self._shard_slice(shard_id)]
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
        dst.copy_(tensor)

    def quantize_w8a16(self) -> None:
        """Replace the weight by int8 values and a per-output-channel scale (symmetric)."""
        self.qweight, scale = _int8_rows(self.weight.data)
        self.scale = scale.to(self.weight.dtype)
        self.weight = None  # type: ignore[assignment]

    def hold_int8(self) -> None:
        """Take a pre-quantized W8A16 weight as it is stored: load() then copies the checkpoint's
        int8 rows into qweight and its per-row scales into scale (the layout quantize_w8a16()
        makes), and the float weight is dropped now, before any weight is read, so neither a
        float copy of the int8 values nor an unused float weight is ever held. The scale is
        allocated in the weight's dtype, and follows the model's dtype from there (a buffer)."""
        if self.qweight is not None:
            return
        w = self.weight
        self.qweight = torch.zeros(self.out_features, self.in_features, dtype=torch.int8, device=w.device)
        self.scale = torch.zeros(self.out_features, dtype=w.dtype, device=w.device)
        self.weight = None  # type: ignore[assignment]

    def _load_int8(self, name: str, tensor: torch.Tensor, rows: slice) -> None:
        dst = self.scale[rows] if name == W8A16_SCALE else self.qweight[rows]
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
        if name == W8A16_SCALE or tensor.dtype == torch.int8:
            dst.copy_(tensor)
            return
        # a float shard packed beside int8 ones (q/k/v, gate/up of mixed types): its rows
        # quantized as quantize_w8a16() would (per-row scales: the other shards' rows are untouched)
        values, scale = _int8_rows(tensor)
        dst.copy_(values)
        self.scale[rows] = scale.to(self.scale.dtype)

    def pack_for_cpu(self, bf16_weights: bool = False, amx: bool = False) -> bool:
        """Set up a faster CPU forward; returns whether one is in use.

        amx: bf16 weights and activations on a CPU with AMX. Forwards of up to AMX_KERNEL_MAX_ROWS
        rows then use cpu_kernels.amx_linear over a tile-packed copy (packed_amx, which the model
        runner may move onto huge pages); larger ones the oneDNN-prepacked weight below.

        bf16_weights: the float32 weight holds bf16 values (a bf16 checkpoint computed in float32).
        Forwards then multiply by a bf16 copy in float32 math (cpu_kernels.linear_bf16w), reading
        half the weight bytes. Where the kernel beats oneDNN to BF16_KERNEL_MAX_ROWS rows
        (AVX-512) every forward runs it, prefill GEMMs too (1.8-2.5x F.linear's float32 GEMM at
        128 and 512 rows of Qwen3-0.6B's shapes, one core of an AVX-512 EPYC:
        bench/bf16w_linear.py), and the float32 weight is dropped (two thirds of the weight bytes held).
        Where it covers only a few rows (AVX2), larger forwards keep the float32 weight: F.linear,
        or the oneDNN-prepacked copy.
        Otherwise: a oneDNN-prepacked copy of the weight, whose GEMMs run well above the plain
        layout's for the small row counts of decode steps (~1.2-1.7x at 16-64 rows in float32).
        Either is checked against F.linear before use; once a packed copy serves every row count,
        the plain weight is dropped."""
        if self.qweight is not None and amx:
            return self._pack_amx_int8()
        if self.qweight is not None or self.weight is None or self.weight.device.type != "cpu":
            return False
        if bf16_weights and self._pack_bf16() and self.bf16_max_rows >= BF16_KERNEL_MAX_ROWS:
            self.weight = None  # type: ignore[assignment]   # every row count runs the kernel (a tied
            return True                                        # embedding keeps its own reference)
        # (a bf16-weight kernel for few rows only, as on AVX2: the rest take the prepacked GEMM below)
        if amx:
            self._pack_amx()
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        w = self.weight.data
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            x = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            ok = torch.allclose(got.float(), F.linear(x, w, self.bias).float(), rtol=1e-2, atol=1e-2)
        except Exception:   # no oneDNN kernels for this dtype / build
            return False
        if ok:
            # every forward now takes a packed copy (the kernels above for their rows, this one for
            # the rest): the plain weight is never read again, and dropped it no longer doubles the
            # weight bytes held (Qwen3-0.6B in bf16: 0.9 GB; a tied embedding keeps its own reference)
            self.packed = packed
            self.weight = None  # type: ignore[assignment]
        return ok

    def pack_invariant(self, amx: bool = False) -> bool:
        """Batch-invariant mode: every forward, whatever its row count, runs one kernel over a packed
        copy of the weight, whose per-output reduction is one chain over K in order: a row's result
        does not depend on the other rows of the step. Tuned mode's oneDNN path picks kernels by
        row count. With bf16 compute the kernel is, where amx (the caller found AMX tiles) and the
        shape allows, cpu_kernels.amx_linear: every 16-row block of any step, a decode row's
        zero-padded block too, runs the same tile products over K in order (5-13x linear_bf16dot's
        GFLOP/s from 16 rows on a Xeon with AMX: docs/benchmarks-history.md); else, on AVX512-BF16,
        cpu_kernels.linear_bf16dot (bf16 rows and weights, k pairs by vdpbf16ps); otherwise
        cpu_kernels.linear_bf16w (float32 math; bf16 weights where their values are bf16, int8
        w8a16 included, else float32). Checked against F.linear before use; returns whether it is
        in use (invariant_kernel says which)."""
        w = self.qweight if self.qweight is not None else self.weight
        if w is None or w.device.type != "cpu" or not cpu_kernels.bf16_linear_available():
            return False
        compute = self.scale.dtype if self.qweight is not None else w.dtype
        if compute == torch.bfloat16:
            if amx and cpu_kernels.amx_available() and cpu_kernels.amx_packable(w) and self._pack_invariant_amx(w):
                return True
            if cpu_kernels.bf16dot_available() and self._pack_invariant_bf16dot(w):
                return True
        packed = cpu_kernels.pack_invariant_weight(w)
        if packed is None:
            return False
        x = torch.randn(5, self.in_features, generator=torch.Generator().manual_seed(0))
        want = F.linear(x, w.float())
        if not torch.allclose(cpu_kernels.linear_bf16w(x, packed)[:, :self.out_features], want, rtol=1e-4, atol=1e-4):
            return False
        self._set_invariant(packed, "bf16w")
        return True

    def _set_invariant(self, packed: torch.Tensor, kernel: str) -> None:
        self.packed_invariant, self.invariant_kernel = packed, kernel
        self.packed = self.packed_bf16 = self.packed_amx = None

    def release_plain_weight(self) -> int:
        """Batch-invariant mode: drop the plain weight now that the packed copy serves every forward,
        where unpack_invariant() can make it again (amx_linear's or linear_bf16dot's layout of a
        bf16 weight), so a model's two copies never coexist while it loads. Returns the bytes
        dropped (0: kept)."""
        if self.invariant_kernel not in ("amx", "bf16dot") or self.qweight is not None or self.weight is None:
            return 0
        nbytes = self.weight.numel() * self.weight.element_size()
        self.weight = None
        return nbytes

    def unpack_invariant(self) -> None:
        """Leave batch-invariant mode: the plain weight back (from the packed copy if it was
        released) and the packed copy gone."""
        if self.weight is None and self.qweight is None and self.invariant_kernel in ("amx", "bf16dot"):
            unpack = cpu_kernels.unpack_amx_weight if self.invariant_kernel == "amx" else cpu_kernels.unpack_bf16dot_weight
            self.weight = nn.Parameter(unpack(self.packed_invariant, self.out_features), requires_grad=False)
        self.packed_invariant, self.invariant_kernel = None, ""

    def _pack_invariant_bf16dot(self, w: torch.Tensor) -> bool:
        packed = cpu_kernels.pack_bf16dot_weight(w)
        if packed is None:
            return False
        # Checked on the first tiles only: the layout is the same for all, and a float32 copy of a
        # whole LM head (622 MB at Qwen3's vocabulary) would be the load's peak.
        cols = min(self.out_features, CHECK_COLUMNS)
        x = torch.randn(5, self.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        want = F.linear(x.float(), w[:cols].float())
        if not torch.allclose(cpu_kernels.linear_bf16dot(x, packed[:-(-cols // 32)])[:, :cols], want,
                              rtol=1e-3, atol=1e-3):
            return False
        self._set_invariant(packed, "bf16dot")
        return True

    def _pack_invariant_amx(self, w: torch.Tensor) -> bool:
        """amx_linear for every row count, over bf16 or int8 (w8a16, its scale applied inside, as
        tuned mode's AMX path does) tiles; checked on the first column groups, as above."""
        packed = cpu_kernels.pack_amx_weight(w)
        cols = min(self.out_features, CHECK_COLUMNS)
        scale = self.scale if self.qweight is not None else None
        x = torch.randn(5, self.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        got = cpu_kernels.amx_linear(x, packed[:cols // 64], None if self.bias is None else self.bias[:cols],
                                     None if scale is None else scale[:cols]).float()
        want = F.linear(x.float(), w[:cols].float())
        if scale is not None:
            want = want * scale[:cols].float()
        if self.bias is not None:
            want = want + self.bias[:cols].float()
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
            return False
        self._set_invariant(packed, "amx")
        return True

    def _forward_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """The packed_invariant GEMM in float32, rounded to x's dtype where the other paths round
        (the int8 product before its scale, as _forward_w8a16); the bias added in x's dtype (by
        amx_linear before its rounding, as tuned mode's AMX path and the fused decode call do)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.invariant_kernel == "amx":   # the scale and bias inside, as the fused decode call has them
            y = cpu_kernels.amx_linear(x2.to(torch.bfloat16), self.packed_invariant, self.bias,
                                       self.scale if self.qweight is not None else None)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.invariant_kernel == "bf16dot":   # bf16 compute: x is bf16, and y is rounded to it as it is stored
            y = cpu_kernels.linear_bf16dot(x2.to(torch.bfloat16), self.packed_invariant, torch.bfloat16)
        else:
            y = cpu_kernels.linear_bf16w(x2 if x2.dtype == torch.float32 else x2.float(), self.packed_invariant)
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features]
        y = y.to(x.dtype)
        if self.scale is not None and self.qweight is not None:
            y = y * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _pack_amx(self) -> bool:
        w = self.weight.data
        if w.dtype != torch.bfloat16 or not cpu_kernels.amx_packable(w) or not cpu_kernels.amx_available():
            return False
        packed = cpu_kernels.pack_amx_weight(w)
        x = torch.randn(5, self.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
        got = cpu_kernels.amx_linear(x, packed, self.bias).float()
        if not torch.allclose(got, F.linear(x, w, self.bias).float(), rtol=1e-2, atol=1e-2):
            return False
        self.packed_amx = packed
        return True

    def _pack_amx_int8(self) -> bool:
        """w8a16 on AMX: int8 tiles widened to bf16 inside the kernel, half the weight bytes streamed."""
        q, scale = self.qweight, self.scale
        if (q.device.type != "cpu" or scale.dtype != torch.bfloat16 or not cpu_kernels.amx_packable(q)
                or not cpu_kernels.amx_available()):
            return False
        packed = cpu_kernels.pack_amx_weight(q)
        x = torch.randn(5, self.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        got = cpu_kernels.amx_linear(x, packed, self.bias, scale)
        want = self._forward_w8a16(x)
        if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
            return False
        self.packed_amx, self.amx_scale = packed, scale
        return True

    def _pack_bf16(self) -> bool:
        w = self.weight.data
        if w.dtype != torch.float32 or not cpu_kernels.bf16_linear_available():
            return False
        if not torch.equal(w, w.to(torch.bfloat16).to(torch.float32)):
            return False   # not bf16 values: the copy would change the weights
        packed = cpu_kernels.pack_bf16_weight(w)
        if packed is None:
            return False
        x = torch.randn(5, self.in_features, generator=torch.Generator().manual_seed(0))
        if not torch.allclose(cpu_kernels.linear_bf16w(x, packed), F.linear(x, w), rtol=1e-4, atol=1e-4):
            return False
        self.packed_bf16 = packed
        self.bf16_max_rows = min(BF16_KERNEL_MAX_ROWS, cpu_kernels.bf16_linear_max_rows())
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_invariant is not None:
            return self._forward_invariant(x)
        if (self.packed_amx is not None and x.dim() == 2 and x.shape[0] <= AMX_KERNEL_MAX_ROWS
                and x.dtype == torch.bfloat16):
            return cpu_kernels.amx_linear(x, self.packed_amx, self.bias, self.amx_scale)
        if self.packed_bf16 is not None and self.weight is None:
            return self._forward_bf16_all(x)
        if (self.packed_bf16 is not None and x.dim() == 2 and x.shape[0] <= self.bf16_max_rows
                and x.dtype == torch.float32):
            y = cpu_kernels.linear_bf16w(x, self.packed_bf16)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.qweight is None:
            return F.linear(x, self.weight, self.bias)
        return self._forward_w8a16(x)

    def _forward_bf16_all(self, x: torch.Tensor) -> torch.Tensor:
        """Any rows, any leading shape, through the bf16-weight kernel (the float32 weight is gone)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = cpu_kernels.linear_bf16w(x2 if x2.dtype == torch.float32 else x2.float(), self.packed_bf16)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _forward_w8a16(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: the int8 values and the float32 scale of each row."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


# ---- tensor parallelism (engine/parallel.py) ------------------------------------------------
class ColumnParallelLinear(Linear):
    """Output rows split over the ranks. ``rows[i]`` is this rank's [start, end) of packed shard
    i's checkpoint tensor, so a fused QKV or gate/up stays one matmul per rank; rows may repeat
    across ranks (replicated KV heads)."""

    def __init__(self, in_features: int, rows: list[tuple[int, int]], bias: bool = False) -> None:
        super().__init__(in_features, [end - start for start, end in rows], bias)
        self.rows = rows

    def load(self, name: str, tensor: TensorSource, shard_id: int | None) -> None:
        start, end = self.rows[shard_id or 0]
        super().load(name, tensor[start:end], shard_id)


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the partial products are summed by an all-reduce.
    The bias is added once (rank 0). W8A16 scales come from the whole row (an all-reduce of the
    absolute maxima), so the int8 weights equal the unsplit layer's."""

    def __init__(self, in_features: int, out_features: int, cols: tuple[int, int], group, bias: bool = False) -> None:
        super().__init__(cols[1] - cols[0], out_features, bias)
        self.cols, self.group = cols, group

    def load(self, name: str, tensor: TensorSource, shard_id: int | None) -> None:
        if name == "bias":
            if self.group.rank == 0:
                super().load(name, tensor, shard_id)
            return
        if name == W8A16_SCALE:   # one scale per output row, the whole row's: every rank's the same
            super().load(name, tensor, shard_id)
            return
        super().load(name, tensor[:, self.cols[0]:self.cols[1]], shard_id)

    def quantize_w8a16(self) -> None:
        amax = self.weight.data.float().abs().amax(dim=1)
        self.group.all_reduce(amax, torch.distributed.ReduceOp.MAX)
        scale = amax.clamp(min=1e-12) / 127.0
        self.qweight = torch.round(self.weight.data.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(self.weight.dtype)
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class ParallelLMHead(Linear):
    """Vocabulary rows split over the ranks (padded to a multiple of the rank count); the logits
    are all-gathered and trimmed to the vocabulary."""

    def __init__(self, in_features: int, vocab_size: int, group) -> None:
        start, end, per = padded_split(vocab_size, group.rank, group.size)
        super().__init__(in_features, per)
        self.vocab_size, self.vocab_range, self.group = vocab_size, (start, end), group
        self.weight.data.zero_()

    def load(self, name: str, tensor: TensorSource, shard_id: int | None) -> None:
        start, end = self.vocab_range
        rows = tensor[start:end]
        if name != "weight" or rows.dtype == torch.int8:
            raise ValueError(f"lm_head.{name}: the tensor-parallel LM head loads float weights only")
        self.weight.data[:end - start].copy_(rows)

    def gather_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(self(hidden))
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]
