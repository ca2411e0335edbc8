#!/usr/bin/env python
"""TTFT breakdown of disaggregated serving: queue, prefill, exposed KV transfer.

Starts `pdserve up` (1 prefill + 1 decode, real processes, gRPC KV transport) on the
`small` model, sends one request at a time for several prompt lengths and prints the
router's per-request timings (median of --repeats): time to first token as the client
sees it, and its parts as the workers measured them. "transfer" is the KV transfer still
running after the last prefill chunk (earlier chunks ship while later ones compute).

    python bench/ttft_breakdown.py --lengths 128,512,1024 --repeats 3
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.model_maker import ensure_model  # noqa: E402
from pdserve.services.client import Client  # noqa: E402
from pdserve.services.deployment.launcher import Cluster, Deployment, free_port  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the small model)")
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    model = args.model or str(ensure_model("small"))
    spec = Deployment(model=model, port=free_port(), threads_per_worker=args.threads,
                      engine_args=["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                   "--no-enable-prefix-caching"])
    rng = random.Random(0)
    rows = []
    with Cluster(spec) as cluster, Client(cluster.router_address, timeout=300) as client:
        client.generate([5, 6, 7], max_tokens=2, temperature=0.0)   # warm-up
        for length in [int(x) for x in args.lengths.split(",")]:
            samples = []
            for _ in range(args.repeats):
                prompt = [rng.randrange(2, 8000) for _ in range(length)]
                t0 = time.perf_counter()
                out = client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
                samples.append(out.timings | {"client_ms": (time.perf_counter() - t0) * 1e3})
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            rows.append((length, med))
    print(f"TTFT breakdown, 1 prefill + 1 decode, gRPC KV transport, max_num_batched_tokens="
          f"{args.max_num_batched_tokens}, {args.threads} thread(s)/worker, median of {args.repeats}")
    print(f"{'prompt':>7} {'ttft_ms':>9} {'queue_ms':>9} {'prefill_ms':>11} {'transfer_ms':>12} {'other_ms':>9}")
    for length, m in rows:
        other = m["ttft_ms"] - m["queue_ms"] - m["prefill_ms"] - m["kv_transfer_ms"]
        print(f"{length:>7} {m['ttft_ms']:>9.1f} {m['queue_ms']:>9.1f} {m['prefill_ms']:>11.1f} "
              f"{m['kv_transfer_ms']:>12.1f} {other:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
