#!/usr/bin/env python
"""Priority classes and fair share under overload, in one run (1 prefill + 1 decode worker with
``--slo-admission``, small model, the load of bench/slo_goodput.py):

1. unloaded: the high class alone at a quarter of the capacity: its TTFT p99;
2. two classes at twice the capacity, a quarter of the requests high priority (``priority`` 0),
   the rest low (1): each class's TTFT p99, completions and refusals. Goal: the high class within
   1.5x its unloaded TTFT p99, the low class absorbing the delay and the refusals;
3. one class, two clients (``user`` a and b) sending 3:1 at twice the capacity: the share of the
   service (completions within the SLOs) each gets. Goal: in proportion to their fair share (one
   for one), not to their sending rates.

Each phase's arrivals are one Poisson stream whose requests take their class or client at random
in the stated shares (so each class or client is a Poisson stream of its own)::

    PYTHONPATH=. python bench/slo_classes.py --capacity 3.18
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.slo_goodput import requests, up_flags  # noqa: E402


def run_phase(address: str, rate: float, n: int, classes: dict[str, tuple[float, int, str]],
              args: argparse.Namespace, seed: int, vocab: int) -> dict[str, dict[str, Any]]:
    """n requests at rate; each takes a class name with its share, priority and user. Per class:
    sent, completed, refused, good (within both targets), TTFT p50/p99 of the completed."""
    import numpy as np

    from pdserve.services.loadtest.results import Sampling
    from pdserve.services.loadtest.run import run_load
    reqs = requests(n, args.input_len, args.output_len, seed, vocab)
    rng = random.Random(seed)
    names = list(classes)
    shares = [classes[c][0] for c in names]
    labels = rng.choices(names, weights=shares, k=n)
    for req, label in zip(reqs, labels):
        _, req.priority, req.user = classes[label]
    results, duration = asyncio.run(run_load(address, reqs, rate=rate, seed=seed,
                                             sampling=Sampling(temperature=0.0, ignore_eos=True), tag="classes"))
    out = {}
    for name in names:
        mine = [r for r, label in zip(results, labels) if label == name]
        done = [r for r in mine if r.success]
        good = [r for r in done if r.ttft * 1e3 <= args.ttft_ms and (r.tpot is None or r.tpot * 1e3 <= args.tpot_ms)]
        ttfts = [r.ttft * 1e3 for r in done]
        out[name] = {"sent": len(mine), "completed": len(done), "good": len(good),
                     "refused": sum(r.error.startswith("RESOURCE_EXHAUSTED") for r in mine),
                     "goodput": len(good) / duration,
                     "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
                     "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--capacity", type=float, required=True, help="the 1P1D deployment's capacity in req/s "
                                                                 "(bench/slo_goodput.py measures it)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "images"))
    args = p.parse_args()
    from pdserve.engine.model_config import ModelConfig
    from pdserve.services.deployment.launcher import free_port, wait_serving

    model = drivers.model_dir(args.model)
    vocab = ModelConfig.from_dir(model).vocab_size
    logs = drivers.result_dir(None, "slo-classes")
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", *up_flags("disagg-slo", args.ttft_ms, args.tpot_ms)]
    popen = drivers.start_up(cmd, logs / "up.log", "[disagg-slo]")
    address = f"127.0.0.1:{port}"
    phases: dict[str, Any] = {}
    try:
        wait_serving(address, popen, timeout=300)
        time.sleep(1.0)
        run_phase(address, 2.0, 4, {"warm": (1.0, 0, "")}, args, 999, vocab)
        c = args.capacity
        phases["unloaded"] = run_phase(address, 0.25 * c, max(20, args.num_prompts // 3),
                                       {"high": (1.0, 0, "")}, args, args.seed, vocab)
        phases["priorities"] = run_phase(address, 2 * c, args.num_prompts,
                                         {"high": (0.25, 0, ""), "low": (0.75, 1, "")}, args, args.seed + 1, vocab)
        phases["fair_share"] = run_phase(address, 2 * c, args.num_prompts,
                                         {"a": (0.75, 0, "a"), "b": (0.25, 0, "b")}, args, args.seed + 2, vocab)
    finally:
        drivers.stop_up(popen)
    for phase, classes in phases.items():
        for name, row in classes.items():
            print(f"{phase:>10} {name:>4}: sent {row['sent']}, completed {row['completed']} (within SLOs "
                  f"{row['good']}), refused {row['refused']}, goodput {row['goodput']:.2f} req/s, TTFT p50/p99 "
                  f"{row['ttft_p50_ms'] or 0:.0f}/{row['ttft_p99_ms'] or 0:.0f} ms")
    unloaded = phases["unloaded"]["high"]["ttft_p99_ms"]
    loaded = phases["priorities"]["high"]["ttft_p99_ms"]
    a, b = phases["fair_share"]["a"]["good"], phases["fair_share"]["b"]["good"]
    print(f"high class TTFT p99 under 2x overload / unloaded: {loaded / unloaded:.2f}x (goal <= 1.5x)")
    print(f"fair share: client b (1/4 of the requests) got {b / max(1, a + b):.0%} of the served requests "
          f"(a: {a}, b: {b}; sending-rate share 25%, fair share 50% while both wait)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slo_classes.json").write_text(json.dumps({"args": vars(args), "phases": phases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
