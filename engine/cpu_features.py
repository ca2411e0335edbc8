"""What this CPU can do, the compute dtype chosen from it, and whether tuned mode runs the
batch-invariant kernels (``invariant_kernels_are_fastest``).

``detect()`` reads the CPU's model name and feature flags once. ``choose_compute_dtype`` is the
one place that turns them into the engine's compute dtype for ``compute_dtype="auto"``:

* float32 checkpoints compute in float32, fp16 ones in float32 on CPU (no CPU here has fast
  fp16 GEMMs in torch), and CUDA computes in the checkpoint's dtype;
* bf16 checkpoints on CPU compute in bf16 where bf16 GEMMs are native and fast: AMX (tiles,
  ~1 TFLOP/s per core in oneDNN against ~150 GFLOP/s float32) or, with AVX512-BF16 dot
  products but no AMX, when a short micro-benchmark (cached per machine) finds bf16 GEMMs
  faster; otherwise in float32 (bf16 GEMMs would be emulated, slower than float32's).

The decision takes the features as an argument, so tests inject any CPU.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine.settings import pdserve_home

log = logging.getLogger(__name__)

BENCH_FASTER_RATIO = 1.15   # bf16 must beat float32 by this much in the micro-benchmark


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]
    machine: str = ""

    @property
    def amx_bf16(self) -> bool:
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def avx2_fma(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags


@functools.lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    """This machine's CPU (Linux: /proc/cpuinfo; elsewhere: the model name only, no flags)."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return CpuFeatures(model=model or platform.processor() or "", flags=flags, machine=platform.machine())


def cpu_identity(features: CpuFeatures | None = None) -> str:
    """A stable string naming this CPU and its features (a cache key part)."""
    f = features or detect()
    return f"{f.machine}|{f.model}|{' '.join(sorted(f.flags))}"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def choose_compute_dtype(weights: torch.dtype, device_type: str, features: CpuFeatures,
                         bf16_gemm_supported: bool,
                         bf16_speedup: Callable[[], float] | None = None) -> DtypeChoice:
    """The compute dtype for ``compute_dtype="auto"``.

    weights: the checkpoint / cache dtype. bf16_gemm_supported: torch's oneDNN has bf16 GEMMs.
    bf16_speedup: returns float32 GEMM time / bf16 GEMM time on this machine (consulted only
    for AVX512-BF16 without AMX)."""
    if device_type != "cpu":
        return DtypeChoice(weights, f"{device_type}: the checkpoint's dtype")
    if weights == torch.float32:
        return DtypeChoice(torch.float32, "float32 checkpoint")
    if weights != torch.bfloat16:
        return DtypeChoice(torch.float32, f"{str(weights).removeprefix('torch.')} checkpoint: no fast CPU GEMMs "
                                          "for it, float32 math over its values")
    if not bf16_gemm_supported:
        return DtypeChoice(torch.float32, "this torch build has no oneDNN bf16 GEMMs")
    if features.amx_bf16:
        return DtypeChoice(torch.bfloat16, "CPU has AMX bf16 tiles: bf16 GEMMs run several times float32's")
    if features.avx512_bf16 and bf16_speedup is not None:
        ratio = bf16_speedup()
        if ratio >= BENCH_FASTER_RATIO:
            return DtypeChoice(torch.bfloat16, f"AVX512-BF16 without AMX; micro-benchmark: bf16 GEMMs {ratio:.2f}x "
                                               "float32's")
        return DtypeChoice(torch.float32, f"AVX512-BF16 without AMX; micro-benchmark: bf16 GEMMs only {ratio:.2f}x "
                                          "float32's")
    return DtypeChoice(torch.float32, "no native bf16 dot products (no AMX / AVX512-BF16): bf16 GEMMs would be "
                                      "emulated; float32 math over the bf16 weights")


def invariant_kernels_are_fastest(features: CpuFeatures, compute: torch.dtype, quantized: bool) -> bool:
    """Whether batch-invariant mode's bf16 kernels are also this CPU's fastest, so that tuned mode
    (batch invariance off) runs them too, without the promise: bf16 compute of an unquantized
    model on AVX512-BF16 without AMX. There the tuned alternatives are oneDNN's bf16 GEMM (no
    faster from 64 rows, 1.2-1.8x slower at decode's 1-4 rows: bench/bf16dot_linear.py) and
    torch's sdpa for prompts (1.15-1.9x slower in one layer at 512-2048 tokens, the small model's
    shape: bench/prefill_attention.py), on a Zen 4. With AMX, tuned mode has the AMX GEMM and
    prefill attention."""
    return compute == torch.bfloat16 and not quantized and features.avx512_bf16 and not features.amx_bf16


def bf16_gemm_supported() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def measured_bf16_speedup() -> float:
    """float32 / bf16 GEMM time at prefill-like shapes, measured once per machine (CPU, flags,
    torch version, thread count) and cached under ``$PDSERVE_HOME/cpu_profile``."""

    threads = torch.get_num_threads()
    key = hashlib.sha256(f"{cpu_identity()}|{torch.__version__}|{threads}".encode()).hexdigest()[:16]
    path = pdserve_home() / "cpu_profile" / f"gemm-{key}.json"
    try:
        return float(json.loads(path.read_text())["bf16_speedup"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ratio = _bench_gemm(torch.float32) / _bench_gemm(torch.bfloat16)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bf16_speedup": ratio, "cpu": cpu_identity(), "torch": torch.__version__,
                                   "threads": threads}))
        os.replace(tmp, path)
    except OSError:
        pass
    return ratio


def _bench_gemm(dtype: torch.dtype, m: int = 256, k: int = 1024, n: int = 1024, reps: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


_logged: set[str] = set()


def log_once(message: str, *args: object) -> None:
    """INFO, once per process per distinct message."""
    text = message % args if args else message
    if text not in _logged:
        _logged.add(text)
        log.info(text)
