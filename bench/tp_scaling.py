#!/usr/bin/env python
"""Tensor parallelism on this machine: TP=1 against TP=2, side by side, on the ``small`` model.

For each layout (``--layouts``, e.g. ``1x1,1x2,2x1``: ranks x threads per rank):
- prefill latency of one ``--prompt-len`` (1024) token prompt in one step (prefix caching off),
  median over ``--reps``;
- decode step time at each batch size of ``--batches`` (1, 32): that many sequences with
  ``--ctx`` tokens of context, median ``engine.step()`` over ``--steps`` decode steps.
Each layout runs in its own engine (its ranks in their own processes, gloo on CPU), one after
the other. Example::

    PYTHONPATH=. python bench/tp_scaling.py --layouts 1x1,1x2,2x1 --batches 1,32
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 8192) for _ in range(length)] for _ in range(n)]


def measure(tp: int, threads: int, args: argparse.Namespace) -> dict[str, float]:
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pdserve.engine.model_maker import ensure_model

    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(model=str(ensure_model(args.preset)), device="cpu", tensor_parallel_size=tp,
                                    num_threads=threads, enable_prefix_caching=False, max_num_seqs=max(batches),
                                    max_num_batched_tokens=max(2048, args.prompt_len), dtype=args.dtype))
    try:
        out: dict[str, float] = {}
        times = []
        for rep in range(args.reps + 1):   # the first is a warm-up
            engine.add_request(f"p{rep}", _prompts(1, args.prompt_len, rep)[0],
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
        out[f"prefill_{args.prompt_len}_ms"] = statistics.median(times[1:]) * 1e3
        for b in batches:
            params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
            for i, p in enumerate(_prompts(b, args.ctx, 1000 + b)):
                engine.add_request(f"d{b}-{i}", p, params)
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
                    or engine.scheduler.waiting:
                engine.step()
            engine.step()   # warm-up decode step
            steps = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)
            out[f"decode_b{b}_step_ms"] = statistics.median(steps) * 1e3
            for i in range(b):
                engine.abort(f"d{b}-{i}")
        return out
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="1x1,1x2,2x1", help="RANKSxTHREADS per layout, comma-separated")
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    layouts = [tuple(int(x) for x in spec.split("x")) for spec in args.layouts.split(",")]
    results = {f"TP={tp} x {th} thr": measure(tp, th, args) for tp, th in layouts}
    if args.json:
        print(json.dumps(results))
        return
    names = list(results)
    metrics = list(next(iter(results.values())))
    width = max(len(n) for n in names) + 2
    print(f"{'':24}" + "".join(f"{n:>{width}}" for n in names))
    for m in metrics:
        print(f"{m:24}" + "".join(f"{results[n][m]:>{width}.1f}" for n in names))


if __name__ == "__main__":
    main()
