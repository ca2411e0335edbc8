#!/usr/bin/env python
"""Served throughput and latency of two source trees, side by side and interleaved: each round
starts `pdserve up` (1 prefill + 1 decode worker, one thread each, loopback) from one tree, runs
the same load against it with this checkout's load generator, and stops it; then the other tree.
For a change to the serving path that the offline benchmark does not run (the router, the
workers' RPCs): e.g. tracing, off by default, against the tree before it::

    git archive 9c17da0~1 | (mkdir -p /tmp/pd-base && tar -x -C /tmp/pd-base)
    PYTHONPATH=. python bench/ab_serving.py /tmp/pd-base . --rounds 3

Per run: output tok/s over the run, TTFT p50/p99, ITL p50 (a burst of ``--num-prompts``
requests at ``--request-rate``, random prompts of ``--input-len`` tokens, ``--output-len``
tokens each with ignore_eos, greedy). Then the mean of each tree and the ratio new/old.
"""
from __future__ import annotations

import argparse
import os
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402


def one_run(tree: Path, args: argparse.Namespace, model: str, logs: Path, tag: str) -> dict[str, float]:
    import numpy as np

    from pdserve.engine.model_config import ModelConfig
    from pdserve.services.deployment.launcher import free_port, wait_serving
    from pdserve.services.loadtest.datasets import DatasetOptions, sample_requests
    from pdserve.services.loadtest.results import Sampling
    from pdserve.services.loadtest.run import run_load
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", "--prefill-workers", "1", "--decode-workers", "1"]
    print(f"[{tag}] {tree}: {' '.join(cmd)}", flush=True)
    popen = subprocess.Popen(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                             stdout=open(logs / f"{tag}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        vocab = ModelConfig.from_dir(model).vocab_size
        sampling = Sampling(temperature=0.0, ignore_eos=True)
        warm = sample_requests(DatasetOptions("random", input_len=args.input_len, output_len=8), 4, vocab, seed=99)
        asyncio.run(run_load(f"127.0.0.1:{port}", warm, rate=float("inf"), seed=99, sampling=sampling, tag="warm"))
        reqs = sample_requests(DatasetOptions("random", input_len=args.input_len, output_len=args.output_len),
                               args.num_prompts, vocab, seed=args.seed)
        results, duration = asyncio.run(run_load(f"127.0.0.1:{port}", reqs, rate=args.request_rate, seed=args.seed,
                                                 sampling=sampling, tag="ab"))
    finally:
        drivers.stop_up(popen)
    done = [r for r in results if r.success]
    if len(done) != len(results):
        raise RuntimeError(f"{len(results) - len(done)} request(s) failed on {tree}: {results[0].error}")
    itl = [gap for r in done for gap in r.itl]
    return {"tok_s": sum(r.output_len for r in done) / duration,
            "ttft_p50_ms": float(np.percentile([r.ttft * 1e3 for r in done], 50)),
            "ttft_p99_ms": float(np.percentile([r.ttft * 1e3 for r in done], 99)),
            "itl_p50_ms": float(np.percentile(itl, 50) * 1e3) if itl else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = drivers.model_dir(args.model)
    logs = drivers.result_dir(None, "ab-serving")
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for side in ("old", "new"):
            load = open("/proc/loadavg").read().split()[0]
            row = one_run(getattr(args, side).resolve(), args, model, logs, f"{side}-{i}")
            runs[side].append(row)
            print(f"{time.strftime('%H:%M:%S')} load={load} {side} round {i + 1}: {row['tok_s']:.1f} tok/s, "
                  f"TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms, "
                  f"ITL p50 {row['itl_p50_ms']:.1f} ms", flush=True)
    print("| metric | old (mean of runs) | new (mean of runs) | new / old |\n|---|---:|---:|---:|")
    for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"):
        old, new = (statistics.mean(r[key] for r in runs[s]) for s in ("old", "new"))
        print(f"| {key} | {old:.1f} | {new:.1f} | {new / old:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
