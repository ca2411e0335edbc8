#!/usr/bin/env python
"""The bf16-weight linear kernel (engine/csrc/linear_bf16w.cpp) against torch's float32 GEMM
(F.linear), side by side in one run: float32 math over the same bf16-valued weights, one torch
thread, Qwen3-0.6B's GEMM shapes (fused QKV is 4096 x 1024, gate/up 6144 x 1024, down 1024 x 3072),
at decode and prefill row counts. Prints ms, GFLOP/s and the ratio F.linear / kernel.

    python bench/bf16w_linear.py
    python bench/bf16w_linear.py --rows 16,128,512 --iters 10
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.drivers import best_ms  # noqa: E402
from pdserve.engine.layers import cpu_kernels  # noqa: E402

SHAPES = ((4096, 1024), (6144, 1024), (1024, 3072))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128, 512])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_kernels.bf16_linear_available():
        print("the bf16-weight kernel is not built for this CPU")
        return 1
    print(f"kernel rows where it beats oneDNN by its ISA: {cpu_kernels.bf16_linear_max_rows()}")
    print("| N x K | rows | F.linear ms | kernel ms | F.linear GFLOP/s | kernel GFLOP/s | F.linear / kernel |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).float()   # as a model initializes
        packed = cpu_kernels.pack_bf16_weight(w)
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            torch.testing.assert_close(cpu_kernels.linear_bf16w(x, packed), torch.nn.functional.linear(x, w),
                                       rtol=1e-4, atol=1e-4)
            ref = best_ms(lambda: torch.nn.functional.linear(x, w), args.iters)
            ker = best_ms(lambda: cpu_kernels.linear_bf16w(x, packed), args.iters)
            gf = 2 * m * n * k / 1e6
            print(f"| {n} x {k} | {m} | {ref:.2f} | {ker:.2f} | {gf / ref:.0f} | {gf / ker:.0f} | {ref / ker:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
