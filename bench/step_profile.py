#!/usr/bin/env python
"""Per-phase timing of the engine (the ``small`` model, or ``--model DIR``): prefill tok/s and decode
step time.

Prefill: ``--prefill-seqs`` prompts of ``--prefill-len`` tokens in one step each (the default
4 x 512 = one 2048-token step), median over ``--reps`` steps. Decode: for each batch size in
``--batches``, that many sequences with ``--ctx`` tokens of context decode ``--steps`` steps;
the median step time (scheduling, input preparation, forward and sampling: ``engine.step()``),
wall and CPU time of this process (the steadier figure on a shared machine).
``--profile`` prints torch.profiler's top ops of a few decode steps at the largest batch.
Temperature 0.6 with a per-request seed, as in the offline benchmark. Example::

    PYTHONPATH=. python bench/step_profile.py --threads 1 --batches 1,8,32,64
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

from bench import drivers  # noqa: E402


def _engine(args: argparse.Namespace, max_seqs: int):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    kwargs = {"num_threads": args.threads, "device": "cpu", "max_num_seqs": max(max_seqs, args.prefill_seqs),
              "max_num_batched_tokens": max(2048, args.prefill_len * args.prefill_seqs)}
    if args.compute_dtype:
        kwargs["compute_dtype"] = args.compute_dtype
    if args.quantization:
        kwargs["quantization"] = args.quantization
    return LLMEngine(EngineConfig.from_kwargs(drivers.model_dir(args.model), **kwargs))


def _prompts(n: int, length: int, seed: int, vocab: int = 8192) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def measure_prefill(engine, args: argparse.Namespace) -> tuple[float, float]:
    from pdserve.engine import SamplingParams

    times, cpu = [], []
    for rep in range(args.reps + 1):
        for i, p in enumerate(_prompts(args.prefill_seqs, args.prefill_len, 100 + rep, engine.model_config.vocab_size)):
            engine.add_request(f"p{rep}-{i}", p, SamplingParams(temperature=0.6, max_tokens=1, seed=i, ignore_eos=True))
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        while engine.has_unfinished_requests():
            engine.step()
    tokens = args.prefill_seqs * args.prefill_len
    return tokens / statistics.median(times[1:]), tokens / statistics.median(cpu[1:])


def measure_decode(engine, batch: int, args: argparse.Namespace, profile: bool = False) -> tuple[float, float]:
    from pdserve.engine import SamplingParams

    for i, p in enumerate(_prompts(batch, args.ctx, 7 + batch, engine.model_config.vocab_size)):
        engine.add_request(f"d{batch}-{i}", p, SamplingParams(temperature=0.6, max_tokens=args.steps + 4, seed=i,
                                                               ignore_eos=True))
    while any(s.is_prefilling or s.num_computed_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if profile:
        import torch
        with torch.profiler.profile() as prof:
            for _ in range(3):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = drivers.parser(__doc__)
    drivers.add_flags(p, threads=1, compute_dtype=None, quantization=None, batches="1,8,32,64", ctx=400, steps=20,
                      prefill_len=512, prefill_seqs=4, reps=3)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the small model)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engine = _engine(args, max(batches))
    r = engine.runner
    backend = getattr(getattr(r, "backend", None), "name", "torch")   # older trees have no backend object
    wall, cpu = measure_prefill(engine, args)
    result = {"compute_dtype": str(r.compute_dtype), "backend": backend, "prefill_tok_s": wall,
              "prefill_tok_per_cpu_s": cpu, "decode_step_ms": {}, "decode_step_cpu_ms": {}}
    print(f"backend {backend}, compute {r.compute_dtype}; prefill {args.prefill_seqs} x {args.prefill_len}: "
          f"{wall:.0f} tok/s ({cpu:.0f} per CPU-second)", flush=True)
    for b in batches:
        ms, cpu_ms = measure_decode(engine, b, args, profile=args.profile and b == batches[-1])
        result["decode_step_ms"][b], result["decode_step_cpu_ms"][b] = ms, cpu_ms
        print(f"decode batch {b:>3}, ctx {args.ctx}: {ms:6.2f} ms/step ({cpu_ms:6.2f} ms CPU)", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
