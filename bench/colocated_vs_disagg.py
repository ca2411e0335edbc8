#!/usr/bin/env python
"""Colocated against disaggregated serving, on the same machine and cores, under the same load.

For each setup it starts a real cluster with ``pdserve up`` (a subprocess: router + workers as
separate processes, loopback only, one torch thread per worker), runs ``pdserve bench serve``
against the router in this process, stops the cluster, and finally prints TTFT / ITL / TPOT /
E2E percentiles side by side with the ratio disaggregated / colocated.

* colocated:     ``pdserve up --colocated-workers 1``                  (one ``both`` worker)
* disaggregated: ``pdserve up --prefill-workers 1 --decode-workers 1``  (KV over gRPC)

Model: the deterministic ``small`` qwen3 checkpoint (bf16, 8 layers, hidden 512), made once under
``$PDSERVE_HOME/models``. Load (defaults): random 256-token prompts, 128 output tokens with
ignore_eos, greedy, Poisson arrivals at 4 requests/s, 100 prompts, 2 warmup requests.

The goal it checks for disaggregation: ITL p99 within 2x its own ITL median, with TTFT p99 no
worse than 1.5x the colocated TTFT p99. Note: the load generator and the router share the
machine's cores with the workers; the colocated setup computes on one thread, the
disaggregated one on two (one per worker). Example::

    PYTHONPATH=. python bench/colocated_vs_disagg.py --num-prompts 100 --request-rate 4
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

SETUPS = {
    "colocated": ["--colocated-workers", "1"],
    "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "always"],
}
PERCENTILES = (50, 90, 99)


def start_up(model: str, setup: str, port: int, threads: int, engine_args: list[str], log_path: Path
             ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), *SETUPS[setup], *engine_args]
    return drivers.start_up(cmd, log_path, f"[{setup}]")


def run_setup(setup: str, args: argparse.Namespace, model: str, out_dir: Path) -> dict[str, Any]:
    from pdserve.services.loadtest.serve import main as bench_main
    from pdserve.services.deployment.launcher import free_port, wait_serving

    port = free_port()
    threads = args.colocated_threads if setup == "colocated" and args.colocated_threads else args.threads
    popen = start_up(model, setup, port, threads, shlex.split(args.engine_args), out_dir / f"{setup}-up.log")
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        time.sleep(1.0)   # let the router's worker pool settle after SERVING
        result_name = f"{setup}.json"
        argv = ["--router", f"127.0.0.1:{port}", "--dataset-name", "random",
                "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                "--burstiness", "1.0", "--seed", str(args.seed), "--ignore-eos", "--num-warmups", str(args.num_warmups),
                "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", ",".join(map(str, PERCENTILES)),
                "--save-result", "--result-dir", str(out_dir), "--result-filename", result_name]
        if not args.plot:
            argv.append("--no-plot")
        t0 = time.perf_counter()
        rc = bench_main(argv)
        print(f"[{setup}] bench finished in {time.perf_counter() - t0:.1f}s (rc {rc})", flush=True)
        if rc != 0:
            raise RuntimeError(f"bench serve failed for {setup} (rc {rc})")
        return json.loads((out_dir / result_name).read_text())
    finally:
        drivers.stop_up(popen)


def _row(label: str, results: dict[str, dict[str, Any]], key: str, fmt: str = "{:.1f}") -> str:
    c, d = results.get("colocated"), results.get("disaggregated")
    cells = [fmt.format(r[key]) if r else "-" for r in (c, d)]
    ratio = f"{d[key] / c[key]:.2f}x" if c and d and c[key] else "-"
    return f"| {label} | {cells[0]} | {cells[1]} | {ratio} |"


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| metric | colocated | disaggregated | disagg / coloc |", "|---|---:|---:|---:|"]
    c, d = results.get("colocated"), results.get("disaggregated")
    lines.append(f"| completed / failed | {c['completed']} / {c['failed']} | {d['completed']} / {d['failed']} | |"
                 if c and d else "| completed / failed | - | - | |")
    lines.append(_row("duration (s)", results, "duration"))
    lines.append(_row("request throughput (req/s)", results, "request_throughput", "{:.2f}"))
    lines.append(_row("output throughput (tok/s)", results, "output_throughput"))
    for m, name in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2el", "E2E")):
        lines.append(_row(f"{name} mean (ms)", results, f"mean_{m}_ms"))
        for p in PERCENTILES:
            lines.append(_row(f"{name} p{p} (ms)", results, f"p{p}_{m}_ms"))
    # the router's own breakdown of TTFT (means over requests)
    flat = {k: {f"server_{kk}": vv for kk, vv in v.get("server_timings_mean_ms", {}).items()} for k, v in results.items()}
    if all(flat.values()):
        for key, label in (("queue_ms", "router: queue"), ("prefill_ms", "router: prefill"),
                           ("kv_transfer_ms", "router: exposed KV transfer"),
                           ("ttft_ms", "router: TTFT")):
            lines.append(_row(f"{label} mean (ms)", flat, f"server_{key}"))
    return "\n".join(lines)


def goal_check(results: dict[str, dict[str, Any]]) -> list[str]:
    c, d = results.get("colocated"), results.get("disaggregated")
    if not (c and d):
        return []
    itl_ratio = d["p99_itl_ms"] / d["p50_itl_ms"] if d["p50_itl_ms"] else float("inf")
    ttft_ratio = d["p99_ttft_ms"] / c["p99_ttft_ms"] if c["p99_ttft_ms"] else float("inf")
    return [
        f"disaggregated ITL p99 / its median = {d['p99_itl_ms']:.1f} / {d['p50_itl_ms']:.1f} = {itl_ratio:.2f}x "
        f"(goal <= 2x): {'MET' if itl_ratio <= 2 else 'NOT MET'}",
        f"disaggregated TTFT p99 / colocated TTFT p99 = {d['p99_ttft_ms']:.0f} / {c['p99_ttft_ms']:.0f} = "
        f"{ttft_ratio:.2f}x (goal <= 1.5x): {'MET' if ttft_ratio <= 1.5 else 'NOT MET'}",
        f"colocated ITL p99 / its median = {c['p99_itl_ms']:.1f} / {c['p50_itl_ms']:.1f} = "
        f"{c['p99_itl_ms'] / c['p50_itl_ms'] if c['p50_itl_ms'] else float('inf'):.2f}x (for reference)",
    ]


def build_parser() -> argparse.ArgumentParser:
    p = drivers.parser(__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the small model, made on first use)")
    p.add_argument("--setups", default="colocated,disaggregated")
    drivers.add_load_flags(p)
    p.add_argument("--colocated-threads", type=int, default=None,
                   help="torch threads of the colocated worker (default: --threads); 2 gives it the two "
                        "threads the disaggregated pair has between them")
    p.add_argument("--engine-args", default="", help="extra engine flags for every worker, e.g. "
                                                     "\"--schedule-policy mixed --max-num-batched-tokens 512\"")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each setup wait until the 1-min load average is at most this (shared machines)")
    p.add_argument("--max-wait-s", type=float, default=600.0, help="longest wait for --max-load")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setups = drivers.names(args.setups, SETUPS, "setup")
    model, out_dir = drivers.model_and_results(args, "colocated-vs-disagg")
    print(f"model {model}; {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out tokens, "
          f"Poisson {args.request_rate} req/s, {args.threads} thread(s) per worker, {os.cpu_count()} CPUs; "
          f"results in {out_dir}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    load: dict[str, list[float]] = {}
    for setup in setups:
        drivers.wait_for_quiet(args.max_load, args.max_wait_s)
        before = os.getloadavg()[0]
        results[setup] = run_setup(setup, args, model, out_dir)
        load[setup] = [round(before, 2), round(os.getloadavg()[0], 2)]
        print(f"[{setup}] 1-min load average before / after: {load[setup][0]} / {load[setup][1]}", flush=True)
    table = comparison_table(results)
    checks = goal_check(results)
    print("\n" + table + "\n")
    for line in checks:
        print(line)
    summary = {"args": vars(args), "table_markdown": table, "goal": checks, "loadavg_before_after": load,
               "results": {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)} for k, v in results.items()}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_dir / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
