#!/usr/bin/env python
"""Goodput against offered load, with and without SLO admission, in one run (DistServe's measure:
requests per second that meet both the TTFT and the TPOT target).

Setups, each a `pdserve up` on this machine (small model, one thread per worker, loopback):

* ``disagg``:     1 prefill + 1 decode worker, today's admission (a FIFO queue for decode capacity)
* ``disagg-slo``: the same with ``--slo-admission --slo-ttft-ms T --slo-tpot-ms P``: a request
  predicted to miss its TTFT target is refused at once with a retry hint, one queued past it is
  shed, a decode worker takes only requests that keep its TPOT targets
* ``colocated``:  1 colocated worker, today's admission, for comparison

First the capacity is measured (``disagg`` at a rate it cannot keep up with: its request
throughput), then each setup serves the same Poisson load (random prompts of ``--input-len``
tokens, ``--output-len`` output tokens with ignore_eos, greedy) at each fraction of that capacity
in ``--load-factors``. Per point: goodput (requests within both targets, per second of the run),
completed, refused and their time to the refusal (max, p99) and whether each carried a retry
hint. The table goes to stdout, the rows to ``slo_goodput.json`` and a plot of goodput against
the offered rate to ``slo_goodput.png`` (``--out``, default ``docs/images``)::

    PYTHONPATH=. python bench/slo_goodput.py --num-prompts 60 --load-factors 0.5,1,1.5,2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

SETUPS = ("disagg", "disagg-slo", "colocated")


def up_flags(setup: str, ttft_ms: float, tpot_ms: float) -> list[str]:
    shape = ["--colocated-workers", "1"] if setup == "colocated" else ["--prefill-workers", "1",
                                                                        "--decode-workers", "1"]
    slo = ["--slo-admission", "--slo-ttft-ms", str(ttft_ms), "--slo-tpot-ms", str(tpot_ms)] \
        if setup == "disagg-slo" else []
    return [*shape, *slo]


def requests(n: int, input_len: int, output_len: int, seed: int, vocab: int):
    from services.loadtest.datasets import DatasetOptions, sample_requests
    return sample_requests(DatasetOptions("random", input_len=input_len, output_len=output_len), n, vocab, seed=seed)


def point(address: str, rate: float, args: argparse.Namespace, seed: int, vocab: int) -> dict[str, Any]:
    """One load at rate against the router at address, summarised."""
    import numpy as np

    from services.loadtest.results import Sampling
    from services.loadtest.run import run_load
    reqs = requests(args.num_prompts, args.input_len, args.output_len, seed, vocab)
    results, duration = asyncio.run(run_load(address, reqs, rate=rate, seed=seed,
                                             sampling=Sampling(temperature=0.0, ignore_eos=True), tag="slo"))
    good = [r for r in results if r.success and r.ttft * 1e3 <= args.ttft_ms
            and (r.tpot is None or r.tpot * 1e3 <= args.tpot_ms)]
    refused = [r for r in results if not r.success and r.error.startswith("RESOURCE_EXHAUSTED")]
    other = [r for r in results if not r.success and not r.error.startswith("RESOURCE_EXHAUSTED")]
    done = [r for r in results if r.success]
    refusal_ms = [r.error_s * 1e3 for r in refused]
    return {"offered_rate": rate, "duration_s": duration, "completed": len(done), "refused": len(refused),
            "failed_otherwise": len(other), "goodput": len(good) / duration,
            "throughput": len(done) / duration, "slo_attainment_of_all": len(good) / len(results),
            "ttft_p50_ms": float(np.percentile([r.ttft * 1e3 for r in done], 50)) if done else None,
            "ttft_p99_ms": float(np.percentile([r.ttft * 1e3 for r in done], 99)) if done else None,
            "refusal_max_ms": max(refusal_ms) if refusal_ms else None,
            "refusal_p99_ms": float(np.percentile(refusal_ms, 99)) if refusal_ms else None,
            "refused_with_retry_hint": sum(r.retry_after_s is not None for r in refused),
            "shed": sum("shed" in r.error for r in refused),
            "errors": sorted({r.error.split(";")[0][:80] for r in other})[:3]}


def run_setup(setup: str, args: argparse.Namespace, model: str, logs: Path, rates: list[float]) -> list[dict]:
    from services.deployment.launcher import free_port, wait_serving
    from engine.model_config import ModelConfig
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", *up_flags(setup, args.ttft_ms, args.tpot_ms)]
    popen = drivers.start_up(cmd, logs / f"{setup}-up.log", f"[{setup}]")
    rows = []
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        time.sleep(1.0)
        vocab = ModelConfig.from_dir(model).vocab_size
        point(f"127.0.0.1:{port}", 2.0, argparse.Namespace(**{**vars(args), "num_prompts": 4}), 999, vocab)  # warm
        for i, rate in enumerate(rates):
            row = {"setup": setup, **point(f"127.0.0.1:{port}", rate, args, args.seed + i, vocab)}
            print(f"[{setup}] {rate:.2f} req/s: goodput {row['goodput']:.2f}, completed {row['completed']}, refused "
                  f"{row['refused']} (shed {row['shed']}, max {row['refusal_max_ms'] or 0:.0f} ms), TTFT p99 "
                  f"{row['ttft_p99_ms'] or 0:.0f} ms", flush=True)
            rows.append(row)
    finally:
        drivers.stop_up(popen)
    return rows


def table(rows: list[dict], capacity: float) -> str:
    lines = ["| setup | offered (req/s) | x capacity | goodput (req/s) | completed | refused (shed) | refusal max / p99 "
             "(ms) | with retry hint | TTFT p50 / p99 (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = f"{r['refusal_max_ms']:.0f} / {r['refusal_p99_ms']:.0f}" if r["refused"] else "-"
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}" if r["ttft_p50_ms"] is not None else "-"
        lines.append(f"| {r['setup']} | {r['offered_rate']:.2f} | {r['offered_rate'] / capacity:.2f} | "
                     f"{r['goodput']:.2f} | {r['completed']} | {r['refused']} ({r['shed']}) | {ref} | "
                     f"{r['refused_with_retry_hint']} | {ttft} |")
    return "\n".join(lines)


def plot(rows: list[dict], capacity: float, path: Path, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setup in SETUPS:
        pts = [r for r in rows if r["setup"] == setup]
        if pts:
            ax.plot([r["offered_rate"] for r in pts], [r["goodput"] for r in pts], marker="o", label=setup)
    ax.axvline(capacity, color="grey", linestyle=":", label=f"capacity {capacity:.2f} req/s")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel(f"goodput (req/s, TTFT <= {args.ttft_ms:g} ms and TPOT <= {args.tpot_ms:g} ms)")
    ax.set_title("pdserve goodput under load, SLO admission on and off")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--load-factors", default="0.5,0.75,1,1.5,2", help="offered load as fractions of the capacity")
    p.add_argument("--capacity", type=float, default=None, help="req/s; default: measured first")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "images"))
    args = p.parse_args()
    model = drivers.model_dir(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = drivers.result_dir(None, "slo-goodput")   # the deployments' logs
    setups = drivers.names(args.setups, SETUPS, "setup")
    capacity = args.capacity
    if capacity is None:   # the disaggregated deployment's throughput under more load than it can serve
        probe = run_setup("disagg", argparse.Namespace(**{**vars(args), "num_prompts": 40}), model, logs, [20.0])[0]
        capacity = probe["throughput"]
        print(f"capacity (disagg, offered 20 req/s): {capacity:.2f} req/s", flush=True)
    rates = [capacity * float(f) for f in args.load_factors.split(",")]
    rows = [row for setup in setups for row in run_setup(setup, args, model, logs, rates)]
    print(table(rows, capacity))
    (out / "slo_goodput.json").write_text(json.dumps({"capacity": capacity, "args": vars(args), "rows": rows,
                                                      "cpu": drivers_cpu()}, indent=1))
    plot(rows, capacity, out / "slo_goodput.png", args)
    print(f"wrote {out / 'slo_goodput.json'} and {out / 'slo_goodput.png'}")
    return 0


def drivers_cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return os.uname().machine


if __name__ == "__main__":
    sys.exit(main())
