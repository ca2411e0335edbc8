"""bench/vs_vllm.py's command lines and machine facts: how each side's server, load generator and
offline worker are started, the machine and git state recorded with the results, waiting for a
quiet machine. Standard library only at import (vLLM's venv loads it)."""
from __future__ import annotations

import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().with_name("vs_vllm.py")    # its workers run as `python SCRIPT _<worker> ...`
PERCENTILES = (50, 90, 99)
PDSERVE_SETUPS = {
    "1p1d": ["--prefill-workers", "1", "--decode-workers", "1"],
    "colocated": ["--colocated-workers", "1"],
}


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
    cmd = [python, "-m", "pdserve.services.cli", "up", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), *PDSERVE_SETUPS[setup]]
    cmd += ["--http-port", "none" if http_port is None else str(http_port)]
    return cmd + list(extra)


def native_load_command(python: str, router: str, dataset: Path, num_prompts: int, rate: float, seed: int,
                        temperature: float, result_dir: Path | None, result_filename: str | None,
                        burstiness: float = 1.0) -> list[str]:
    """`pdserve bench serve` on a jsonl token-id dataset. With the same seed its arrival schedule is
    services.loadtest.arrivals.arrival_offsets(num_prompts, rate, burstiness, seed), as in make_online_workload."""
    cmd = [python, "-m", "pdserve.services.cli", "bench", "serve", "--router", router, "--dataset-name", "jsonl",
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
    return [vllm_python, str(SCRIPT), "_vllm-load", "--workload", str(workload), "--base-url", base_url,
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
    cmd = [python, str(SCRIPT), f"_{side}-offline", "--workload", str(workload), "--model", model,
           "--out", str(out), "--threads", str(threads)]
    if side == "pdserve" and pdserve_args:
        cmd.append(f"--pdserve-args={shlex.join(pdserve_args)}")   # one token: the value may start with --
    if side == "vllm":
        cmd += ["--dtype", dtype]
    return cmd


def format_command(cmd: Sequence[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    return (prefix + " " if prefix else "") + shlex.join(cmd)


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
