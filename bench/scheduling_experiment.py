#!/usr/bin/env python
"""The scheduling experiment: how each step policy treats decoders while a long prompt is chunked.

Offline, in one process, driving ``engine.LLMEngine`` directly (no services). The model is the
deterministic ``small`` qwen3 checkpoint (bf16, 8 layers, hidden 512, vocab 8192), made once
under ``$PDSERVE_HOME/models`` (default ``~/.cache/pdserve/models``). Engine:
``max_num_batched_tokens=128``, ``max_num_seqs=8``, one torch thread, CPU.

Workload (wall-clock arrivals, the same for every policy; token ids random with a fixed seed):

* t = 0:                  4 short requests ``s0..s3``  (32 prompt tokens, 128 output tokens)
* t = ``--long-arrival-s`` (0.3 s): 1 long prompt ``long`` (1024 tokens, 16 output tokens),
  chunked at 128 tokens per step
* t = ``--late-arrival-s`` (0.6 s): 4 late short requests ``late0..late3`` (32 / 64 tokens)

4 + 1 + 4 = 9 requests against ``max_num_seqs=8``: one late request also waits for a slot.
Every request has ``ignore_eos`` and greedy sampling. Before each policy a throwaway request warms
the engine up (excluded). Times are wall-clock ``time.perf_counter()`` around each
``engine.step()``: a token's time is the end of the step that sampled it; TTFT runs from the
request's scheduled arrival (so a step in flight when it arrives counts), ITL is the gap between
a request's consecutive tokens.

For each of ``prefill_first``, ``interleave`` and ``mixed`` it prints a per-step trace summary
(run-length of step kinds: P = prefill, D = decode, M = mixed; ``--verbose`` prints every step),
and then side by side: per-request TTFT and ITL, the early decoders' worst stall while the long
prompt is chunked, preemptions and peak KV blocks in use (``--num-kv-blocks`` makes the pool
small enough to force preemptions). Each policy runs ``--repeat`` times (default 3, policies
alternating) and the table shows the median of each number: the timings are wall-clock on a
shared machine. Example::

    PYTHONPATH=. python bench/scheduling_experiment.py
    PYTHONPATH=. python bench/scheduling_experiment.py --num-kv-blocks 96 --json /tmp/sched.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

POLICIES = ("prefill_first", "interleave", "mixed")
KIND_CHAR = {"prefill": "P", "decode": "D", "mixed": "M"}


@dataclass(slots=True)
class Arrival:
    t: float
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class PolicyRun:
    policy: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    arrival: dict[str, float] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    preemptions: int = 0
    peak_blocks: int = 0
    num_blocks: int = 0
    makespan: float = 0.0

    def ttft(self, rid: str) -> float:
        return self.token_times[rid][0] - self.arrival[rid]

    def itls(self, rid: str) -> list[float]:
        return np.diff(self.token_times[rid]).tolist()


def workload(args: argparse.Namespace, vocab_size: int) -> list[Arrival]:
    rng = np.random.default_rng(args.seed)

    def ids(n: int) -> list[int]:
        return rng.integers(2, vocab_size, size=n).tolist()

    out = [Arrival(0.0, f"s{i}", ids(args.short_input_len), args.short_output_len) for i in range(4)]
    out.append(Arrival(args.long_arrival_s, "long", ids(args.long_input_len), args.long_output_len))
    out += [Arrival(args.late_arrival_s, f"late{i}", ids(args.short_input_len), args.late_output_len)
            for i in range(4)]
    return out


def run_policy(model_dir: str, policy: str, arrivals: list[Arrival], args: argparse.Namespace) -> PolicyRun:
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    kwargs: dict[str, Any] = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                  schedule_policy=policy, num_threads=args.threads, device="cpu", dtype=args.dtype,
                                  block_size=args.block_size)
    if args.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, **kwargs))
    # warm up (kernels, allocator) with a prompt that shares nothing with the workload
    engine.add_request("warmup", [3] * 48, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    steps_before, preempt_before = engine.num_steps, engine.scheduler.num_preemptions

    run = PolicyRun(policy, num_blocks=engine.block_manager.num_blocks)
    pending = sorted(arrivals, key=lambda a: a.t)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0].t <= now:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt,
                               SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True))
            run.arrival[a.request_id] = a.t
            run.token_times[a.request_id] = []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].t - (time.perf_counter() - t0)))
            continue
        n_before = engine.num_steps
        start = time.perf_counter() - t0
        outputs = engine.step()
        end = time.perf_counter() - t0
        if engine.num_steps == n_before:   # nothing could be scheduled
            continue
        tr = engine.trace[-1]
        run.steps.append({"step": tr.step - steps_before, "start_ms": start * 1e3, "dur_ms": (end - start) * 1e3,
                          "kind": tr.kind.value, "requests": dict(zip(tr.request_ids, tr.num_tokens)),
                          "num_prefill_tokens": tr.num_prefill_tokens, "num_decode_seqs": tr.num_decode_seqs,
                          "blocks_in_use": tr.blocks_in_use, "preempted": list(tr.preempted)})
        for out in outputs:
            run.token_times[out.request_id].extend([end] * len(out.new_token_ids))
    run.makespan = time.perf_counter() - t0
    run.preemptions = engine.scheduler.num_preemptions - preempt_before
    run.peak_blocks = max((s["blocks_in_use"] for s in run.steps), default=0)
    for a in arrivals:
        got = len(run.token_times[a.request_id])
        if got != a.max_tokens:
            raise RuntimeError(f"{policy}: {a.request_id} produced {got} tokens, expected {a.max_tokens}")
    return run


# ---------------------------------------------------------------- reporting


def run_length(kinds: list[str]) -> str:
    out: list[str] = []
    for k in kinds:
        c = KIND_CHAR[k]
        if out and out[-1][0] == c:
            out[-1] = f"{c}{int(out[-1][1:]) + 1}"
        else:
            out.append(f"{c}1")
    return " ".join(out)


def long_window(run: PolicyRun) -> list[dict[str, Any]]:
    """Steps from the long prompt's arrival to its first token."""
    t_arr, t_first = run.arrival["long"] * 1e3, run.token_times["long"][0] * 1e3
    return [s for s in run.steps if s["start_ms"] + s["dur_ms"] > t_arr and s["start_ms"] < t_first]


def summarize(run: PolicyRun) -> dict[str, Any]:
    early = [f"s{i}" for i in range(4)]
    late = [f"late{i}" for i in range(4)]
    win = long_window(run)
    t_arr, t_first = run.arrival["long"], run.token_times["long"][0]
    stall = [g for rid in early for t_prev, t, g in zip(run.token_times[rid], run.token_times[rid][1:],
                                                         run.itls(rid)) if t > t_arr and t_prev < t_first + 1e-9]
    by_kind: dict[str, list[float]] = {}
    for s in run.steps:
        by_kind.setdefault(s["kind"], []).append(s["dur_ms"])
    all_itl = [g for rid in run.token_times for g in run.itls(rid)]
    return {
        "policy": run.policy,
        "steps": len(run.steps),
        "steps_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
        "step_ms_by_kind": {k: float(np.mean(v)) for k, v in sorted(by_kind.items())},
        "long_window_kinds": run_length([s["kind"] for s in win]),
        "long_ttft_ms": (t_first - t_arr) * 1e3,
        "early_max_itl_during_long_ms": max(stall) * 1e3 if stall else 0.0,
        "early_mean_itl_during_long_ms": float(np.mean(stall)) * 1e3 if stall else 0.0,
        "early_mean_itl_ms": float(np.mean([g for r in early for g in run.itls(r)])) * 1e3,
        "late_ttft_ms": [run.ttft(r) * 1e3 for r in late],
        "all_itl_p50_ms": float(np.percentile(all_itl, 50)) * 1e3,
        "all_itl_p99_ms": float(np.percentile(all_itl, 99)) * 1e3,
        "all_itl_max_ms": max(all_itl) * 1e3,
        "preemptions": run.preemptions,
        "peak_blocks_in_use": run.peak_blocks,
        "num_blocks": run.num_blocks,
        "makespan_s": run.makespan,
        "requests": {rid: {"ttft_ms": run.ttft(rid) * 1e3,
                           "itl_mean_ms": float(np.mean(run.itls(rid))) * 1e3 if run.itls(rid) else 0.0,
                           "itl_p50_ms": float(np.median(run.itls(rid))) * 1e3 if run.itls(rid) else 0.0,
                           "itl_max_ms": max(run.itls(rid)) * 1e3 if run.itls(rid) else 0.0,
                           "output_tokens": len(run.token_times[rid])}
                     for rid in run.token_times},
    }


def median_summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Element-wise median of repeated summaries (numbers, lists of numbers, nested dicts)."""
    first = reps[0]
    if len(reps) == 1:
        return first
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r[key] for r in reps if key in r]
        if isinstance(value, bool) or isinstance(value, str):
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = float(np.median(values))
        elif isinstance(value, list):
            out[key] = np.median(np.asarray(values, dtype=float), axis=0).tolist()
        elif isinstance(value, dict):
            out[key] = median_summary(values)
        else:
            out[key] = value
    return out


def print_trace(run: PolicyRun, verbose: bool) -> None:
    print(f"\n--- {run.policy}: {len(run.steps)} steps, makespan {run.makespan:.2f}s")
    print(f"  all steps:         {run_length([s['kind'] for s in run.steps])}")
    print(f"  long prompt window: {run_length([s['kind'] for s in long_window(run)])}"
          f"   (arrival {run.arrival['long'] * 1e3:.0f} ms -> first token {run.token_times['long'][0] * 1e3:.0f} ms)")
    if verbose:
        for s in run.steps:
            reqs = " ".join(f"{r}:{n}" for r, n in s["requests"].items())
            pre = f"  preempted {s['preempted']}" if s["preempted"] else ""
            print(f"  #{s['step']:>3} t={s['start_ms']:7.1f}ms {s['dur_ms']:6.1f}ms {s['kind']:<7} "
                  f"blocks={s['blocks_in_use']:<4} {reqs}{pre}")


def print_side_by_side(summaries: list[dict[str, Any]]) -> None:
    names = [s["policy"] for s in summaries]
    w = 16
    print("\n" + "=" * (34 + (w + 1) * len(names)))
    print(f"{'':<34}" + " ".join(f"{n:>{w}}" for n in names))
    rows = [
        ("steps (P/D/M)", lambda s: "/".join(f"{s['steps_by_kind'].get(k, 0):.0f}" for k in ("prefill", "decode", "mixed"))),
        ("mean step ms (P/D/M)", lambda s: "/".join(f"{s['step_ms_by_kind'][k]:.0f}" if k in s["step_ms_by_kind"]
                                                    else "-" for k in ("prefill", "decode", "mixed"))),
        ("long: TTFT ms", lambda s: f"{s['long_ttft_ms']:.0f}"),
        ("s0-s3 max ITL during long, ms", lambda s: f"{s['early_max_itl_during_long_ms']:.0f}"),
        ("s0-s3 mean ITL during long, ms", lambda s: f"{s['early_mean_itl_during_long_ms']:.0f}"),
        ("s0-s3 mean ITL overall, ms", lambda s: f"{s['early_mean_itl_ms']:.1f}"),
        ("late0-3 TTFT ms (mean)", lambda s: f"{np.mean(s['late_ttft_ms']):.0f}"),
        ("late0-3 TTFT ms (max)", lambda s: f"{max(s['late_ttft_ms']):.0f}"),
        ("ITL p50 / p99 ms (all)", lambda s: f"{s['all_itl_p50_ms']:.0f} / {s['all_itl_p99_ms']:.0f}"),
        ("ITL max ms (all)", lambda s: f"{s['all_itl_max_ms']:.0f}"),
        ("preemptions (each repeat)", lambda s: s.get("preemptions_per_repeat", f"{s['preemptions']:.0f}")),
        ("peak blocks in use (each repeat)", lambda s: s.get("peak_blocks_per_repeat", f"{s['peak_blocks_in_use']:.0f}")),
        ("KV blocks in the pool", lambda s: f"{s['num_blocks']:.0f}"),
        ("makespan s", lambda s: f"{s['makespan_s']:.2f}"),
    ]
    for label, fn in rows:
        print(f"{label:<34}" + " ".join(f"{fn(s):>{w}}" for s in summaries))
    print("-" * (34 + (w + 1) * len(names)))
    print(f"{'request: TTFT ms | ITL mean/max ms':<34}" + " ".join(f"{n:>{w}}" for n in names))
    for rid in summaries[0]["requests"]:
        cells = []
        for s in summaries:
            r = s["requests"][rid]
            cells.append(f"{r['ttft_ms']:.0f} | {r['itl_mean_ms']:.0f}/{r['itl_max_ms']:.0f}")
        print(f"{rid:<34}" + " ".join(f"{c:>{w}}" for c in cells))
    print("=" * (34 + (w + 1) * len(names)), flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = drivers.parser(__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the small model, made on first use)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: the engine's budget)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    drivers.add_flags(p, threads=1, short_input_len=32, short_output_len=128, late_output_len=64, long_input_len=1024,
                      long_output_len=16, long_arrival_s=0.3, late_arrival_s=0.6, seed=0)
    p.add_argument("--repeat", type=int, default=3, help="runs per policy; the table shows medians")
    p.add_argument("--verbose", action="store_true", help="print every step (of the first repeat)")
    p.add_argument("--json", default=None, help="write summaries and step traces here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policy {bad}; choose from {POLICIES}")
    from pdserve.engine.model_config import ModelConfig
    model_dir = drivers.model_dir(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    arrivals = workload(args, vocab)
    print(f"model {model_dir}; max_num_batched_tokens={args.max_num_batched_tokens} max_num_seqs={args.max_num_seqs} "
          f"block_size={args.block_size} num_kv_blocks={args.num_kv_blocks or 'default'} threads={args.threads}")
    print("arrivals: " + ", ".join(f"{a.request_id}@{a.t:.2f}s({len(a.prompt)}->{a.max_tokens})" for a in arrivals))
    runs: dict[str, list[PolicyRun]] = {p: [] for p in policies}
    for rep in range(args.repeat):   # policies alternate, so drift in machine load hits all alike
        for policy in policies:
            run = run_policy(model_dir, policy, arrivals, args)
            if rep == 0:
                print_trace(run, args.verbose)
            runs[policy].append(run)
    if args.repeat > 1:
        print(f"\n(trace shown for repeat 1 of {args.repeat}; the table has the median of {args.repeat} repeats)")
    summaries = [median_summary([summarize(r) for r in runs[p]]) for p in policies]
    for summary, p in zip(summaries, policies):
        summary["preemptions_per_repeat"] = ",".join(str(r.preemptions) for r in runs[p])
        summary["peak_blocks_per_repeat"] = ",".join(str(r.peak_blocks) for r in runs[p])
    print_side_by_side(summaries)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summaries": summaries,
                                               "repeats": {p: [summarize(r) for r in rs] for p, rs in runs.items()},
                                               "steps": {p: rs[0].steps for p, rs in runs.items()}}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
