#!/usr/bin/env python
"""The planner's predictions against measurements, side by side, in one run.

For each setup (colocated: ``pdserve up --colocated-workers 1``; 1P1D: ``--prefill-workers 1
--decode-workers 1``; one torch thread per worker, engine defaults) and each request rate, it
predicts bench serve's metrics with the simulator (services/planner/simulator.py on the profile's cost
model) and measures them (``pdserve bench serve`` against a real ``pdserve up``, same dataset,
seed and arrivals), then prints TTFT and ITL p50/p99 predicted / measured / error, and whether
the planner ranks the setups in the order the measurements do. With --slo it also prints SLO
attainment against rate (the share of requests meeting every SLO, as DistServe plots it),
predicted and measured, and with --plot draws those curves. Before each measurement it waits
(up to --max-wait-s) until the 1-minute load average is below --max-load and reports it. The load
generator runs on the same machine: its CPU per output token, measured in each run, is part of
that run's prediction (the simulator puts it on a core the router is not pinned to).

    PYTHONPATH=. python bench/planner_accuracy.py --profile $PDSERVE_HOME/profiles/small.json --rates 2,4
    PYTHONPATH=. python bench/planner_accuracy.py --profile P.json --rates 1,2,3,4 --slo ttft:1000,tpot:100 \
        --plot slo.png
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.colocated_vs_disagg import start_up  # noqa: E402
from bench import drivers  # noqa: E402

SETUPS = {"colocated": "colocated", "1P1D": "disaggregated"}
SETUP_CORES = {"colocated": 1, "1P1D": 2}   # one torch thread per worker, a core each
METRICS = (("ttft", 50), ("ttft", 99), ("itl", 50), ("itl", 99), ("tpot", 50), ("tpot", 99))
LOCK = Path("/tmp/pdserve-benchmark.lock")


def candidate(setup: str, threads: int):
    from pdserve.services.planner.simulator import Candidate
    if setup == "colocated":
        return Candidate(colocated_workers=1, threads_per_worker=threads)
    return Candidate(prefill_workers=1, decode_workers=1, threads_per_worker=threads)


def wait_quiet(max_load: float, max_wait_s: float) -> float:
    """Wait until nobody else benchmarks (the lock file is absent) and the 1-min load is below
    max_load, at most max_wait_s; returns the load average at the start of the measurement."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline and (LOCK.exists() or os.getloadavg()[0] >= max_load):
        why = "someone else is benchmarking" if LOCK.exists() else f"load {os.getloadavg()[0]:.2f} >= {max_load}"
        print(f"waiting: {why}", flush=True)
        time.sleep(15)
    return os.getloadavg()[0]


def measure(port: int, args: argparse.Namespace, rate: float, seed: int, out_dir: Path, name: str) -> dict[str, Any]:
    from pdserve.services.loadtest.serve import main as bench_main
    argv = ["--router", f"127.0.0.1:{port}", "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos", "--num-warmups", str(args.num_warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--no-plot", "--no-progress"]
    cpu0 = time.process_time()
    if bench_main(argv) != 0:
        raise RuntimeError(f"bench serve failed ({name})")
    result = json.loads((out_dir / name).read_text())
    # the load generator's own CPU per output token: it shares this machine with the deployment
    client = (time.process_time() - cpu0) / max(1, result.get("total_output_tokens") or sum(result["output_lens"]))
    (out_dir / name).with_suffix(".client").write_text(f"{client:.6g}\n")
    return result


def measured_attainment(result: dict[str, Any], slos: dict[str, float]) -> float:
    """Share of a bench serve run's requests meeting every SLO (failed requests miss), by bench
    serve's own goodput rule (calculate_metrics)."""
    from pdserve.services.loadtest.metrics import calculate_metrics
    from pdserve.services.loadtest.results import RequestResult
    requests = [RequestResult(success=not err, output_len=n, ttft=ttft, latency=e2el)
                for err, n, ttft, e2el in zip(result["errors"], result["output_lens"], result["ttfts"], result["e2els"])]
    if not requests:
        return float("nan")
    duration = float(result["duration"])
    return calculate_metrics(requests, duration, (50,), slos)["request_goodput"] * duration / len(requests)


def attainment_table(rows: list[dict[str, Any]], slos: dict[str, float]) -> str:
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
    lines = [f"SLO attainment ({slo_text}), predicted / measured", "",
             "| rate (req/s) | " + " | ".join(setups) + " |", "|---|" + "---|" * len(setups)]
    for rate in sorted({r["rate"] for r in rows}):
        cells = []
        for setup in setups:
            r = next((r for r in rows if r["setup"] == setup and r["rate"] == rate), None)
            pred, meas = (r["attainment"] if r else (None, None))
            cells.append(f"{pred:.0%} / " + ("-" if meas is None else f"{meas:.0%}") if pred is not None else "-")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    # the planner's own objective: goodput per core (requests within every SLO per second per core)
    lines.append("")
    for rate in sorted({r["rate"] for r in rows}):
        rs = [r for r in rows if r["rate"] == rate and r["attainment"][1] is not None]
        if len(rs) > 1:
            per_core = {side: {r["setup"]: r["attainment"][side] * rate / SETUP_CORES[r["setup"]] for r in rs}
                        for side in (0, 1)}
            order_p, order_m = (sorted(per_core[side], key=lambda k: -per_core[side][k]) for side in (0, 1))
            lines.append(f"rate {rate:g}, goodput per core: predicted " + ", ".join(
                f"{k} {per_core[0][k]:.2f}" for k in order_p) + "; measured " + ", ".join(
                f"{k} {per_core[1][k]:.2f}" for k in order_m) + f": {'same' if order_p == order_m else 'DIFFERENT'}")
    return "\n".join(lines)


def plot_attainment(rows: list[dict[str, Any]], slos: dict[str, float], path: Path, commit: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, setup in enumerate(dict.fromkeys(r["setup"] for r in rows)):
        rs = sorted((r for r in rows if r["setup"] == setup), key=lambda r: r["rate"])
        color = f"C{i}"
        ax.plot([r["rate"] for r in rs], [100 * r["attainment"][0] for r in rs], "--", color=color,
                label=f"{setup} predicted")
        meas = [r for r in rs if r["attainment"][1] is not None]
        if meas:
            ax.plot([r["rate"] for r in meas], [100 * r["attainment"][1] for r in meas], "o-", color=color,
                    label=f"{setup} measured")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-5, 105)
    ax.set_title(", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) + f" ({commit[:7]})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="the cost model `pdserve profile` wrote for --model")
    p.add_argument("--profile-first", action="store_true",
                   help="(re)make --profile first with `pdserve profile` (default sweep), on a quiet machine")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the small model)")
    p.add_argument("--setups", default="colocated,1P1D")
    p.add_argument("--rates", default="2,4")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="rate i uses seed + i (fresh prompts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--max-wait-s", type=float, default=600.0)
    p.add_argument("--slo", action="append", default=[], metavar="METRIC:MS",
                   help="SLO for the attainment curve, e.g. ttft:1000,tpot:100 (repeatable; as `pdserve plan --slo`)")
    p.add_argument("--plot", default=None, help="with --slo: draw SLO attainment against rate into this PNG")
    p.add_argument("--predict-only", action="store_true", help="print the predictions, measure nothing")
    p.add_argument("--client-ms-per-token", type=float, default=0.0,
                   help="the load generator's CPU per token where not measured (--predict-only, or a "
                        "--measured-dir without .client files); measured runs use their own")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--measured-dir", default=None,
                   help="compare with the measurements of earlier runs (their --result-dir, comma-separated) "
                        "instead of measuring")
    args = p.parse_args(argv)

    from pdserve.services.planner.cost_model import CostModel
    from pdserve.services.planner.plan import Workload, parse_slos, simulate
    from pdserve.services.planner.simulator import Overheads
    from pdserve.services.deployment.launcher import free_port, wait_serving

    model = drivers.model_dir(args.model)
    if args.profile_first:
        load = wait_quiet(args.max_load, args.max_wait_s)
        print(f"profiling (1-min load average {load:.2f})", flush=True)
        subprocess.run(["nice", "-n", "10", sys.executable, "-m", "pdserve.services.cli", "profile", "--model", model,
                        "--threads", str(args.threads), "--out", args.profile], cwd=REPO_ROOT, check=True)
    slos = parse_slos(args.slo)
    if args.plot and not slos:
        p.error("--plot draws SLO attainment: give --slo")
    cost = CostModel.load(args.profile)
    rates = [float(r) for r in args.rates.split(",")]
    setups = [s for s in args.setups.split(",") if s]
    out_dir = drivers.result_dir(args.result_dir, "planner-accuracy")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; model {model}; {args.num_prompts} prompts {args.input_len} in / {args.output_len} out; "
          f"rates {rates}; results in {out_dir}", flush=True)
    rows: list[dict[str, Any]] = []
    for setup in setups:
        cand = candidate(setup, args.threads)
        measured: dict[float, dict[str, Any]] = {}
        loads: dict[float, float] = {}
        client_s = {rate: args.client_ms_per_token / 1e3 for rate in rates}
        if args.measured_dir:
            for d in args.measured_dir.split(","):   # one or more earlier --result-dir: SETUP-RATE.json (+ .load)
                for rate in rates:
                    path = Path(d) / f"{setup}-{rate:g}.json"
                    if path.is_file():
                        measured[rate] = json.loads(path.read_text())
                        if path.with_suffix(".client").is_file():
                            client_s[rate] = float(path.with_suffix(".client").read_text())
                        load_file = path.with_suffix(".load")
                        loads[rate] = float(load_file.read_text()) if load_file.is_file() else None
        elif not args.predict_only:
            loads_start = wait_quiet(args.max_load, args.max_wait_s)
            port = free_port()
            popen = start_up(model, SETUPS[setup], port, args.threads, [], out_dir / f"{setup}-up.log")
            try:
                wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
                time.sleep(1.0)
                for i, rate in enumerate(rates):
                    loads[rate] = wait_quiet(args.max_load, args.max_wait_s) if i else max(loads_start,
                                                                                        os.getloadavg()[0])
                    print(f"[{setup} @ {rate:g}/s] measuring, 1-min load average {loads[rate]:.2f}", flush=True)
                    measured[rate] = measure(port, args, rate, args.seed + i, out_dir, f"{setup}-{rate:g}.json")
                    client_s[rate] = float((out_dir / f"{setup}-{rate:g}.client").read_text())
                    (out_dir / f"{setup}-{rate:g}.load").write_text(f"{loads[rate]:.2f}\n")
            finally:
                drivers.stop_up(popen)
        predicted = {}
        for i, rate in enumerate(rates):   # after measuring: the client's CPU on this machine is known
            t0 = time.perf_counter()
            m = simulate(cost, cand, Workload(rate, args.num_prompts, args.input_len, args.output_len, seed=args.seed + i),
                         Overheads(client_s_per_token=client_s[rate]), slos=slos or None)
            predicted[rate] = {k: v for k, v in m.items() if not isinstance(v, list) and k != "simulation"}
            print(f"[{setup} @ {rate:g}/s] predicted in {time.perf_counter() - t0:.1f}s (client "
                  f"{client_s[rate] * 1e3:.2f} ms CPU/token): TTFT p50 {m['p50_ttft_ms']:.0f} ms, ITL p50 "
                  f"{m['p50_itl_ms']:.1f} ms", flush=True)
        for rate in rates:
            row = {"setup": setup, "rate": rate, "load": loads.get(rate), "predicted": predicted[rate],
                   "measured": {k: v for k, v in measured.get(rate, {}).items() if not isinstance(v, list)}}
            if slos:
                row["attainment"] = (predicted[rate]["slo_attainment"],
                                     measured_attainment(measured[rate], slos) if rate in measured else None)
            rows.append(row)
    print("\n" + table(rows, commit))
    if slos:
        print("\n" + attainment_table(rows, slos))
        if args.plot:
            plot_attainment(rows, slos, Path(args.plot), commit)
            print(f"wrote {args.plot}")
    (out_dir / "summary.json").write_text(json.dumps({"commit": commit, "args": vars(args), "rows": rows}, indent=1))
    print(f"\nwrote {out_dir / 'summary.json'}")
    return 0


def _within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def table(rows: list[dict[str, Any]], commit: str) -> str:
    head = "| setup | rate (req/s) | load before | " + " | ".join(
        f"{m.upper()} p{p} pred / meas (ms)" for m, p in METRICS) + " |"
    lines = [f"commit `{commit}`", "", head, "|" + "---|" * (3 + len(METRICS))]
    errors = []
    for r in rows:
        cells = []
        for m, p in METRICS:
            key = f"p{p}_{m}_ms"
            pred, meas = r["predicted"].get(key), r["measured"].get(key)
            if meas:
                err = (pred - meas) / meas
                errors.append(abs(err)) if m in ("ttft", "itl") else None
                cells.append(f"{pred:.1f} / {meas:.1f} ({err:+.0%})")
            else:
                cells.append(f"{pred:.1f} / -")
        load = f"{r['load']:.2f}" if r["load"] is not None else "-"
        lines.append(f"| {r['setup']} | {r['rate']:g} | {load} | " + " | ".join(cells) + " |")
    if errors:
        within = sum(1 for e in errors if e <= 0.25)
        lines.append(f"\nTTFT/ITL p50/p99 within 25%: {within} of {len(errors)}")
    # ranking: per rate, do predictions order the setups (by TTFT p99, ITL p99) as measurements do?
    for rate in sorted({r["rate"] for r in rows}):
        rs = [r for r in rows if r["rate"] == rate and r["measured"]]
        for key in ("p99_ttft_ms", "p99_itl_ms"):
            if len(rs) > 1:
                order_p = [r["setup"] for r in sorted(rs, key=lambda r: r["predicted"][key])]
                order_m = [r["setup"] for r in sorted(rs, key=lambda r: r["measured"][key])]
                verdict = "same" if order_p == order_m else "DIFFERENT"
                if verdict != "same" and len(rs) == 2 and all(_within(rs[0][side][key], rs[1][side][key], 0.05)
                                                              for side in ("predicted", "measured")):
                    verdict = "a tie (both within 5%)"
                lines.append(f"rate {rate:g}, {key}: predicted order {order_p}, measured {order_m}: {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
