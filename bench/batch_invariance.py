#!/usr/bin/env python
"""The cost of batch-invariant mode: the same engine with ``batch_invariant`` on and off, side by
side in one run (alternating rounds, so a busy machine slows both alike), on the ``small`` bf16
qwen3 checkpoint of the other benchmarks.

Prints, per mode, offline throughput (every prompt at once, output tok/s by wall time and by this
process's CPU time), a prefill step's tokens/s and the decode step time at a few batch sizes, and
the ratio invariant / default of each (CPU-time figures are the steadier ones on a shared machine).
Example::

    PYTHONPATH=. python bench/batch_invariance.py --threads 1 --json /tmp/bi.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from pdserve.services.loadtest.offline import ensure_model, make_workload  # noqa: E402
from bench.step_profile import measure_decode, measure_prefill    # noqa: E402

MODES = {"default": False, "invariant": True}


def _engine(model: Path, args: argparse.Namespace, invariant: bool, max_seqs: int):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    # No prefix caching: later rounds send the same prompts again.
    kwargs = {"num_threads": args.threads, "device": "cpu", "max_num_seqs": max_seqs, "batch_invariant": invariant,
              "enable_prefix_caching": False,
              "max_num_batched_tokens": max(2048, args.prefill_len * args.prefill_seqs)}
    if args.compute_dtype:
        kwargs["compute_dtype"] = args.compute_dtype
    return LLMEngine(EngineConfig.from_kwargs(str(model), **kwargs))


def measure_offline(engine, args: argparse.Namespace) -> tuple[float, float]:
    """Output tokens per wall second and per CPU second, every prompt queued at once."""
    from pdserve.engine import SamplingParams

    wl = make_workload(args.num_prompts, 8192, (64, 512), (32, 128), seed=0)
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
        engine.add_request(f"o{time.monotonic_ns()}-{i}", p,
                           SamplingParams(temperature=0.6, max_tokens=n, seed=i, ignore_eos=True))
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wl.num_output_tokens / wall, wl.num_output_tokens / cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = drivers.parser(__doc__)
    drivers.add_flags(p, threads=1, compute_dtype=None, batches="1,8,32", ctx=256, steps=10, prefill_len=512,
                      prefill_seqs=2, reps=2, num_prompts=16)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per mode; the best of each is kept")
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    model = ensure_model(None)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {name: _engine(model, args, inv, max(batches + [args.num_prompts])) for name, inv in MODES.items()}
    best: dict[str, dict[str, float]] = {name: {} for name in MODES}

    def keep(name: str, key: str, value: float, higher_is_better: bool) -> None:
        old = best[name].get(key)
        if old is None or (value > old if higher_is_better else value < old):
            best[name][key] = value

    for _ in range(args.rounds):
        for name, engine in engines.items():
            wall, cpu = measure_offline(engine, args)
            keep(name, "offline_tok_s", wall, True)
            keep(name, "offline_tok_per_cpu_s", cpu, True)
            wall, cpu = measure_prefill(engine, args)
            keep(name, "prefill_tok_s", wall, True)
            keep(name, "prefill_tok_per_cpu_s", cpu, True)
            for b in batches:
                wall_ms, cpu_ms = measure_decode(engine, b, args)
                keep(name, f"decode_ms_b{b}", wall_ms, False)
                keep(name, f"decode_cpu_ms_b{b}", cpu_ms, False)
    runner = engines["invariant"].runner
    result = {
        "cpu": platform.processor() or platform.machine(),
        "compute_dtype": str(runner.compute_dtype).removeprefix("torch."),
        "kv_dtype": str(runner.dtype).removeprefix("torch."),
        "invariant_in_force": runner.batch_invariant,
        "threads": args.threads,
        "modes": best,
        "ratio_invariant_over_default": {k: best["invariant"][k] / best["default"][k] for k in best["default"]},
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    from pdserve.engine.cpu_features import detect
    print(f"CPU: {detect().model}; compute {result['compute_dtype']}, KV {result['kv_dtype']}, "
          f"{result['threads']} thread(s); invariant mode in force: {result['invariant_in_force']}")
    print(f"{'metric':26s} {'default':>10s} {'invariant':>10s} {'ratio':>7s}")
    for key, ratio in result["ratio_invariant_over_default"].items():
        print(f"{key:26s} {result['modes']['default'][key]:10.2f} {result['modes']['invariant'][key]:10.2f} "
              f"{ratio:7.3f}")
    print("(tok/s: higher is better, ms: lower is better; ratio = invariant / default)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
