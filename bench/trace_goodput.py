#!/usr/bin/env python
"""SLO attainment and goodput on a production trace, pdserve against vLLM-CPU, side by side in one
run (DistServe's and Mooncake's measure: the share of requests within a TTFT and a TPOT target).

The trace (``--trace``: a Mooncake / AIPerf JSON-lines trace, e.g. ``FAST25-release/traces/
conversation_trace.jsonl`` from github.com/kvcache-ai/Mooncake) is replayed as ``pdserve bench
serve --dataset-name mooncake_trace`` replays it (services/loadtest/traces.py): a slice of
``--num-prompts`` rows from ``--trace-start``, each 512-token block -> ``--token-scale`` x 512
tokens with the same content wherever its hash id appears, outputs x ``--output-scale``, arrivals
rescaled to each rate of ``--rates`` (req/s), greedy. One load generator measures every setup:

* ``default``:      ``pdserve up`` with 1 prefill + 1 decode worker and nothing else: ``pdserve
  serve``'s deployment (conditional disaggregation, shortest-first prompt order)
* ``disagg``:       the same with ``--disaggregation always --prompt-order fcfs`` (every prompt on the
  prefill worker, in arrival order: the deployment before those defaults)
* ``conditional``:  the same with ``--disaggregation conditional --prompt-order fcfs`` (short
  prompts prefilled on the decode worker when that is cheaper, in arrival order)
* ``colocated``:    ``pdserve up`` with 1 colocated worker
* ``planned``:      the deployment ``pdserve plan --objective goodput`` picks for the slice at each
  rate (``--profile``: the cost model ``pdserve profile`` measured on this machine; every
  candidate that fits in this machine's cores, both disaggregation modes)
* ``vllm``:         vLLM-CPU's OpenAI server, started as ``bench/slo_goodput.py`` starts it
  (``--vllm-python``, default ``$PDSERVE_VLLM_PYTHON``) but with ``--max-model-len 4096`` (the
  small model's, pdserve's default), over ``/v1/completions``

pdserve is loaded over its router's gRPC API, vLLM over HTTP (the same token-id prompts,
streamed). With ``--profile``, each pdserve setup's row also carries the planner's prediction of
it (its simulator on the same slice, seed and targets): attainment and TTFT p50/p99 predicted
beside the measured ones. Per point: attainment (requests within both targets / requests sent), goodput (those
per second of the run), TTFT p50/p90/p99, TPOT p50/p90, failures; the table to stdout, the rows to
``trace_goodput.json`` and attainment against rate to ``trace_goodput.png`` in ``--out``::

    PYTHONPATH=. python bench/trace_goodput.py --trace conversation_trace.jsonl --num-prompts 240 \\
        --rates 2,3,4 --vllm-python /work/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.slo_goodput import Target, pdserve_target  # noqa: E402
from bench.vs_vllm_server import (add_vllm_args, check_vllm_setup, run_stopping_servers, vllm_command,  # noqa: E402
                                  vllm_server)
from bench.vs_vllm_commands import format_command, machine_info  # noqa: E402

SETUPS = ("default", "disagg", "conditional", "colocated", "planned", "vllm")
MAX_MODEL_LEN = 4096   # the trace's longest prompts scaled 1/32 and their outputs pass 2048 (the small model: 4096)
ONE_ONE = ["--prefill-workers", "1", "--decode-workers", "1"]
UP_FLAGS = {"default": ONE_ONE,
            "disagg": [*ONE_ONE, "--disaggregation", "always", "--prompt-order", "fcfs"],
            "conditional": [*ONE_ONE, "--disaggregation", "conditional", "--prompt-order", "fcfs"],
            "colocated": ["--colocated-workers", "1"]}
PLAN_CHUNK_BUDGETS = (256, 512, 2048)


def setup_candidate(setup: str):
    """The planner's Candidate for a fixed setup (what its UP_FLAGS deploy)."""
    from pdserve.services.planner.simulator import Candidate
    from pdserve.services.router.config import GenerationOptions
    if setup == "colocated":
        return Candidate(colocated_workers=1)
    flags = UP_FLAGS[setup]
    mode = (flags[flags.index("--disaggregation") + 1] if "--disaggregation" in flags
            else GenerationOptions().disaggregation)   # the router's default
    order = flags[flags.index("--prompt-order") + 1] if "--prompt-order" in flags else None
    return Candidate(prefill_workers=1, decode_workers=1, disaggregation=mode, prompt_order=order)


def predict(cost, candidate, args: argparse.Namespace, rate: float, seed: int) -> dict[str, Any]:
    """The planner's simulation of candidate on the point's slice (services/planner/plan.py)."""
    from pdserve.services.planner.plan import TraceReplay, simulate
    m = simulate(cost, candidate, TraceReplay(slice_options(args, rate), args.num_prompts, seed),
                 slos={"ttft": args.ttft_ms, "tpot": args.tpot_ms})
    return {"candidate": candidate.name, "up_flags": candidate.up_flags(), "attainment": m["slo_attainment"],
            "ttft_p50_ms": m["p50_ttft_ms"], "ttft_p99_ms": m["p99_ttft_ms"], "tpot_p50_ms": m["p50_tpot_ms"],
            "local_prefills": m["local_prefills"]}


def plan_pick(cost, args: argparse.Namespace, rate: float, seed: int):
    """`pdserve plan --objective goodput`'s pick for the point: the candidate with the most
    requests within the targets on this machine's cores."""
    import os

    from pdserve.services.planner.plan import TraceReplay, candidates, rank, simulate
    replay = TraceReplay(slice_options(args, rate), args.num_prompts, seed)
    slos = {"ttft": args.ttft_ms, "tpot": args.tpot_ms}
    cands = candidates(os.cpu_count() or 1, PLAN_CHUNK_BUDGETS, ("auto", "mixed", "prefill_first", "interleave"),
                       disaggregations=("always", "conditional"))
    return rank([(c, simulate(cost, c, replay, slos=slos)) for c in cands], "goodput")[0][0]


def slice_options(args: argparse.Namespace, rate: float):
    """The slice's TraceOptions, its arrivals rescaled to rate."""
    from pdserve.services.loadtest.traces import TraceOptions
    return TraceOptions(args.trace, start=args.trace_start, token_scale=args.token_scale,
                        output_scale=args.output_scale, rate=rate)


def workload(args: argparse.Namespace, rate: float, vocab: int, seed: int):
    """The slice at rate; seed draws the blocks' tokens: a fresh one per point, so that no point
    finds the previous one's prompts in a server's prefix cache (the trace's own sharing stays)."""
    from pdserve.services.loadtest.traces import load_trace
    return load_trace(slice_options(args, rate), args.num_prompts, vocab, seed=seed)


def point(target, rate: float, args: argparse.Namespace, vocab: int, seed: int) -> dict[str, Any]:
    import numpy as np

    from pdserve.services.loadtest.results import Sampling
    from pdserve.services.loadtest.run import run_load
    replay = workload(args, rate, vocab, seed)
    backend = target.backend() if target.backend is not None else None
    results, duration = asyncio.run(run_load(target.address, replay.requests, rate=rate, offsets=replay.offsets,
                                             backend=backend, sampling=Sampling(temperature=0.0, ignore_eos=True),
                                             tag="trace"))
    done = [r for r in results if r.success]

    def within(ttft_ms: float) -> list:
        return [r for r in done if r.ttft * 1e3 <= ttft_ms and (r.tpot or 0.0) * 1e3 <= args.tpot_ms]
    good = within(args.ttft_ms)

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None
    ttft = [r.ttft * 1e3 for r in done]
    tpot = [r.tpot * 1e3 for r in done if r.tpot is not None]
    return {"rate": rate, "duration_s": duration, "sent": len(results), "completed": len(done),
            "failed": len(results) - len(done), "attainment": len(good) / len(results),
            "goodput": len(good) / duration, "throughput": len(done) / duration,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p90_ms": pct(tpot, 90),
            "attainment_at_ttft_ms": {f"{ms:g}": len(within(ms)) / len(results) for ms in args.also_ttft_ms},
            "prompt_tokens": sum(r.prompt_len for r in replay.requests), "shared_blocks": replay.shared_blocks,
            "errors": sorted({r.error.split(";")[0][:80] for r in results if not r.success})[:3]}


@contextlib.contextmanager
def vllm_target(args: argparse.Namespace, model: str, logs: Path) -> Iterator[Target]:
    """vLLM-CPU's OpenAI server at MAX_MODEL_LEN (pdserve's default: the model's own), over /v1/completions."""
    from pdserve.services.loadtest.openai_backend import OpenAIBackend
    with vllm_server(args, model, logs, max_model_len=MAX_MODEL_LEN) as base:
        yield Target(base, lambda: OpenAIBackend(base, model=model))


def run_setup(setup: str, args: argparse.Namespace, model: str, logs: Path, rates: list[float],
              cost=None) -> list[dict]:
    """The setup's rows at rates (with cost, the planner's prediction of each beside it). The
    planned setup deploys, for each distinct pick of the planner among the rates, that pick."""
    if setup == "planned":
        picks: dict[str, tuple[Any, list[int]]] = {}
        for i, rate in enumerate(rates):
            cand = plan_pick(cost, args, rate, args.seed + 1 + i)
            print(f"[planned] {rate:g} req/s: the planner picks {cand.name} ({cand.up_flags()})", flush=True)
            picks.setdefault(cand.name, (cand, []))[1].append(i)
        rows = [row for cand, idx in picks.values()
                for row in _serve_rates(setup, args, model, logs, rates, idx, cost, cand)]
        return sorted(rows, key=lambda r: r["rate"])
    cand = setup_candidate(setup) if cost is not None and setup != "vllm" else None
    return _serve_rates(setup, args, model, logs, rates, range(len(rates)), cost, cand)


def _serve_rates(setup: str, args: argparse.Namespace, model: str, logs: Path, rates: list[float], which,
                 cost, cand) -> list[dict]:
    from pdserve.engine.model_config import ModelConfig
    vocab = ModelConfig.from_dir(model).vocab_size
    flags = shlex.split(cand.up_flags()) if setup == "planned" else UP_FLAGS.get(setup, [])
    serve = (vllm_target(args, model, logs) if setup == "vllm"
             else pdserve_target(setup, args, model, logs, [*flags, *shlex.split(args.pdserve_args)]))
    rows = []
    with serve as target:
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 4, "trace_start": args.trace_start + args.num_prompts})
        point(target, 2.0, warm, vocab, args.seed)   # other rows and tokens: nothing of a point is cached by it
        for i in which:
            rate = rates[i]
            row = {"setup": setup, **point(target, rate, args, vocab, args.seed + 1 + i)}
            if cand is not None:
                row["predicted"] = predict(cost, cand, args, rate, args.seed + 1 + i)
                print(f"[{setup}] {rate:g} req/s predicted ({cand.name}): attainment "
                      f"{row['predicted']['attainment']:.1%}, TTFT p50/p99 {row['predicted']['ttft_p50_ms']:.0f}/"
                      f"{row['predicted']['ttft_p99_ms']:.0f} ms", flush=True)
            also = "".join(f", within TTFT {ms} ms {share:.1%}" for ms, share in row["attainment_at_ttft_ms"].items())
            print(f"[{setup}] {rate:g} req/s: attainment {row['attainment']:.1%}{also}, goodput {row['goodput']:.2f}, "
                  f"TTFT p50/p90/p99 {row['ttft_p50_ms'] or 0:.0f}/{row['ttft_p90_ms'] or 0:.0f}/"
                  f"{row['ttft_p99_ms'] or 0:.0f} ms, TPOT p50/p90 {row['tpot_p50_ms'] or 0:.1f}/"
                  f"{row['tpot_p90_ms'] or 0:.1f} ms, failed {row['failed']}"
                  f"{' ' + str(row['errors']) if row['errors'] else ''}", flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["rate"]: r["goodput"] for r in rows if r["setup"] == "vllm"}
    lines = ["| setup | rate (req/s) | within SLO | goodput (req/s) | vs vLLM | TTFT p50 / p90 / p99 (ms) | "
             "TPOT p50 / p90 (ms) | failed | predicted: within SLO, TTFT p50 / p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['goodput'] / base[r['rate']]:.2f}x" if base.get(r["rate"]) else "-"
        ttft = "/".join(f"{r[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")) if r["completed"] else "-"
        tpot = "/".join(f"{r[k]:.1f}" for k in ("tpot_p50_ms", "tpot_p90_ms")) if r["tpot_p50_ms"] else "-"
        pred = r.get("predicted")
        guess = (f"{pred['attainment']:.1%}, {pred['ttft_p50_ms']:.0f} / {pred['ttft_p99_ms']:.0f}" if pred else "-")
        lines.append(f"| {r['setup']} | {r['rate']:g} | {r['attainment']:.1%} | {r['goodput']:.2f} | {ratio} | "
                     f"{ttft} | {tpot} | {r['failed']} | {guess} |")
    return "\n".join(lines)


def rate_at_attainment(rows: list[dict], setup: str, target: float) -> tuple[float, bool] | None:
    """DistServe's goodput: the highest rate at which setup keeps target of its requests within
    the SLOs, interpolated linearly between measured rates: (rate, exact), exact False when it
    kept the target at every rate measured (the rate is then a lower bound); None when it kept
    it at none."""
    pts = sorted((r["rate"], r["attainment"]) for r in rows if r["setup"] == setup)
    if not pts or pts[0][1] < target:
        return None
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1), True
    return pts[-1][0], False


def plot(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setup in SETUPS:
        pts = [r for r in rows if r["setup"] == setup]
        if pts:
            ax.plot([r["rate"] for r in pts], [100 * r["attainment"] for r in pts], marker="o",
                    label="vLLM-CPU" if setup == "vllm" else f"pdserve {setup}",
                    **({"color": "black", "linestyle": "--"} if setup == "vllm" else {}))
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"% within TTFT <= {args.ttft_ms:g} ms and TPOT <= {args.tpot_ms:g} ms")
    ax.set_title(f"{Path(args.trace).name}, rows {args.trace_start}-{args.trace_start + args.num_prompts - 1}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="a Mooncake / AIPerf trace (JSON lines)")
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--setups", default=None,
                   help=f"comma list of {', '.join(SETUPS)} (default: all; vllm only when a vLLM python is given)")
    p.add_argument("--rates", default="3", help="comma list of request rates (req/s) the slice is rescaled to")
    p.add_argument("--num-prompts", type=int, default=240)
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--token-scale", type=float, default=16 / 512)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=100.0)
    p.add_argument("--also-ttft-ms", type=lambda text: [float(x) for x in text.split(",") if x.strip()], default=[],
                   help="more TTFT targets (comma list, ms) whose attainment each point also reports, with --tpot-ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pdserve-args", default="", help="more `pdserve up` flags for every pdserve setup (one string)")
    p.add_argument("--profile", default=None, help="a `pdserve profile` cost model: the planner's prediction beside "
                                                   "each pdserve row, and the planned setup")
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "images"))
    add_vllm_args(p)
    args = p.parse_args()
    setups = drivers.names(args.setups or ",".join(SETUPS), SETUPS, "setup")
    check_vllm_setup(p, args, setups)
    if "planned" in setups and not args.profile:
        p.error("the planned setup needs --profile (a `pdserve profile` cost model)")
    return run_stopping_servers(lambda: measure(args, setups))


def measure(args: argparse.Namespace, setups: list[str]) -> int:
    model = drivers.model_dir(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = drivers.result_dir(None, "trace-goodput")
    print(f"servers' logs in {logs}", flush=True)
    rates = [float(r) for r in args.rates.split(",")]
    cost = None
    if args.profile:
        from pdserve.services.planner.cost_model import CostModel
        cost = CostModel.load(args.profile)
    rows = [row for setup in setups for row in run_setup(setup, args, model, logs, rates, cost)]
    print(table(rows))
    if len(rates) > 1:
        for target in (0.9, 0.8):
            said = []
            for setup in setups:
                got = rate_at_attainment(rows, setup, target)
                said.append(f"{setup} " + ("none" if got is None else f"{'' if got[1] else '>= '}{got[0]:.2f}"))
            print(f"highest rate (req/s) keeping {target:.0%} within the SLOs: {', '.join(said)}")
    record: dict[str, Any] = {"args": vars(args), "setups": setups, "rows": rows, "cpu": machine_info()["cpu_model"]}
    if "vllm" in setups:
        cmd, env = vllm_command(args, model, 0, MAX_MODEL_LEN)
        record["vllm_server"] = format_command(cmd, env).replace("--port 0", "--port PORT")
    (out / "trace_goodput.json").write_text(json.dumps(record, indent=1))
    plot(rows, out / "trace_goodput.png", args)
    print(f"wrote {out / 'trace_goodput.json'} and {out / 'trace_goodput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
