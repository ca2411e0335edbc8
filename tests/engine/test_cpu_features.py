"""The compute dtype, and tuned mode's kernels, follow the CPU features they are given (never this
machine's)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_features import CpuFeatures, choose_compute_dtype, cpu_identity, invariant_kernels_are_fastest

SPR = CpuFeatures("Xeon (AMX)", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                           "amx_tile", "amx_bf16", "amx_int8"}), "x86_64")
CPX = CpuFeatures("Xeon (AVX512-BF16)", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
                  "x86_64")
SKX = CpuFeatures("Xeon (AVX-512)", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}), "x86_64")
AVX2 = CpuFeatures("Desktop (AVX2)", frozenset({"avx2", "fma"}), "x86_64")


def _never_measure() -> float:
    raise AssertionError("the micro-benchmark must not run for this CPU")


def test_amx_picks_bf16_without_measuring() -> None:
    choice = choose_compute_dtype(torch.bfloat16, "cpu", SPR, True, _never_measure)
    assert choice.dtype == torch.bfloat16
    assert "AMX" in choice.reason


@pytest.mark.parametrize("features", [SKX, AVX2])
def test_no_native_bf16_picks_float32(features: CpuFeatures) -> None:
    choice = choose_compute_dtype(torch.bfloat16, "cpu", features, True, _never_measure)
    assert choice.dtype == torch.float32


@pytest.mark.parametrize("speedup,expected", [(2.0, torch.bfloat16), (1.0, torch.float32)])
def test_avx512_bf16_without_amx_follows_the_benchmark(speedup: float, expected: torch.dtype) -> None:
    calls = []

    def measure() -> float:
        calls.append(1)
        return speedup

    assert choose_compute_dtype(torch.bfloat16, "cpu", CPX, True, measure).dtype == expected
    assert calls == [1]


@pytest.mark.parametrize("features", [SPR, CPX, SKX, AVX2])
def test_float32_checkpoints_stay_float32(features: CpuFeatures) -> None:
    assert choose_compute_dtype(torch.float32, "cpu", features, True, _never_measure).dtype == torch.float32


def test_fp16_checkpoint_on_cpu_computes_in_float32() -> None:
    assert choose_compute_dtype(torch.float16, "cpu", SPR, True, _never_measure).dtype == torch.float32


def test_no_onednn_bf16_picks_float32_even_with_amx() -> None:
    assert choose_compute_dtype(torch.bfloat16, "cpu", SPR, False, _never_measure).dtype == torch.float32


def test_cuda_keeps_the_checkpoint_dtype() -> None:
    assert choose_compute_dtype(torch.bfloat16, "cuda", AVX2, True, _never_measure).dtype == torch.bfloat16


def test_identity_names_model_and_flags() -> None:
    ident = cpu_identity(SPR)
    assert "Xeon (AMX)" in ident and "amx_bf16" in ident and ident != cpu_identity(CPX)


@pytest.mark.parametrize("features,compute,quantized,expected", [
    (CPX, torch.bfloat16, False, True),      # AVX512-BF16 without AMX: bf16dot is the fastest GEMM there
    (SPR, torch.bfloat16, False, False),     # AMX: tuned mode has the AMX GEMM and prefill attention
    (SKX, torch.bfloat16, False, False),     # no bf16 dot products: no bf16dot kernel
    (AVX2, torch.bfloat16, False, False),
    (CPX, torch.float32, False, False),      # float32 compute: the tuned kernels differ
    (CPX, torch.bfloat16, True, False),      # w8a16: not measured against its tuned path
])
def test_tuned_mode_runs_the_invariant_kernels_only_where_they_are_the_fastest(
        features: CpuFeatures, compute: torch.dtype, quantized: bool, expected: bool) -> None:
    assert invariant_kernels_are_fastest(features, compute, quantized) is expected
