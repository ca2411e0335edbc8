#!/usr/bin/env python
"""Goodput against offered load, with and without SLO admission, and vLLM-CPU at the same rates,
in one run (DistServe's measure: requests per second that meet both the TTFT and the TPOT target).

Setups, each a server on this machine (small model, loopback):

* ``disagg``:     ``pdserve up`` with 1 prefill + 1 decode worker (one thread each, each pinned to
  its own core), today's admission (a FIFO queue for decode capacity)
* ``disagg-slo``: the same with ``--slo-admission --slo-ttft-ms T --slo-tpot-ms P``: a request
  predicted to miss its TTFT target is refused at once with a retry hint, one queued past it is
  shed, a decode worker takes only requests that keep its TPOT targets
* ``colocated``:  ``pdserve up`` with 1 colocated worker, today's admission, for comparison
* ``vllm``:       vLLM-CPU's OpenAI server (``--vllm-python``, default ``$PDSERVE_VLLM_PYTHON``; vLLM
  lives in its own virtualenv, never a pdserve dependency), started as ``bench/vs_vllm.py online``
  starts it: ``VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0 python -m
  vllm.entrypoints.openai.api_server --model M --dtype D --max-model-len 2048``, its defaults
  otherwise (prefix caching on, as vLLM has it). D: ``--vllm-dtype auto``, bfloat16 where the CPU
  computes bf16 natively (AMX or AVX512-BF16), else float32. CPU: the whole machine, as the 1P1D
  deployment has it. ``bench/vs_vllm.py online`` binds vLLM's engine as at ``--threads 1``:
  ``VLLM_CPU_OMP_THREADS_BIND=0``, its one OpenMP thread on core 0, and leaves the other core to
  vLLM's API server and scheduler process, which is what vLLM's own ``auto`` binding does on 2
  cores (it reserves a core for that process); pdserve's 1P1D likewise computes on core 0
  (prefill) and core 1 (decode), its router on either. This script does the same
  (``--vllm-omp-bind 0``); ``--vllm-omp-bind 0-1`` gives vLLM's engine two OpenMP threads on both
  cores instead (its API server then shares them). Included by default when a vLLM python is
  given; without one it is skipped, saying so. Its server runs in its own process group, stopped
  as a whole (and checked) at the end, also on an error, Ctrl-C or SIGTERM.

First the capacity is measured (``disagg`` at a rate it cannot keep up with: its request
throughput), then each setup serves the same Poisson load (random prompts of ``--input-len``
tokens, ``--output-len`` output tokens with ignore_eos, greedy) at each fraction of that capacity
in ``--load-factors``, after 4 warm-up requests. One load generator measures all of them
(``services.loadtest.run.run_load``): pdserve over its router's gRPC API, vLLM over
``/v1/completions`` (``services.loadtest.openai_backend.OpenAIBackend``, the same token-id prompts,
streamed). Per point: goodput (requests within both targets, per second of the run), completed,
refused (pdserve's RESOURCE_EXHAUSTED, an HTTP 429 or 503 from vLLM) and their time to the refusal
(max, p99) and whether each carried a retry hint, other failures. The table goes to stdout, the
rows to ``slo_goodput.json`` and a plot of goodput against the offered rate to ``slo_goodput.png``
(``--out``, default ``docs/images``)::

    PYTHONPATH=. python bench/slo_goodput.py --num-prompts 60 --load-factors 0.5,1,1.5,2 \\
        --vllm-python /work/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.vs_vllm_server import add_vllm_args, check_vllm_setup, run_stopping_servers, vllm_command, vllm_server  # noqa: E402,E501
from bench.vs_vllm_commands import format_command, machine_info  # noqa: E402

SETUPS = ("disagg", "disagg-slo", "colocated", "vllm")
REFUSALS = ("RESOURCE_EXHAUSTED", "HTTP 429", "HTTP 503")   # pdserve's gRPC status, an HTTP server's


def up_flags(setup: str, ttft_ms: float, tpot_ms: float) -> list[str]:
    shape = ["--colocated-workers", "1"] if setup == "colocated" else ["--prefill-workers", "1",
                                                                        "--decode-workers", "1"]
    slo = ["--slo-admission", "--slo-ttft-ms", str(ttft_ms), "--slo-tpot-ms", str(tpot_ms)] \
        if setup == "disagg-slo" else []
    return [*shape, *slo]


def requests(n: int, input_len: int, output_len: int, seed: int, vocab: int):
    from pdserve.services.loadtest.datasets import DatasetOptions, sample_requests
    return sample_requests(DatasetOptions("random", input_len=input_len, output_len=output_len), n, vocab, seed=seed)


@dataclass
class Target:
    """A serving setup as the load generator reaches it: address, the router's gRPC address (or,
    for an HTTP server, its base URL, for messages); backend, a factory of run_load's backend for
    one load (None: the router's gRPC API at address)."""

    address: str
    backend: Callable[[], Any] | None = None


def refused(error: str) -> bool:
    return error.startswith(REFUSALS)


def point(target: Target, rate: float, args: argparse.Namespace, seed: int, vocab: int) -> dict[str, Any]:
    """One load at rate against target, summarised."""
    import numpy as np

    from pdserve.services.loadtest.results import Sampling
    from pdserve.services.loadtest.run import run_load
    reqs = requests(args.num_prompts, args.input_len, args.output_len, seed, vocab)
    backend = target.backend() if target.backend is not None else None
    results, duration = asyncio.run(run_load(target.address, reqs, rate=rate, seed=seed, backend=backend,
                                             sampling=Sampling(temperature=0.0, ignore_eos=True), tag="slo"))
    good = [r for r in results if r.success and r.ttft * 1e3 <= args.ttft_ms
            and (r.tpot is None or r.tpot * 1e3 <= args.tpot_ms)]
    refusals = [r for r in results if not r.success and refused(r.error)]
    other = [r for r in results if not r.success and not refused(r.error)]
    done = [r for r in results if r.success]
    refusal_ms = [r.error_s * 1e3 for r in refusals]
    return {"offered_rate": rate, "duration_s": duration, "completed": len(done), "refused": len(refusals),
            "failed_otherwise": len(other), "goodput": len(good) / duration,
            "throughput": len(done) / duration, "slo_attainment_of_all": len(good) / len(results),
            "ttft_p50_ms": float(np.percentile([r.ttft * 1e3 for r in done], 50)) if done else None,
            "ttft_p99_ms": float(np.percentile([r.ttft * 1e3 for r in done], 99)) if done else None,
            "refusal_max_ms": max(refusal_ms) if refusal_ms else None,
            "refusal_p99_ms": float(np.percentile(refusal_ms, 99)) if refusal_ms else None,
            "refused_with_retry_hint": sum(r.retry_after_s is not None for r in refusals),
            "shed": sum("shed" in r.error for r in refusals),
            "errors": sorted({r.error.split(";")[0][:80] for r in other})[:3]}


@contextlib.contextmanager
def pdserve_target(setup: str, args: argparse.Namespace, model: str, logs: Path,
                   flags: list[str] | None = None) -> Iterator[Target]:
    """`pdserve up` for setup (its flags: up_flags', unless given), serving; stopped (its router and
    workers) on leaving."""
    from pdserve.services.deployment.launcher import free_port as free_router_port
    from pdserve.services.deployment.launcher import wait_serving
    port = free_router_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", *(flags if flags is not None else up_flags(setup, args.ttft_ms, args.tpot_ms))]
    popen = drivers.start_up(cmd, logs / f"{setup}-up.log", f"[{setup}]")
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        time.sleep(1.0)
        yield Target(f"127.0.0.1:{port}")
    finally:
        drivers.stop_up(popen)


@contextlib.contextmanager
def vllm_target(args: argparse.Namespace, model: str, logs: Path) -> Iterator[Target]:
    """vLLM-CPU's OpenAI server (bench/vs_vllm_server.py), loaded over /v1/completions."""
    from pdserve.services.loadtest.openai_backend import OpenAIBackend
    with vllm_server(args, model, logs) as base:
        yield Target(base, lambda: OpenAIBackend(base, model=model))


def serve(setup: str, args: argparse.Namespace, model: str, logs: Path):
    return vllm_target(args, model, logs) if setup == "vllm" else pdserve_target(setup, args, model, logs)


def run_setup(setup: str, args: argparse.Namespace, model: str, logs: Path, rates: list[float]) -> list[dict]:
    from pdserve.engine.model_config import ModelConfig
    vocab = ModelConfig.from_dir(model).vocab_size
    rows = []
    with serve(setup, args, model, logs) as target:
        point(target, 2.0, argparse.Namespace(**{**vars(args), "num_prompts": 4}), 999, vocab)  # warm
        for i, rate in enumerate(rates):
            row = {"setup": setup, **point(target, rate, args, args.seed + i, vocab)}
            print(f"[{setup}] {rate:.2f} req/s: goodput {row['goodput']:.2f}, completed {row['completed']}, refused "
                  f"{row['refused']} (shed {row['shed']}, max {row['refusal_max_ms'] or 0:.0f} ms), failed otherwise "
                  f"{row['failed_otherwise']}{' ' + str(row['errors']) if row['errors'] else ''}, TTFT p99 "
                  f"{row['ttft_p99_ms'] or 0:.0f} ms", flush=True)
            rows.append(row)
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
            ax.plot([r["offered_rate"] for r in pts], [r["goodput"] for r in pts], marker="o",
                    label="vLLM-CPU" if setup == "vllm" else setup, **({"color": "black", "linestyle": "--"}
                                                                       if setup == "vllm" else {}))
    ax.axvline(capacity, color="grey", linestyle=":", label=f"capacity {capacity:.2f} req/s")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel(f"goodput (req/s, TTFT <= {args.ttft_ms:g} ms and TPOT <= {args.tpot_ms:g} ms)")
    vllm = any(r["setup"] == "vllm" for r in rows)
    ax.set_title("goodput under load: pdserve, SLO admission on and off" + (", and vLLM-CPU" if vllm else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--setups", default=None,
                   help=f"comma list of {', '.join(SETUPS)} (default: all; vllm only when a vLLM python is given)")
    p.add_argument("--load-factors", default="0.5,0.75,1,1.5,2", help="offered load as fractions of the capacity")
    p.add_argument("--capacity", type=float, default=None, help="req/s; default: measured first")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "images"))
    add_vllm_args(p)
    args = p.parse_args()
    setups = drivers.names(args.setups or ",".join(SETUPS), SETUPS, "setup")
    check_vllm_setup(p, args, setups)
    return run_stopping_servers(lambda: measure(args, setups))


def measure(args: argparse.Namespace, setups: list[str]) -> int:
    model = drivers.model_dir(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = drivers.result_dir(None, "slo-goodput")   # the deployments' logs
    print(f"servers' logs in {logs}", flush=True)
    capacity = args.capacity
    if capacity is None:   # the disaggregated deployment's throughput under more load than it can serve
        probe = run_setup("disagg", argparse.Namespace(**{**vars(args), "num_prompts": 40}), model, logs, [20.0])[0]
        capacity = probe["throughput"]
        print(f"capacity (disagg, offered 20 req/s): {capacity:.2f} req/s", flush=True)
    rates = [capacity * float(f) for f in args.load_factors.split(",")]
    rows = [row for setup in setups for row in run_setup(setup, args, model, logs, rates)]
    print(table(rows, capacity))
    record: dict[str, Any] = {"capacity": capacity, "args": vars(args), "setups": setups, "rows": rows,
                              "cpu": machine_info()["cpu_model"]}
    if "vllm" in setups:
        cmd, env = vllm_command(args, model, 0)
        record["vllm_server"] = format_command(cmd, env).replace("--port 0", "--port PORT")
    (out / "slo_goodput.json").write_text(json.dumps(record, indent=1))
    plot(rows, capacity, out / "slo_goodput.png", args)
    print(f"wrote {out / 'slo_goodput.json'} and {out / 'slo_goodput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
