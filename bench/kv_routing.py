#!/usr/bin/env python
"""KV-aware routing and conditional disaggregation, side by side, in one run.

1. ``shared-prefix`` (several distinct prefixes, each request drawing one) over 1 prefill + 2
   decode workers: ``--routing kv-aware`` against ``--routing load`` (same disaggregation mode).
   Reports the decode-side prefix-hit rate (prompt tokens the chosen decode worker already held,
   so not shipped) against the ideal (every prefix after its first use), the KV bytes shipped,
   TTFT p50/p99, how many requests waited for their prefix in flight on their decode worker,
   and whether both runs produced the same greedy tokens.
2. ``mixed`` (short prompts decoding while every 8th is a long prompt) over 1 prefill + 1 decode
   worker: ``--disaggregation conditional`` against ``always`` (both kv-aware). Reports TTFT
   p50/p99 of the short prompts, ITL p50/p99, how many prompts were prefilled locally, and the
   learned local-prefill threshold (the router's /metrics, sampled through the run).

Each setup is a fresh deployment (``services.deployment.launcher.Cluster``: real processes, real gRPC on
127.0.0.1) with a few warm-up requests (the step costs are learned from them), then the same
requests at the same Poisson arrival times. Model: the ``small`` qwen3 checkpoint, made once
under ``$PDSERVE_HOME/models``. Example::

    PYTHONPATH=. python bench/kv_routing.py
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.model_maker import ensure_model  # noqa: E402
from pdserve.services.loadtest.datasets import DatasetOptions, SampleRequest, sample_requests  # noqa: E402
from pdserve.services.loadtest.results import RequestResult, Sampling  # noqa: E402
from pdserve.services.loadtest.run import run_load  # noqa: E402
from pdserve.services.deployment.launcher import Cluster, Deployment, free_port  # noqa: E402
from tests.serving import scrape  # noqa: E402

THRESHOLD_METRIC = "pdserve:router_local_prefill_threshold_tokens"
PREFIX_WAITS_METRIC = "pdserve:router_prefix_waits_total"


@dataclass(slots=True)
class Setup:
    name: str
    prefill: int
    decode: int
    router_args: list[str]


@dataclass(slots=True)
class Outcome:
    results: list[RequestResult]
    duration: float
    thresholds: list[float] = field(default_factory=list)   # sampled from the router's /metrics
    router_metrics: dict[str, float] = field(default_factory=dict)


def _sample_thresholds(address: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.5):
        try:
            out.extend(v for k, v in scrape(address).items() if k.startswith(THRESHOLD_METRIC + "{"))
        except OSError:
            pass


def run_setup(model: str, setup: Setup, engine_args: list[str], warmup: list[SampleRequest],
              requests: list[SampleRequest], rate: float, seed: int, log_dir: str) -> Outcome:
    spec = Deployment(model=model, prefill_workers=setup.prefill, decode_workers=setup.decode, port=free_port(),
                      metrics=True, engine_args=engine_args, router_args=setup.router_args, restart=False,
                      log_dir=os.path.join(log_dir, setup.name))
    cluster = Cluster(spec)
    t0 = time.perf_counter()
    cluster.start(timeout=300)
    print(f"[{setup.name}] up in {time.perf_counter() - t0:.1f}s: {' '.join(setup.router_args)}", flush=True)
    try:
        sampling = Sampling(temperature=0.0, ignore_eos=True)
        asyncio.run(run_load(cluster.router_address, warmup, rate=float("inf"), max_concurrency=2, sampling=sampling,
                             tag="warmup"))
        router = next(p for p in cluster.processes if p.name == "router")
        thresholds: list[float] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_thresholds, args=(router.metrics_address, stop, thresholds),
                                   daemon=True)
        sampler.start()
        try:
            results, duration = asyncio.run(run_load(cluster.router_address, requests, rate=rate, seed=seed,
                                                     sampling=sampling, timeout=300))
        finally:
            stop.set()
            sampler.join(timeout=5)
        failed = [r.error for r in results if not r.success]
        if failed:
            print(f"[{setup.name}] {len(failed)} failed: {failed[:3]}", flush=True)
        return Outcome(results, duration, thresholds, scrape(router.metrics_address))
    finally:
        cluster.stop()


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, p)) if values else float("nan")


def ideal_hit_tokens(requests: list[SampleRequest], prefix_len: int, block_size: int) -> int:
    """Prompt tokens a decode worker could hold with perfect routing and an unbounded cache: every
    prefix's full blocks, after its first use."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    cached = (prefix_len // block_size) * block_size
    for r in requests:
        prefix = tuple(r.prompt[:prefix_len])
        if prefix in seen:
            total += cached
        seen.add(prefix)
    return total


def shared_prefix_row(name: str, out: Outcome, requests: list[SampleRequest], ideal: int) -> dict[str, Any]:
    ok = [r for r in out.results if r.success]
    prompt_tokens = sum(r.prompt_len for r in ok)
    hits = sum(r.decode_cached_tokens for r in ok)
    return {"setup": name, "ok": f"{len(ok)}/{len(out.results)}",
            "hit rate": f"{hits / prompt_tokens:.1%}", "of ideal": f"{hits / ideal:.0%}" if ideal else "-",
            "KV MB shipped": f"{sum(r.kv_bytes for r in ok) / 1e6:.1f}",
            "local": sum(r.prefill_route == "local" for r in ok),
            "prefix waits": int(sum(v for k, v in out.router_metrics.items() if k.startswith(PREFIX_WAITS_METRIC))),
            "TTFT p50 ms": f"{_pct([r.ttft for r in ok], 50):.0f}", "TTFT p99 ms": f"{_pct([r.ttft for r in ok], 99):.0f}",
            "ITL p99 ms": f"{_pct([g for r in ok for g in r.itl], 99):.1f}"}


def mixed_row(name: str, out: Outcome) -> dict[str, Any]:
    ok = [r for r in out.results if r.success]
    short = [r.ttft for r in ok if r.kind == "short"]
    gaps = [g for r in ok for g in r.itl]
    # -1: not conditional; the decode worker's max_model_len: local at any length
    sampled = [t for t in out.thresholds if t >= 0]
    thr = f"{min(sampled):.0f}/{np.median(sampled):.0f}/{max(sampled):.0f}" if sampled else "-"
    return {"setup": name, "ok": f"{len(ok)}/{len(out.results)}", "local": sum(r.prefill_route == "local" for r in ok),
            "short TTFT p50 ms": f"{_pct(short, 50):.0f}", "short TTFT p99 ms": f"{_pct(short, 99):.0f}",
            "ITL p50 ms": f"{_pct(gaps, 50):.1f}", "ITL p99 ms": f"{_pct(gaps, 99):.1f}",
            "threshold min/med/max": thr}


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the small qwen3, made once)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-num-prompts", type=int, default=48)
    p.add_argument("--shared-rate", type=float, default=3.0)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--shared-output-len", type=int, default=32)
    p.add_argument("--shared-disaggregation", default="conditional", choices=("conditional", "always"))
    p.add_argument("--decode-kv-blocks", type=int, default=160,
                   help="KV pool of every worker (blocks): small enough that one decode worker cannot keep every "
                        "prefix")
    p.add_argument("--mixed-num-prompts", type=int, default=48)
    p.add_argument("--mixed-rate", type=float, default=3.0)
    p.add_argument("--mixed-short-input-len", type=int, default=64)
    p.add_argument("--mixed-long-input-len", type=int, default=768)
    p.add_argument("--mixed-output-len", type=int, default=48)
    p.add_argument("--skip", choices=("shared-prefix", "mixed"), default=None)
    args = p.parse_args(argv)

    model = args.model or str(ensure_model("small"))
    log_dir = tempfile.mkdtemp(prefix="pdserve-kv-routing-")
    print(f"model {model}; logs in {log_dir}", flush=True)
    vocab = _vocab(model)
    common = ["--block-size", str(args.block_size), "--dtype", "auto"]

    if args.skip != "shared-prefix":
        opts = DatasetOptions(name="shared-prefix", input_len=args.suffix_len, output_len=args.shared_output_len,
                              prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
        requests = sample_requests(opts, args.shared_num_prompts, vocab, seed=args.seed)
        warmup = sample_requests(DatasetOptions(name="random", input_len=args.prefix_len, output_len=8), 4, vocab,
                                 seed=args.seed + 1000)
        ideal = ideal_hit_tokens(requests, args.prefix_len, args.block_size)
        engine = [*common, "--num-kv-blocks", str(args.decode_kv_blocks)]
        outs = {}
        for routing in ("kv-aware", "load"):
            setup = Setup(f"shared-{routing}", 1, 2, ["--routing", routing,
                                                      "--disaggregation", args.shared_disaggregation])
            outs[routing] = run_setup(model, setup, engine, warmup, requests, args.shared_rate, args.seed, log_dir)
        rows = [shared_prefix_row(f"{r} ({args.shared_disaggregation})", o, requests, ideal) for r, o in outs.items()]
        same = all(a.token_ids == b.token_ids for a, b in zip(outs["kv-aware"].results, outs["load"].results)
                   if a.success and b.success)
        print_table(f"shared-prefix: {args.shared_num_prompts} prompts, {args.num_prefixes} prefixes x "
                    f"{args.prefix_len} + {args.suffix_len} tokens, {args.shared_output_len} out, "
                    f"{args.shared_rate:g} req/s, 1 prefill + 2 decode, {args.decode_kv_blocks} KV blocks/worker; "
                    f"ideal hit rate {ideal / sum(r.prompt_len for r in requests):.1%}; "
                    f"greedy tokens identical across runs: {same}", rows)

    if args.skip != "mixed":
        opts = DatasetOptions(name="mixed", output_len=args.mixed_output_len,
                              mixed_short_input_len=args.mixed_short_input_len,
                              mixed_long_input_len=args.mixed_long_input_len, mixed_long_output_len=8)
        requests = sample_requests(opts, args.mixed_num_prompts, vocab, seed=args.seed + 1)
        warmup = sample_requests(opts, 8, vocab, seed=args.seed + 2000)
        outs = {}
        for mode in ("conditional", "always"):
            setup = Setup(f"mixed-{mode}", 1, 1, ["--routing", "kv-aware", "--disaggregation", mode])
            outs[mode] = run_setup(model, setup, common, warmup, requests, args.mixed_rate, args.seed, log_dir)
        rows = [mixed_row(m, o) for m, o in outs.items()]
        same = all(a.token_ids == b.token_ids for a, b in zip(outs["conditional"].results, outs["always"].results)
                   if a.success and b.success)
        c, a = outs["conditional"], outs["always"]
        ratio = _pct([g for r in c.results if r.success for g in r.itl], 99) / \
            _pct([g for r in a.results if r.success for g in r.itl], 99)
        print_table(f"mixed: {args.mixed_num_prompts} prompts ({args.mixed_short_input_len} in / "
                    f"{args.mixed_output_len} out; every 8th {args.mixed_long_input_len} in / 8 out), "
                    f"{args.mixed_rate:g} req/s, 1 prefill + 1 decode; ITL p99 conditional/always {ratio:.2f}; "
                    f"greedy tokens identical across runs: {same}", rows)
    return 0


def _vocab(model: str) -> int:
    import json
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


if __name__ == "__main__":
    sys.exit(main())
