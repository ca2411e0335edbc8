#!/usr/bin/env python
"""Offline throughput of the installed pdserve against a base source tree, interleaved: each round
runs `pdserve bench offline --skip-hf` (the engine alone, the same workload and seed) once from the
base tree and once from this install, alternating which goes first. For a change that should not
move the engine's speed (a refactor), against the tree before it::

    git archive 9fbfe0b | (mkdir -p /tmp/pd-base && tar -x -C /tmp/pd-base)
    python bench/ab_offline.py /tmp/pd-base --rounds 4

The base tree runs from its folder with PYTHONPATH set to it, as `python -m services.cli` (the
layout before the one import name) or `python -m pdserve` (a later tree, whose pdserve/ holds the
package; install it elsewhere to compare two such trees). Prints each run's output tok/s, each
side's mean, and the ratio new/base.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(cmd: list[str], cwd: Path | None, env: dict[str, str], out: Path) -> float:
    subprocess.run([*cmd, "bench", "offline", "--skip-hf", "--json", str(out), *EXTRA], cwd=cwd, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return json.loads(out.read_text())["pdserve"]["output_tok_s"]


EXTRA: list[str] = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="the base source tree")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    EXTRA.extend(["--num-prompts", str(args.num_prompts), "--seed", str(args.seed)])
    base = args.base.resolve()
    base_cmd = [sys.executable, "-m", "services.cli" if (base / "services" / "cli" / "__main__.py").exists()
                and not (base / "pdserve" / "__main__.py").exists() else "pdserve"]
    base_env = {**os.environ, "PYTHONPATH": str(base)}
    new_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    runs: dict[str, list[float]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            for side in order:
                tok_s = _run(base_cmd, base, base_env, out) if side == "base" else \
                    _run([sys.executable, "-m", "pdserve"], None, new_env, out)
                runs[side].append(tok_s)
                print(f"round {r + 1} {side:4s}: {tok_s:8.1f} output tok/s", flush=True)
    mean = {side: statistics.mean(v) for side, v in runs.items()}
    spread = {side: (max(v) - min(v)) / mean[side] for side, v in runs.items()}
    print(f"base: {mean['base']:.1f} tok/s (spread {spread['base']:.1%}); new: {mean['new']:.1f} tok/s "
          f"(spread {spread['new']:.1%}); new/base {mean['new'] / mean['base']:.3f}x")


if __name__ == "__main__":
    main()
