#!/usr/bin/env python
"""Batch-invariant mode's bf16 GEMM (engine/csrc/linear_bf16dot.cpp, AVX512-BF16; with --kernel amx
the AMX tile GEMM it runs where the CPU has AMX, engine/csrc/amx_linear.cpp) against
oneDNN's prepacked bf16 GEMM (what the tuned path and vLLM-CPU run), side by side in one run:
bf16 rows times the same bf16 weights, bf16 out, one torch thread, Qwen3-0.6B's GEMM shapes
(fused QKV 4096 x 1024, o_proj 1024 x 2048, gate/up 6144 x 1024, down 1024 x 3072) and the small
model's (1024 x 512, 3072 x 512, 512 x 1536), at decode and prefill row counts. Prints the best
of --iters in ms, GFLOP/s and the ratio oneDNN / kernel (above 1: the kernel is faster).

--step MODEL times a whole step's linears instead: every layer's own weights (the small model's
8 layers and LM head, 58 MB; Qwen3-0.6B's 28 layers and LM head, 1.2 GB), so they stream from
memory as in a decode step rather than staying in cache as one shape's do.

    python bench/bf16dot_linear.py
    python bench/bf16dot_linear.py --rows 1,16,64,256,2048 --iters 10
    python bench/bf16dot_linear.py --step small,qwen3-0.6b --rows 1,8,12,16,20,32,64
    python bench/bf16dot_linear.py --kernel amx --rows 16,64,256,512,1024
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.drivers import best_ms  # noqa: E402
from pdserve.engine.layers import cpu_kernels  # noqa: E402

# name -> (available, pack a bf16 weight, x @ W^T into bf16)
KERNELS = {"bf16dot": (cpu_kernels.bf16dot_available, cpu_kernels.pack_bf16dot_weight,
                       lambda x, packed: cpu_kernels.linear_bf16dot(x, packed, torch.bfloat16)),
           "amx": (cpu_kernels.amx_available, cpu_kernels.pack_amx_weight,
                   lambda x, packed: cpu_kernels.amx_linear(x, packed, None))}
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1024, 512), (3072, 512), (512, 1536))
# One step's linears, (N, K) in order: per layer fused QKV, o_proj, gate/up, down; then the LM head.
STEPS = {"small": [(1024, 512), (512, 512), (3072, 512), (512, 1536)] * 8 + [(8192, 512)],
         "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * 28 + [(151936, 1024)]}


def time_step(name: str, rows: list[int], iters: int, g: torch.Generator, kernel_name: str) -> None:
    """Both GEMMs over a whole step's linears, each layer's weights its own."""
    _, pack, run = KERNELS[kernel_name]
    shapes = STEPS[name]
    weights = [(torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16) for n, k in shapes]
    packed = [pack(w) for w in weights]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    del weights
    flop_per_row = sum(2 * n * k for n, k in shapes)
    gb = sum(n * k * 2 for n, k in shapes) / 1e9
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}

        def kernel() -> None:
            for (_, k), w in zip(shapes, packed):
                run(xs[k], w)

        def onednn() -> None:
            for (_, k), w in zip(shapes, reordered):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
        ref, ker = best_ms(onednn, iters), best_ms(kernel, iters)
        gf = flop_per_row * m / 1e6
        print(f"| {name} | {m} | {ref:.2f} | {ker:.2f} | {gf / ref:.0f} | {gf / ker:.0f} | {gb / ker * 1e3:.1f} | "
              f"{ref / ker:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256, 2048])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--step", type=lambda s: s.split(","), default=None,
                   help=f"time whole steps' linears of these models ({', '.join(STEPS)}) instead of single shapes")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="bf16dot",
                   help="the invariant GEMM to time: linear_bf16dot (AVX512-BF16) or amx_linear (AMX)")
    args = p.parse_args(argv)
    if args.step and not set(args.step) <= set(STEPS):
        p.error(f"--step takes {', '.join(STEPS)}")
    torch.set_num_threads(1)
    available, pack, run = KERNELS[args.kernel]
    if not available():
        print(f"the {args.kernel} kernel is not built for this CPU (it needs "
              f"{'AMX' if args.kernel == 'amx' else 'AVX512-BF16'})")
        return 1
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if not onednn:
        print("this torch has no oneDNN linear to compare with")
        return 1
    g = torch.Generator().manual_seed(0)
    if args.step:
        print("| model | rows | oneDNN ms | kernel ms | oneDNN GFLOP/s | kernel GFLOP/s | kernel weights GB/s | "
              "oneDNN / kernel |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name in args.step:
            time_step(name, args.rows, args.iters, g, args.kernel)
        return 0
    print("| N x K | rows | oneDNN ms | kernel ms | oneDNN GFLOP/s | kernel GFLOP/s | oneDNN / kernel |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)   # as a model initializes
        packed = pack(w)
        reordered = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            torch.testing.assert_close(run(x, packed)[:, :n].float(),
                                       torch.nn.functional.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)
            ref = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], ""), args.iters)
            ker = best_ms(lambda: run(x, packed), args.iters)
            gf = 2 * m * n * k / 1e6
            print(f"| {n} x {k} | {m} | {ref:.2f} | {ker:.2f} | {gf / ref:.0f} | {gf / ker:.0f} | {ref / ker:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
