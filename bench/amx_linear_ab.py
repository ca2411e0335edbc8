#!/usr/bin/env python
"""The AMX GEMM (``pd_amx_linear_q``, engine/csrc/amx_linear.cpp) of this tree against the same
kernel built from another checkout, in one process: the two libraries take turns call by call and
each keeps its fastest of --reps calls, so a machine whose speed swings (a shared VM's AMX unit
ran at half rate for seconds at a time) slows both alike. One thread, bf16 weights, the small
model's and Qwen3-0.6B's GEMM shapes, decode and prefill row counts; also checks both libraries
give the same bits. --step times a whole Qwen3-0.6B step's linears instead (28 layers, each its
own weights, 1 GB: they stream from memory, as in a real step, where one shape's stay in cache).
Needs a CPU with AMX.

    git worktree add /tmp/base HEAD~1
    python bench/amx_linear_ab.py --baseline-tree /tmp/base
    python bench/amx_linear_ab.py --baseline-tree /tmp/base --step --rows 1,16,64,512,2048
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdserve.engine.layers import cpu_kernels  # noqa: E402

SHAPES = ((1024, 512), (3072, 512), (512, 1536), (8192, 512), (4096, 1024), (6144, 1024), (1024, 3072))
QWEN3_STEP = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)) * 28   # one step's linears, (N, K)
BUILD = ("from engine.kernel_build import build_library; from engine.layers.cpu_kernels import CSRC, SOURCES, FLAGS; "
         "print(build_library('pd_cpu_kernels', [CSRC / s for s in SOURCES], FLAGS))")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def baseline_library(tree: Path) -> ctypes.CDLL:
    """The kernel library as the other checkout builds it (cached under $PDSERVE_HOME by its hash)."""
    out = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, timeout=600, check=True)
    lib = ctypes.CDLL(out.stdout.strip().splitlines()[-1])
    lib.pd_amx_linear_q.argtypes = [_P, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I64]
    lib.pd_amx_linear_q.restype = ctypes.c_int
    if lib.pd_amx_init() != 1:
        raise SystemExit("the baseline library has no AMX")
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of the commit to compare with")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256, 1024])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--step", action="store_true", help="a whole Qwen3-0.6B step's linears, streaming from memory")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_kernels.amx_available():
        print("no AMX on this CPU (or no C++ compiler)")
        return 1
    libs = {"baseline": baseline_library(args.baseline_tree), "this tree": cpu_kernels.load()}
    g = torch.Generator().manual_seed(0)
    print("| N x K | rows | baseline GFLOP/s | this tree GFLOP/s | this tree / baseline |")
    print("|---|---:|---:|---:|---:|")
    groups = [QWEN3_STEP] if args.step else [(shape,) for shape in SHAPES]
    for shapes in groups:
        packed = [cpu_kernels.pack_amx_weight((torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16))
                  for n, k in shapes]
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in shapes}
            ys = {name: [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in shapes] for name in libs}
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(args.reps + 1):
                for name, lib in libs.items():
                    t0 = time.perf_counter()
                    for (n, k), w, y in zip(shapes, packed, ys[name]):
                        rc = lib.pd_amx_linear_q(xs[k].data_ptr(), m, k, w.data_ptr(), n, None, None, y.data_ptr(),
                                                 0, n // 64)
                        assert rc == 0, rc
                    best[name] = min(best[name], time.perf_counter() - t0)
            assert all(torch.equal(a, b) for a, b in zip(ys["baseline"], ys["this tree"])), (shapes[0], m)
            gflop = sum(2 * m * n * k for n, k in shapes) / 1e9
            label = "Qwen3-0.6B step" if args.step else f"{shapes[0][0]} x {shapes[0][1]}"
            print(f"| {label} | {m} | {gflop / best['baseline']:.0f} | {gflop / best['this tree']:.0f} | "
                  f"{best['baseline'] / best['this tree']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
