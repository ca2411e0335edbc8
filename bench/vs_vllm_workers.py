"""bench/vs_vllm.py's workers, run as `python bench/vs_vllm.py _<worker> ...` in each side's own
python: the offline runs of pdserve and vLLM on one workload file, and vLLM's load generator on the
same requests and arrival times. Standard library only at import (vLLM's venv loads it)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from bench.vs_vllm_commands import vllm_load_argv
from bench.vs_vllm_compare import read_workload, workload_digest


def _served_model(base_url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
            data = json.loads(resp.read())
        return data["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
        return None


def _offline_worker_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pdserve-args", default="")
    p.add_argument("--dtype", default="bfloat16")
    return p.parse_args(argv)


def pdserve_offline_worker(argv: Sequence[str]) -> int:
    """Runs in its own process with pdserve's python: warm-up, then one timed generate."""
    a = _offline_worker_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.services.common.config_flags import add_config_args, given   # the engine flags `pdserve up` forwards
    ep = argparse.ArgumentParser(prog="--pdserve-args")
    add_config_args(ep, EngineConfig, exclude=("model", "role"))
    eargs = ep.parse_args(shlex.split(a.pdserve_args))
    kwargs = {**given(eargs, EngineConfig, ("model", "role")), "num_threads": a.threads}
    if kwargs.get("device", "auto") == "auto":
        kwargs["device"] = "cpu"
    wl = read_workload(a.workload)
    llm = LLM(a.model, **kwargs)

    def params(outs: Sequence[int], seed0: int) -> list:
        return [SamplingParams(temperature=wl["temperature"], max_tokens=n, ignore_eos=wl["ignore_eos"], seed=seed0 + i)
                for i, n in enumerate(outs)]

    llm.generate(wl["warmup_prompts"], params(wl["warmup_output_lens"], 10_000))
    t0 = time.perf_counter()
    outs = llm.generate(wl["prompts"], params(wl["output_lens"], 0))
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    runner = llm.engine.runner
    Path(a.out).write_text(json.dumps({
        "side": "pdserve", "elapsed_s": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + sum(map(len, wl["prompts"]))) / elapsed,
        "digest": workload_digest(wl["prompts"], wl["output_lens"]), "engine_kwargs": kwargs,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "compute_dtype": str(getattr(runner, "compute_dtype", runner.dtype)).removeprefix("torch."),
        "max_num_seqs": llm.config.max_num_seqs, "max_num_batched_tokens": llm.config.max_num_batched_tokens,
        "per_request_seed": True}, indent=1))
    print(f"pdserve offline: {produced / elapsed:.1f} tok/s ({elapsed:.2f} s)", flush=True)
    return 0


def vllm_offline_worker(argv: Sequence[str]) -> int:
    """Runs with vLLM's python: vllm.LLM, warm-up, then one timed generate. No per-request seed:
    vLLM-CPU crashes on one ("CPU Generator does not use offset")."""
    a = _offline_worker_args(argv)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    wl = read_workload(a.workload)
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=2048)

    def params(outs: Sequence[int]) -> list:
        return [SamplingParams(temperature=wl["temperature"], max_tokens=n, ignore_eos=wl["ignore_eos"]) for n in outs]

    llm.generate([{"prompt_token_ids": p} for p in wl["warmup_prompts"]], params(wl["warmup_output_lens"]),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl["prompts"]], params(wl["output_lens"]), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    Path(a.out).write_text(json.dumps({
        "side": "vllm", "elapsed_s": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + sum(map(len, wl["prompts"]))) / elapsed,
        "digest": workload_digest(wl["prompts"], wl["output_lens"]), "vllm": vllm.__version__,
        "torch": torch.__version__, "dtype": a.dtype, "max_model_len": 2048,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"), "per_request_seed": False}, indent=1))
    print(f"vLLM offline: {produced / elapsed:.1f} tok/s ({elapsed:.2f} s)", flush=True)
    # vLLM's engine processes end with the interpreter; leave through the normal path
    del llm
    return 0


def vllm_load_worker(argv: Sequence[str]) -> int:
    """Runs with vLLM's python: vllm.benchmarks.serve (add_cli_args + main), with the workload's
    token-id prompts, output lengths and arrival times put in place of its dataset sampling."""
    p = argparse.ArgumentParser()
    for name in ("--workload", "--base-url", "--backend", "--tokenizer", "--result-dir", "--result-filename", "--label"):
        p.add_argument(name, required=True)
    a = p.parse_args(argv)
    import vllm.benchmarks.serve as vserve
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    if not hasattr(vserve, "get_samples"):
        raise SystemExit(f"vllm {getattr(vserve, '__name__', '')}: no get_samples to hand the workload over; "
                         "this script knows vllm-cpu 0.32")
    wl = read_workload(a.workload)
    model = _served_model(a.base_url) or a.tokenizer

    def requests(warmup: bool) -> list:
        prompts = wl["warmup_prompts"] if warmup else wl["prompts"]
        outs = wl["warmup_output_lens"] if warmup else wl["output_lens"]
        times = [0.0] * len(prompts) if warmup else wl["arrival_s"]
        prefix = f"{a.label}-{'warmup' if warmup else 'bench'}-{os.getpid()}-"
        return [SampleRequest(prompt=list(pr), prompt_len=len(pr), expected_output_len=int(n),
                              request_id=f"{prefix}{i}", timestamp=float(t))
                for i, (pr, n, t) in enumerate(zip(prompts, outs, times))]

    results = None
    for warmup in ((True, False) if wl["warmup_prompts"] else (False,)):
        parser = FlexibleArgumentParser()
        vserve.add_cli_args(parser)
        args = parser.parse_args(vllm_load_argv(wl, a.base_url, a.backend, a.tokenizer, model, a.result_dir,
                                                a.result_filename, a.label, warmup=warmup))
        reqs = requests(warmup)
        vserve.get_samples = lambda _args, _tok, reqs=reqs: reqs
        print(f"{'warm-up' if warmup else 'benchmark'}: {len(reqs)} requests to {a.base_url}", flush=True)
        results = vserve.main(args)
        if results.get("completed", 0) == 0:
            print("no request completed", file=sys.stderr)
            return 1
    return 0
