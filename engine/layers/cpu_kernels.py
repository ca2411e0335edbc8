"""Native CPU kernels (``engine/csrc/*.cpp``) and their Python entry points.

The C++ has no torch headers: it is built once per machine by ``engine.kernel_build`` (a few
seconds; cached under ``$PDSERVE_HOME/kernels``, locked against concurrent builders) and called
through ctypes, which releases the GIL, so row ranges are split over torch's intra-op thread
count. Every entry point's C signature is declared once, in ``_SIGNATURES``. If there is no
compiler, the build fails, or ``PDSERVE_CPU_KERNELS=0``, ``load()`` returns None and the engine
keeps its torch paths (``engine.layers.backend`` decides once, at model load).

Kernels (sources in engine/csrc):
  decode_attention*.cpp       decode attention straight from the paged cache (float32 or bf16 q / cache)
  prefill_attention.cpp       causal prefill attention from the paged bf16 cache on AMX tiles (bf16 q)
  prefill_attention_avx2.cpp  the same for float32 q over a float32 or bf16 cache, on AVX2 + FMA
  elementwise.cpp             RMSNorm, residual add + RMSNorm, SiLU-and-mul, q/k norm + rotary + KV store
  amx_linear.cpp              bf16 (or w8a16 int8) weights x bf16 rows on AMX tiles: decode-step GEMMs
  linear_bf16w.cpp            float32 rows x bf16 weights (float32 compute over a bf16 checkpoint), or
                              x float32 weights (batch-invariant mode): one in-order FMA chain per output
  linear_bf16dot.cpp          bf16 rows x bf16 weights on AVX512-BF16 (batch-invariant mode, bf16 compute):
                              one in-order chain of k pairs per output
  sampler.cpp                 greedy / temperature sampling by the inverse CDF
  decode_forward.cpp          a whole decode step (all layers) in one call, from the kernels above
All accumulate in float32 and round where the torch reference path rounds.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pdserve.engine.cpu_features import detect
from pdserve.engine.kernel_build import build_library
from pdserve.engine.settings import ENV

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ["decode_attention.cpp", "decode_attention_bf16.cpp", "decode_attention_f32.cpp", "prefill_attention.cpp",
           "prefill_attention_avx2.cpp", "elementwise.cpp", "linear_bf16w.cpp", "linear_bf16dot.cpp", "amx_linear.cpp",
           "sampler.cpp", "decode_forward.cpp"]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-ffp-contract=off",
         "-shared", "-fPIC", "-std=c++17"]

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name -> argument types (every function returns int: 0 on success)
_SIGNATURES: dict[str, list] = {
    # q, q_stride, k_cache, v_cache, tables, lens, out, H, HKV, D, block_size, max_blocks, scale, r0, r1,
    # q_dtype, cache_dtype
    "pd_decode_attention": [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _I64, _I32, _I32],
    # q, q_stride, k_cache, v_cache, table, start, n, out, H, HKV, D, block_size, scale, h0, h1
    "pd_prefill_attention": [_P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _F32, _I64, _I64],
    # the same, float32 q and out, then cache_dtype
    "pd_prefill_attention_f32": [_P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _F32, _I64, _I64,
                                 _I32],
    "pd_prefill_attention_avx2": [],
    # x, x_stride, w, out, out_stride, r0, r1, dim, eps, dtype
    "pd_rms_norm": [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _F32, _I32],
    # x, x_stride, residual, w, out, r0, r1, dim, eps, dtype
    "pd_add_rms_norm": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _F32, _I32],
    # gate_up, out, r0, r1, inter, dtype
    "pd_silu_mul": [_P, _P, _I64, _I64, _I64, _I32],
    # qkv, r0, r1, nq, nkv, D, positions, cos, sin, q_w, k_w, eps, k_cache, v_cache, slots, dtype, cache_dtype
    "pd_qkv_rope_store": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _F32, _P, _P, _P, _I32, _I32],
    # x, M, K, packed, N, y, n_tile0, n_tile1
    "pd_linear_bf16w": [_P, _I64, _I64, _P, _I64, _P, _I64, _I64],
    "pd_linear_f32w": [_P, _I64, _I64, _P, _I64, _P, _I64, _I64],
    "pd_bf16w_max_rows": [],
    "pd_linear_bf16dot": [_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I32],
    "pd_bf16dot_available": [],
    "pd_amx_init": [],
    # M, layers, hidden, nq, nkv, D, inter, layer pointers, eps, qk_eps, cos, sin, positions, slots, tables,
    # lens, max_blocks, block_size, scale, residual, final_norm, out, scratch, linear kind (FUSED_LINEAR_KINDS)
    "pd_decode_forward": [_I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _F32, _F32, _P, _P, _P, _P, _P, _P, _I64,
                          _I64, _F32, _P, _P, _P, _P, _I64],
    # logits, row stride, rows, vocab, temps (float32), u (float64), out (int64), dtype
    "pd_sample": [_P, _I64, _I64, _I64, _P, _P, _P, _I32],
    # x, M, K, packed, N, scale (int8 weights) or null, bias, y, group0, group1
    "pd_amx_linear_q": [_P, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I64],
}

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PARALLEL_MIN_ROWS = 64   # fewer rows run on the calling thread: splitting costs more than it saves

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None


def _build() -> ctypes.CDLL | None:
    path = build_library("pd_cpu_kernels", [CSRC / s for s in SOURCES], FLAGS)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None where unavailable."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if ENV.CPU_KERNELS.get() and platform.system() in ("Linux", "Darwin"):
                try:
                    _lib = _build()
                except Exception as exc:   # any failure leaves the torch path in place
                    log.warning("CPU kernels unavailable (%s); torch paths run instead", exc)
                    _lib = None
            _tried = True
    return _lib


def available() -> bool:
    return load() is not None


def _code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def _rows(fn, rows: int, before: tuple, after: tuple, weights: list[int] | None = None) -> None:
    """fn(*before, r0, r1, *after) over [0, rows), split over torch's threads when worth it."""
    threads = min(torch.get_num_threads(), rows)
    if threads <= 1 or (weights is None and rows < PARALLEL_MIN_ROWS):
        fn(*before, 0, rows, *after)
        return
    bounds = _split(weights, threads) if weights is not None else [
        (rows * i // threads, rows * (i + 1) // threads) for i in range(threads)]
    futures = [_executor().submit(fn, *before, a, b, *after) for a, b in bounds[1:]]
    fn(*before, bounds[0][0], bounds[0][1], *after)
    for fut in futures:
        fut.result()


# ---- elementwise ------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, dim] (rows may be strided, last dim contiguous) in the weight's dtype."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    _rows(load().pd_rms_norm, rows, (x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), dim),
          (dim, eps, _code(x)))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded to its dtype); returns rms_norm(residual)."""
    rows, dim = residual.shape
    out = torch.empty_like(residual)
    _rows(load().pd_add_rms_norm, rows, (x.data_ptr(), x.stride(0), residual.data_ptr(), weight.data_ptr(),
                                         out.data_ptr()), (dim, eps, _code(x)))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] contiguous -> silu(gate) * up, [rows, inter]."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    _rows(load().pd_silu_mul, rows, (gate_up.data_ptr(), out.data_ptr()), (inter, _code(gate_up)))
    return out


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, slots: torch.Tensor | None) -> None:
    """In place on qkv [rows, (H + 2 Hkv) * D] (contiguous): optional per-head RMSNorm of the q and
    k heads, rotary at positions (cos/sin: [max_pos, D] in qkv's dtype), then k and v stored to the
    caches' slots (when given). positions, slots: int64, contiguous."""
    rows = qkv.shape[0]
    null = None
    store = k_cache is not None
    _rows(load().pd_qkv_rope_store, rows, (qkv.data_ptr(),),
          (num_heads, num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
           q_weight.data_ptr() if q_weight is not None else null,
           k_weight.data_ptr() if k_weight is not None else null, eps,
           k_cache.data_ptr() if store else null, v_cache.data_ptr() if store else null,
           slots.data_ptr() if store else null, _code(qkv), _code(k_cache) if store else 0))


# ---- decode attention -------------------------------------------------------------------------

def supports(cache: torch.Tensor, head_dim: int) -> bool:
    return (load() is not None and cache.device.type == "cpu" and cache.dtype in DTYPE_CODES
            and cache.is_contiguous() and head_dim > 0)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D] float32 or bf16 (rows may be strided); caches: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int64; context_lens: [B] int32. Returns [B, H, D] in q's dtype.
    Caller checks supports() first."""
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if q.dtype not in DTYPE_CODES or q.stride(2) != 1 or q.stride(1) != d:
        q = q.float().contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype)
    tables = block_tables.contiguous()
    lens = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    lens = lens.contiguous()
    weights = lens.tolist() if torch.get_num_threads() > 1 and b > 1 else None
    _rows(load().pd_decode_attention, b,
          (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
           out.data_ptr(), h, hkv, d, bs, tables.shape[1], scale), (_code(q), _code(k_cache)), weights)
    return out


def prefill_attention_supported(q_dtype: torch.dtype, cache: torch.Tensor, head_dim: int) -> bool:
    """bf16 q over a bf16 cache on AMX; float32 q over a float32 or bf16 cache on AVX2 + FMA."""
    if head_dim not in (64, 128):
        return False
    if q_dtype == torch.float32:
        return cache.dtype in DTYPE_CODES and cache.is_contiguous() and avx2_prefill_available()
    return (q_dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
            and cache.numel() < 2**32 and amx_available())   # int32 dword offsets into one layer's cache


def prompt_rows_beat_sdpa(q_dtype: torch.dtype, cache: torch.Tensor, head_dim: int) -> bool:
    """Prompt rows attend through the decode kernel faster than through sdpa: bf16 q on the
    AVX-512 kernel (head_dim 64 or 128): 1.15-1.9x sdpa in one layer at 512-2048 tokens of the
    small model's shape on a Zen 4 (bench/prefill_attention.py). For tuned mode where no native
    prefill kernel serves q's dtype."""
    return q_dtype == torch.bfloat16 and head_dim in (64, 128) and detect().avx512 and supports(cache, head_dim)


_avx2_prefill: bool | None = None


def avx2_prefill_available() -> bool:
    """This CPU has AVX2 and FMA and the library was built with the AVX2 prefill attention."""
    global _avx2_prefill
    if _avx2_prefill is None:
        lib = load()
        _avx2_prefill = lib is not None and detect().avx2_fma and bool(lib.pd_prefill_attention_avx2())
    return _avx2_prefill


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      start: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of one sequence's queries at positions [start, start + n) over its cache
    (the new K/V already stored): q [n, H, D] bf16 (AMX) or float32 (AVX2) (rows may be strided),
    block_table int64 (the sequence's blocks), out [n, H, D] in q's dtype, contiguous, written in
    place. Callers check prefill_attention_supported() first."""
    n, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    table = block_table.contiguous()
    lib = load()
    if q.dtype == torch.float32:
        _prefill_attention_f32(lib, q, k_cache, v_cache, table, start, scale, out)
        return
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), start, n,
            out.data_ptr(), h, hkv, d, bs, scale)
    groups, g = hkv, h // hkv
    threads = min(torch.get_num_threads(), groups)
    if threads <= 1:
        rc = lib.pd_prefill_attention(*args, 0, h)
    else:
        bounds = [groups * i // threads * g for i in range(threads + 1)]
        futures = [_executor().submit(lib.pd_prefill_attention, *args, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        rc = lib.pd_prefill_attention(*args, bounds[0], bounds[1])
        rc = max([rc] + [fut.result() for fut in futures])
    if rc:
        raise RuntimeError("AMX prefill attention kernel refused its inputs")


PREFILL_MIN_ROWS = 32   # fewer query rows per thread: not worth splitting the queries


def _prefill_attention_f32(lib, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                           start: int, scale: float, out: torch.Tensor) -> None:
    n, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    qs, size = q.stride(0), q.element_size()

    def call(h0: int, h1: int, a: int, b: int) -> int:   # query heads [h0, h1), query rows [a, b)
        return lib.pd_prefill_attention_f32(
            q.data_ptr() + a * qs * size, qs, k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), start + a,
            b - a, out.data_ptr() + a * h * d * size, h, hkv, d, bs, scale, h0, h1, _code(k_cache))

    threads = torch.get_num_threads()
    todo = _prefill_parts(n, start, h, hkv, threads)
    parts, lock = iter(todo), threading.Lock()

    def worker() -> int:   # parts are taken as threads free up: one slowed by a busy core takes fewer
        rc = 0
        while True:
            with lock:
                part = next(parts, None)
            if part is None:
                return rc
            rc = max(rc, call(*part))

    futures = [_executor().submit(worker) for _ in range(min(threads, len(todo)) - 1)]
    rc = max([worker()] + [fut.result() for fut in futures])
    if rc:
        raise RuntimeError("AVX2 prefill attention kernel refused its inputs")


def _prefill_parts(n: int, start: int, h: int, hkv: int, threads: int) -> list[tuple[int, int, int, int]]:
    """(h0, h1, a, b): query heads [h0, h1) at query rows [a, b), about 2 parts per thread (so
    that threads balance dynamically) of about equal work: groups of whole KV heads where there
    are at least as many as threads, else query rows of equal causal work (row i sees start + i + 1
    keys) for all heads."""
    if threads <= 1:
        return [(0, h, 0, n)]
    g = h // hkv
    if hkv >= threads:
        pieces = min(hkv, 2 * threads)
        bounds = [hkv * i // pieces * g for i in range(pieces + 1)]
        return [(a, b, 0, n) for a, b in zip(bounds, bounds[1:])]
    pieces = min(2 * threads, n // PREFILL_MIN_ROWS)
    if pieces <= 1:
        return [(0, h, 0, n)]
    c = start + 0.5   # work of rows [0, x): x * c + x^2 / 2
    total = n * c + n * n / 2
    cuts = [0] + [round(math.sqrt(c * c + 2 * total * i / pieces) - c) for i in range(1, pieces)] + [n]
    return [(0, h, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


# ---- bf16-weight linear -----------------------------------------------------------------------

def bf16_linear_max_rows() -> int:
    """Up to how many rows linear_bf16w beats oneDNN's float32 GEMM on this build's ISA (0: never)."""
    lib = load()
    return int(lib.pd_bf16w_max_rows()) if lib is not None else 0


def bf16_linear_available() -> bool:
    return bf16_linear_max_rows() > 0


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (values representable in bf16) -> the kernel's [N / 32, K, 32] bf16 layout;
    None where N is not a multiple of 32."""
    n, k = weight.shape
    if n % 32:
        return None
    tiles = weight.detach().to(torch.bfloat16).reshape(n // 32, 2, 16, k)    # [tile, half, i, k]
    return tiles.permute(0, 3, 2, 1).contiguous().reshape(n // 32, k, 32)  # [tile, k, 2i + half]


def linear_bf16w(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T for W packed by pack_bf16_weight (or pack_invariant_weight): float32
    math on bf16 (or float32) weights."""
    lib = load()
    x = x.contiguous()
    m, k = x.shape
    tiles = packed.shape[0]
    y = torch.empty(m, tiles * 32, dtype=torch.float32)
    fn = lib.pd_linear_bf16w if packed.dtype == torch.bfloat16 else lib.pd_linear_f32w
    threads = min(torch.get_num_threads(), tiles)
    args = (x.data_ptr(), m, k, packed.data_ptr(), tiles * 32, y.data_ptr())
    if threads <= 1 or m == 0:
        fn(*args, 0, tiles)
    else:
        bounds = [tiles * i // threads for i in range(threads + 1)]
        for fut in [_executor().submit(fn, *args, a, b) for a, b in zip(bounds, bounds[1:])]:
            fut.result()
    return y


def bf16dot_available() -> bool:
    """Whether linear_bf16dot runs here (a build with AVX-512 and AVX512-BF16)."""
    lib = load()
    return lib is not None and bool(lib.pd_bf16dot_available())


def pack_bf16dot_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (values representable in bf16; int8 w8a16 values are) -> linear_bf16dot's
    [ceil(N / 32), K / 2, 32, 2] bf16 layout, the columns padded with zeros to a multiple of 32;
    None where K is odd or a value is not a bf16."""
    n, k = weight.shape
    if k % 2:
        return None
    w = weight.detach()
    w16 = w.to(torch.bfloat16)
    if w.dtype not in (torch.bfloat16, torch.int8) and not torch.equal(w16.to(w.dtype), w):
        return None
    pad = -n % 32
    if pad:
        w16 = torch.cat([w16, torch.zeros(pad, k, dtype=torch.bfloat16)])
    return w16.reshape(-1, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_bf16dot_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_bf16dot_weight's inverse: the [n, K] bf16 weight (a permutation: exact)."""
    tiles, k2 = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * 32, k2 * 2)[:n].contiguous()


def linear_bf16dot(x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] bf16 @ W^T for W packed by pack_bf16dot_weight: float32 accumulation; the result
    float32, or rounded to bf16 as it is stored (out_dtype), as .to(torch.bfloat16) rounds."""
    lib = load()
    x = x.contiguous()
    m, k = x.shape
    tiles = packed.shape[0]
    y = torch.empty(m, tiles * 32, dtype=out_dtype)
    threads = min(torch.get_num_threads(), tiles)
    args = (x.data_ptr(), m, k, packed.data_ptr(), tiles * 32, y.data_ptr())
    code = DTYPE_CODES[out_dtype]
    if threads <= 1 or m == 0:
        rc = lib.pd_linear_bf16dot(*args, 0, tiles, code)
    else:
        bounds = [tiles * i // threads for i in range(threads + 1)]
        rc = max(f.result() for f in [_executor().submit(lib.pd_linear_bf16dot, *args, a, b, code)
                                      for a, b in zip(bounds, bounds[1:])])
    if rc:
        raise RuntimeError(f"pd_linear_bf16dot failed ({rc})")
    return y


def pack_invariant_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (float32, bf16, or int8 w8a16 values) -> [ceil(N / 32), K, 32] for linear_bf16w,
    the columns padded with zeros to a multiple of 32: bf16 where every value is exactly a bf16
    (half the bytes; int8 values are), else float32 in plain column order."""
    n, k = weight.shape
    w = weight.detach()
    pad = -n % 32
    if pad:
        w = torch.cat([w, torch.zeros(pad, k, dtype=w.dtype)])
    as_bf16 = w.dtype in (torch.bfloat16, torch.int8) or torch.equal(w, w.to(torch.bfloat16).to(w.dtype))
    if as_bf16:
        return pack_bf16_weight(w.float())   # n is a multiple of 32 here
    return w.float().reshape(-1, 32, k).permute(0, 2, 1).contiguous()


# ---- sampling ---------------------------------------------------------------------------------

def sample(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row: argmax where temps is 0, else the inverse-CDF draw of softmax(logits / temp) at
    u (see engine/layers/sampler.py). logits [B, V] float32 or bf16 (last dim contiguous);
    temps float32 [B]; u float64 [B]. Returns int64 [B]."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    load().pd_sample(logits.data_ptr(), logits.stride(0), rows, vocab, temps.data_ptr(), u.data_ptr(),
                     out.data_ptr(), _code(logits))
    return out


# ---- fused decode step -------------------------------------------------------------------------

FUSED_LINEAR_KINDS = {"amx": 0, "bf16dot": 1}   # decode_forward.cpp's LinearKind


def decode_forward(m: int, num_layers: int, hidden: int, nq: int, nkv: int, head_dim: int, inter: int,
                   layers: torch.Tensor, eps: float, qk_eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                   block_size: int, scale: float, residual: torch.Tensor, final_norm: torch.Tensor, out: torch.Tensor,
                   scratch: torch.Tensor, linear_kind: str = "amx") -> None:
    """All layers of a decode step (see engine/csrc/decode_forward.cpp); residual [m, hidden] holds
    the embeddings on entry and the residual stream on return; out gets the final norm. linear_kind:
    the GEMM of every linear (FUSED_LINEAR_KINDS: the AMX kernel, or linear_bf16dot)."""
    tables = tables.contiguous()
    rc = load().pd_decode_forward(
        m, num_layers, hidden, nq, nkv, head_dim, inter, layers.data_ptr(), eps, qk_eps, cos.data_ptr(),
        sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1],
        block_size, scale, residual.data_ptr(), final_norm.data_ptr(), out.data_ptr(), scratch.data_ptr(),
        FUSED_LINEAR_KINDS[linear_kind])
    if rc:
        raise RuntimeError("fused decode kernel failed")


# ---- AMX bf16 linear -------------------------------------------------------------------------

_amx: bool | None = None


def amx_available() -> bool:
    """AMX bf16 tiles compiled in and granted by the OS (asked once per process)."""
    global _amx
    if _amx is None:
        lib = load()
        _amx = lib is not None and bool(lib.pd_amx_init())
    return _amx


def amx_packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % 64 == 0 and k % 32 == 0


def pack_amx_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [N / 64, K / 32, 4, 16, 32] (bf16; int8 weights stay int8): per 64 columns and
    32-wide K slice, four VNNI B tiles, tile[r][2c + p] = W[64 q + 16 j + c][32 kc + 2 r + p]."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype != torch.int8:
        w = w.to(torch.bfloat16)
    w = w.reshape(n // 64, 4, 16, k // 32, 16, 2)                                      # q, j, c, kc, r, p
    return w.permute(0, 3, 1, 4, 2, 5).contiguous()                                   # q, kc, j, r, c, p


def unpack_amx_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_amx_weight's inverse: the [n, K] weight (a permutation: exact)."""
    groups, ks = packed.shape[:2]
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(groups * 64, ks * 32)[:n].contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T (+ bias) for W packed by pack_amx_weight; bf16 out, float32 accumulation.
    int8 W (w8a16) takes its bf16 per-output-column scale: bf16(bf16(x @ W^T) * scale) (+ bias)."""
    x = x.contiguous()
    m, k = x.shape
    groups = packed.shape[0]
    n = groups * 64
    y = torch.empty(m, n, dtype=torch.bfloat16)
    lib = load()
    args = (x.data_ptr(), m, k, packed.data_ptr(), n, scale.data_ptr() if scale is not None else None,
            bias.data_ptr() if bias is not None else None, y.data_ptr())
    threads = min(torch.get_num_threads(), groups)
    if threads <= 1:
        rc = lib.pd_amx_linear_q(*args, 0, groups)
    else:
        bounds = [groups * i // threads for i in range(threads + 1)]
        futures = [_executor().submit(lib.pd_amx_linear_q, *args, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        rc = lib.pd_amx_linear_q(*args, bounds[0], bounds[1])
        rc = max([rc] + [fut.result() for fut in futures])
    if rc:
        raise RuntimeError("AMX linear kernel refused its inputs (no AMX permission or unsupported shape)")
    return y


# ---- threads ----------------------------------------------------------------------------------

def _forget_pool() -> None:   # a forked child has none of the parent's worker threads
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < torch.get_num_threads():
            _pool = ThreadPoolExecutor(max_workers=torch.get_num_threads(), thread_name_prefix="pd-cpu")
        return _pool


def _split(lens: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous row ranges of about equal total weight."""
    total, bounds, acc, start = sum(lens), [], 0, 0
    for i, n in enumerate(lens):
        acc += n
        if acc * parts >= total * (len(bounds) + 1) and i + 1 < len(lens):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(lens)))
    return bounds
