#!/usr/bin/env python
"""How soon the `pdserve` command answers, as a user meets it: best of N runs (and the median) of

* ``pdserve --help`` until it exits;
* ``pdserve generate --router ADDR PROMPT`` until its first output byte (the first token's text)
  and until it exits, against a running deployment (``--router``; without it this script starts a
  1P1D deployment of the tiny random-weight model (``--model tiny``) on free ports and stops it
  afterwards: the client's start-up is measured, not the model's);
* ``pdserve generate --router`` against an address where nothing listens, until it exits (with
  code 1 and one error line).

    python bench/cli_startup.py [--router HOST:PORT] [--runs 5] [--json out.json]

Each run is a fresh process (the console script on PATH, else ``python -m services.cli.entry``), so
imports count as a user pays them. Measure on a quiet machine: on a shared one the numbers are
the neighbours' as much as pdserve's.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

RUN_TIMEOUT_S = 120.0


def pdserve_command() -> list[str]:
    exe = shutil.which("pdserve")
    return [exe] if exe else [sys.executable, "-m", "pdserve.services.cli.entry"]


def timed_run(argv: list[str]) -> tuple[float | None, float, int, str]:
    """(seconds to the first stdout byte or None, seconds to exit, exit code, stderr)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)
    first = None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = start + RUN_TIMEOUT_S
    while True:
        if not sel.select(timeout=max(0.0, deadline - time.perf_counter())):
            proc.kill()
            raise TimeoutError(f"{' '.join(argv)}: no end after {RUN_TIMEOUT_S:g}s")
        data = os.read(proc.stdout.fileno(), 65536)
        if data and first is None:
            first = time.perf_counter() - start
        if not data:
            break
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    return first, time.perf_counter() - start, code, err


def best_of(runs: int, argv: list[str], what: str, expect_code: int = 0) -> dict[str, float | None]:
    firsts, totals = [], []
    for _ in range(runs):
        first, total, code, err = timed_run(argv)
        if code != expect_code:
            raise RuntimeError(f"{what}: exit code {code}, expected {expect_code}: {err.strip()[-500:]}")
        totals.append(total)
        if first is not None:
            firsts.append(first)
    out = {"best_s": min(totals), "median_s": statistics.median(totals),
           "first_output_best_s": min(firsts) if firsts else None,
           "first_output_median_s": statistics.median(firsts) if firsts else None}
    first_note = (f", first output byte best {out['first_output_best_s']:.3f} s (median "
                  f"{out['first_output_median_s']:.3f} s)" if firsts and expect_code == 0 and "generate" in what else "")
    print(f"{what:<44} exit best {out['best_s']:.3f} s (median {out['median_s']:.3f} s){first_note}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default=None, help="a running router (default: start a 1P1D deployment here)")
    p.add_argument("--runs", type=int, default=5, help="runs of each command; the best and the median are shown")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    from pdserve.services.deployment.launcher import free_port

    cmd = pdserve_command()
    cluster = None
    if args.router is None:
        from pdserve.engine.checkpoints.resolve import resolve_model
        from pdserve.services.deployment.launcher import Cluster, Deployment
        cluster = Cluster(Deployment(model=resolve_model("tiny"), port=free_port()))
        print("starting a 1P1D deployment of the tiny model ...", file=sys.stderr, flush=True)
        cluster.start()
        args.router = cluster.router_address
    try:
        results = {
            "help": best_of(args.runs, [*cmd, "--help"], "pdserve --help"),
            "generate": best_of(args.runs, [*cmd, "generate", "--router", args.router, "Once upon a time",
                                            "--max-tokens", "4"], f"pdserve generate --router {args.router}"),
            "unreachable": best_of(args.runs, [*cmd, "generate", "--router", f"127.0.0.1:{free_port()}", "hi"],
                                   "pdserve generate --router (nothing there)", expect_code=1),
        }
    finally:
        if cluster is not None:
            cluster.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "runs": args.runs, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
