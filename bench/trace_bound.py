#!/usr/bin/env python
"""The most requests of a trace slice that any scheduler could bring within a TTFT target on this
machine, from the prompts' work alone: an upper bound beside bench/trace_goodput.py's measured
attainment.

The slice is loaded as ``bench/trace_goodput.py`` and ``pdserve bench serve`` load it
(services/loadtest/traces.py). A prompt's work is measured here: the model's prefill time alone
at several prompt lengths with one torch thread, fitted to ``a n + b n^2`` seconds (the linears
and the attention), and a prompt after a cached prefix of p tokens costs ``a n + b ((p + n)^2 -
p^2)`` for its n new tokens. Optimistic on every side, so the bound holds for any scheduler:

* every block of a prompt's prefix that an earlier prompt of the slice had (with all before it)
  is cached, and nothing else of a request costs time (no decoding, no sampling, transfer or
  network);
* the machine gives prompts ``--cores`` cores in all (each prompt at most ``--prompt-cores`` of
  them, at a perfect speed-up), switched between prompts at no cost.

A request released at r meets the target T only if its prompt's work is done within [r, r + T].
For a window [s, s + x + T], every request released in [s, s + x] must be served inside it, so at
most the smallest of them that fit its capacity (cores x its length; each prompt at most
prompt-cores x T) can meet the target. Windows that do not overlap hold different requests, so
the misses of the best set of disjoint windows (x in WINDOW_SPANS_S, chosen by weighted interval
scheduling) are a lower bound on any schedule's misses::

    python bench/trace_bound.py --trace conversation_trace.jsonl --num-prompts 240 \\
        --rates 2 --ttft-ms 1000,2000 --cores 1,1.6,2
"""
from __future__ import annotations

import argparse
import bisect
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from pdserve.services.loadtest.traces import TraceOptions, load_trace  # noqa: E402

WINDOW_SPANS_S = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)   # release spans of the windows tried
FIT_LENGTHS = (128, 256, 512, 1024, 2048)      # prompt lengths timed for the fit
FIT_REPEATS = 5


@dataclass(frozen=True)
class PrefillCost:
    """Seconds of one thread's prefill: a n + b n^2 for a prompt of n tokens (the linears, the
    attention), so n new tokens after p cached ones cost a n + b ((p + n)^2 - p^2)."""
    a: float
    b: float

    def seconds(self, cached: int, new: int) -> float:
        return self.a * new + self.b * ((cached + new) ** 2 - cached ** 2)


def measure_prefill(model: str) -> tuple[PrefillCost, list[tuple[int, float]]]:
    """The model's prefill time alone at FIT_LENGTHS up to its longest sequence (best of
    FIT_REPEATS, one thread), fitted."""
    from pdserve import LLM, SamplingParams   # here: the bound's unit tests need no model, nor torch
    llm = LLM(model, num_threads=1, enable_prefix_caching=False)   # no prefix cache: each call computes it all
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    points = []
    for n in (n for n in FIT_LENGTHS if n < llm.engine.max_model_len):
        prompt = rng.integers(10, 1000, n).tolist()
        points.append((n, drivers.best_ms(lambda: llm.generate([prompt], params), FIT_REPEATS) / 1e3))
    ns = np.array([p[0] for p in points], dtype=float)
    ts = np.array([p[1] for p in points])
    (a, b), *_ = np.linalg.lstsq(np.stack([ns, ns ** 2], axis=1), ts, rcond=None)
    return PrefillCost(float(a), float(max(b, 0.0))), points


def prompt_work(opts: TraceOptions, num_prompts: int, cost: PrefillCost) -> tuple[list[float], list[float]]:
    """Each request's send time and its prompt's work (one thread's seconds), its prefix cached
    as far as its blocks (of the scaled block size, each with all before it) appeared before it."""
    workload = load_trace(opts, num_prompts, vocab_size=1 << 16)
    block = max(1, round(opts.block_size * opts.token_scale))
    seen: set[int] = set()
    work = []
    for req in workload.requests:
        prefixes, chained = [], 0
        for end in range(block, len(req.prompt) + 1, block):
            chained = hash((chained, tuple(req.prompt[end - block:end])))   # a block with all before it
            prefixes.append(chained)
        cached = 0
        while cached < len(prefixes) and prefixes[cached] in seen:
            cached += 1
        seen.update(prefixes)
        work.append(cost.seconds(cached * block, req.prompt_len - cached * block))
    return workload.offsets, work


def max_attainment(offsets: list[float], work: list[float], target_s: float, cores: float,
                   prompt_cores: float) -> float:
    """The bound: 1 - (the most misses over disjoint windows) / requests."""
    releases = sorted(set(offsets))
    windows = []   # (start, end, misses forced inside)
    for s in releases:
        for span in WINDOW_SPANS_S:
            inside = sorted(w for t, w in zip(offsets, work) if s <= t <= s + span)
            capacity, used, met = cores * (span + target_s), 0.0, 0
            for w in inside:
                if w <= prompt_cores * target_s and used + w <= capacity:
                    used += w
                    met += 1
            if met < len(inside):
                windows.append((s, s + span + target_s, len(inside) - met))
    windows.sort(key=lambda w: w[1])
    ends = [w[1] for w in windows]
    best = [0] * (len(windows) + 1)
    for j, (start, _, misses) in enumerate(windows):
        before = bisect.bisect_right(ends, start, 0, j)   # windows over by this one's start
        best[j + 1] = max(best[j], best[before] + misses)
    return 1.0 - best[-1] / len(work)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="a Mooncake / AIPerf trace (JSON lines)")
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--num-prompts", type=int, default=240)
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--token-scale", type=float, default=16 / 512)
    p.add_argument("--rates", default="2", help="comma list of request rates (req/s) the slice is rescaled to")
    p.add_argument("--ttft-ms", default="1000,2000", help="comma list of TTFT targets (ms)")
    p.add_argument("--cores", default="1,1.6,2", help="comma list of the cores prompts get in all")
    p.add_argument("--prompt-cores", type=float, default=1.0,
                   help="the most cores one prompt runs on (1: one thread, as pdserve's workers by default)")
    args = p.parse_args()
    model = drivers.model_dir(args.model)
    cost, points = measure_prefill(model)
    print("prefill alone, one thread: " + ", ".join(f"{n} tokens {t * 1e3:.0f} ms" for n, t in points)
          + f"; fit a = {cost.a * 1e6:.1f} us/token, b = {cost.b * 1e9:.2f} ns/token^2")
    for rate in (float(r) for r in args.rates.split(",")):
        opts = TraceOptions(args.trace, start=args.trace_start, token_scale=args.token_scale, rate=rate)
        offsets, work = prompt_work(opts, args.num_prompts, cost)
        for target in (float(t) / 1e3 for t in args.ttft_ms.split(",")):
            for cores in (float(c) for c in args.cores.split(",")):
                share = max_attainment(offsets, work, target, cores, min(cores, args.prompt_cores))
                print(f"rows {args.trace_start}-{args.trace_start + len(work) - 1} at {rate:g} req/s, TTFT <= "
                      f"{target * 1e3:g} ms, {cores:g} cores for prompts: at most {100 * share:.1f}% of "
                      f"{len(work)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
