"""Offline throughput: the pdserve engine vs. Hugging Face transformers ``generate``.

Both run in this process, on the same prompts, with the same torch thread count and dtype.
The model is the deterministic ``small`` qwen3 checkpoint (bf16, 8 layers, hidden 512),
made once under ``$PDSERVE_HOME/models`` (default ``~/.cache/pdserve/models``).

Workload: ``--num-prompts`` prompts of random token ids (fixed seed), input lengths uniform
in [64, 512], output lengths uniform in [64, 256], ignore_eos, temperature 0.6, one seed per
request. pdserve gets every request at once (continuous batching). HF runs static batches
(left padding + attention mask, plain temperature sampling, ``max_new_tokens`` and
``min_new_tokens`` = the longest requested output in the batch) for each of
``--hf-batch-sizes``; only the tokens each prompt asked for count as useful output, and
the best batch size is reported. Example::

    pdserve bench offline --threads 1 --json /tmp/offline.json   # or python bench/offline_throughput.py

``main(argv)`` is the entry point of ``pdserve bench offline``; ``run(argv)`` returns the results.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.model_config import ModelConfig

MODEL_PRESET, MODEL_ARCH, MODEL_SEED = "small", "qwen3", 0
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_prompts: int, vocab_size: int, input_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        n = rng.randint(*input_range)
        prompts.append([rng.randrange(2, vocab_size) for _ in range(n)])   # skip eos (0) / bos (1)
        outs.append(rng.randint(*output_range))
    return Workload(prompts, outs)


# ---------------------------------------------------------------- model


def ensure_model(model_dir: str | None) -> Path:
    """The benchmark checkpoint: ``model_dir`` if given, else made once in the cache (atomically)."""
    from pdserve.engine.model_maker import ensure_model as make_once   # lazy: torch only when this runs
    return Path(model_dir) if model_dir else make_once(MODEL_PRESET, MODEL_ARCH, MODEL_SEED)


# ---------------------------------------------------------------- pdserve


def run_pdserve(model_dir: Path, wl: Workload, args: argparse.Namespace, warmup: Workload) -> dict[str, Any]:
    from pdserve.engine import LLM, SamplingParams   # lazy: the engine (torch) only when the benchmark runs

    kwargs: dict[str, Any] = {"dtype": args.dtype, "num_threads": args.threads, "device": "cpu"}
    if args.compute_dtype is not None:
        kwargs["compute_dtype"] = args.compute_dtype
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(str(model_dir), **kwargs)

    def params(w: Workload, seed0: int) -> list:
        return [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=seed0 + i)
                for i, n in enumerate(w.output_lens)]

    llm.generate(warmup.prompts, params(warmup, 10_000))
    steps0 = llm.engine.num_steps
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(wl.prompts, params(wl, 0))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    produced = sum(len(o.token_ids) for o in outs)
    if produced != wl.num_output_tokens:
        raise RuntimeError(f"pdserve produced {produced} tokens, {wl.num_output_tokens} requested")
    cfg = llm.config
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tok_s": produced / elapsed,
        "cpu_s": cpu,                                  # this process's CPU time: steadier than wall time on a busy machine
        "output_tok_per_cpu_s": produced / cpu,
        "total_tok_s": (produced + wl.num_input_tokens) / elapsed,
        "steps": llm.engine.num_steps - steps0,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "compute_dtype": str(getattr(llm.engine.runner, "compute_dtype", llm.engine.runner.dtype)).removeprefix("torch."),
    }


# ---------------------------------------------------------------- HF transformers


def _hf_batch(model, torch, prompts: list[list[int]], new_tokens: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):   # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    if out.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new_tokens}")


def run_hf(model_dir: Path, wl: Workload, args: argparse.Namespace, warmup: Workload) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    with torch.inference_mode():
        torch.manual_seed(0)
        _hf_batch(model, torch, warmup.prompts, max(warmup.output_lens), pad_id)
        results = {}
        for bs in args.hf_batch_sizes:
            torch.manual_seed(0)
            t0 = time.perf_counter()
            for start in range(0, len(wl.prompts), bs):
                _hf_batch(model, torch, wl.prompts[start:start + bs], max(wl.output_lens[start:start + bs]), pad_id)
            elapsed = time.perf_counter() - t0
            results[bs] = {"elapsed_s": elapsed, "output_tok_s": wl.num_output_tokens / elapsed}
            print(f"  hf batch {bs:>3}: {results[bs]['output_tok_s']:8.1f} output tok/s ({elapsed:.1f} s)", flush=True)
    best = max(results, key=lambda b: results[b]["output_tok_s"])
    return {"per_batch_size": results, "best_batch_size": best,
            "output_tok_s": results[best]["output_tok_s"], "dtype": str(model.dtype).removeprefix("torch.")}


def hf_greedy(model_dir: str, prompts: list[list[int]], tokens: int, dtype) -> list[list[int]]:
    """Hugging Face transformers' greedy continuations (tokens each, EOS not stopping) in dtype."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=None, help="prompts in the workload (default 64; 8 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="default: the checkpoint's (bfloat16)")
    p.add_argument("--compute-dtype", choices=DTYPES, default=None,
                   help="pdserve only: activation/matmul dtype (engine default 'auto': chosen from the CPU by "
                        "engine.cpu_features, e.g. bf16 with AMX, float32 without fast bf16 GEMMs; the KV cache "
                        "stays in --dtype)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="pdserve max_num_seqs (default: engine default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="pdserve max_num_batched_tokens (default: engine default)")
    p.add_argument("--hf-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated static batch sizes for HF (default 8,16,32,64; 4,8 with --quick)")
    p.add_argument("--model-dir", default=None, help="checkpoint to use instead of the cached small model")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 prompts, inputs 16-64 tokens, outputs 8-32 tokens")
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 8 if args.quick else 64
    if args.hf_batch_sizes is None:
        args.hf_batch_sizes = [4, 8] if args.quick else [8, 16, 32, 64]
    for name in ("num_prompts", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.hf_batch_sizes):
        p.error("--hf-batch-sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``pdserve bench offline``): prints the figures, returns 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the results (what ``--json`` writes)."""
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)

    model_dir = ensure_model(args.model_dir)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    if args.quick:
        wl = make_workload(args.num_prompts, vocab, (16, 64), (8, 32), args.seed)
    else:
        wl = make_workload(args.num_prompts, vocab, (64, 512), (64, 256), args.seed)
    warmup = make_workload(2, vocab, (16, 32), (8, 8), args.seed + 1_000_003)
    print(f"model {model_dir}\nworkload: {len(wl.prompts)} prompts, {wl.num_input_tokens} input tokens, "
          f"{wl.num_output_tokens} output tokens; threads {args.threads}", flush=True)

    pd = run_pdserve(model_dir, wl, args, warmup)
    print(f"pdserve: {pd['output_tok_s']:8.1f} output tok/s ({pd['elapsed_s']:.1f} s, {pd['steps']} steps, "
          f"{pd['output_tok_per_cpu_s']:.1f} output tok per CPU-second, "
          f"dtype {pd['dtype']} (compute {pd['compute_dtype']}), max_num_seqs {pd['max_num_seqs']}, "
          f"max_num_batched_tokens {pd['max_num_batched_tokens']})", flush=True)
    result: dict[str, Any] = {
        "model_dir": str(model_dir), "threads": args.threads, "num_prompts": len(wl.prompts),
        "input_tokens": wl.num_input_tokens, "output_tokens": wl.num_output_tokens,
        "quick": args.quick, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__, "pdserve": pd,
    }
    if not args.skip_hf:
        hf = run_hf(model_dir, wl, args, warmup)
        result["hf"] = hf
        result["ratio"] = pd["output_tok_s"] / hf["output_tok_s"]
        print(f"hf (best batch {hf['best_batch_size']}): {hf['output_tok_s']:8.1f} output tok/s, dtype {hf['dtype']}")
        print(f"pdserve / hf: {result['ratio']:.2f}x")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
