"""vLLM-CPU's OpenAI server as one setup of a side-by-side benchmark (bench/slo_goodput.py,
bench/multi_turn.py): its flags, the check that a run can include it, the server started as
``bench/vs_vllm.py online`` starts it and stopped as a whole, and a run that stops every
server on SIGTERM too. vLLM lives in its own virtualenv, never a pdserve dependency."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from bench.vs_vllm import VENV_TOOL, VLLM_PYTHON_ENV
from bench.vs_vllm_commands import default_omp_bind, format_command, vllm_dtype, vllm_env, vllm_server_command
from bench.vs_vllm_procs import ProcessGroup, _on_sigterm, _Terminated, free_port, wait_http


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                   help=f"python of a virtualenv with vLLM's CPU build (default ${VLLM_PYTHON_ENV}); make one with "
                        f"{VENV_TOOL} DIR")
    p.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="vLLM's --dtype; auto: bfloat16 where the CPU has AMX or AVX512-BF16, else float32")
    p.add_argument("--vllm-omp-bind", default=default_omp_bind(1),
                   help="VLLM_CPU_OMP_THREADS_BIND (default 0, as bench/vs_vllm.py online at --threads 1: the engine "
                        "on core 0, the other core for vLLM's API server; 0-1: the engine on both; 'auto': vLLM's)")
    p.add_argument("--vllm-kvcache-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--vllm-startup-timeout-s", type=float, default=600)


def check_vllm_setup(p: argparse.ArgumentParser, args: argparse.Namespace, setups: list[str]) -> None:
    """Without a vLLM python the setup "vllm" is dropped, saying so (an error where --setups
    named it); a python that does not exist is an error."""
    if "vllm" in setups and not args.vllm_python:
        if args.setups:
            p.error(f"setup vllm needs vLLM's python: --vllm-python PATH or ${VLLM_PYTHON_ENV} "
                    f"(make a venv with {VENV_TOOL} DIR)")
        setups.remove("vllm")
        print(f"skipping setup vllm: no vLLM python given (--vllm-python PATH or ${VLLM_PYTHON_ENV})", flush=True)
    if "vllm" in setups and not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist (make a venv with {VENV_TOOL} DIR)")


def vllm_command(args: argparse.Namespace, model: str, port: int, max_model_len: int = 2048,
                 extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """vLLM's server command and environment overrides, as bench/vs_vllm.py online makes them."""
    return (vllm_server_command(args.vllm_python, model, port, max_model_len, extra=extra,
                                dtype=vllm_dtype(args.vllm_dtype)),
            vllm_env(args.vllm_kvcache_gib, args.vllm_omp_bind))


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, model: str, logs: Path, max_model_len: int = 2048,
                extra: Sequence[str] = ()) -> Iterator[str]:
    """The server in its own process group, healthy: its base URL. On leaving the group is
    stopped as a whole and checked for leftovers."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd, env = vllm_command(args, model, port, max_model_len, extra)
    print(f"[vllm] {format_command(cmd, env)}", flush=True)
    server = ProcessGroup("vllm", cmd, logs / "vllm-server.log", env)
    try:
        t0 = time.monotonic()
        wait_http(server, [f"{base}/health"], args.vllm_startup_timeout_s)
        server.refresh()
        print(f"[vllm] healthy after {time.monotonic() - t0:.0f}s", flush=True)
        yield base
    finally:
        left = server.stop()
        if left:
            print(f"WARNING: [vllm] processes left after the stop: {left}", file=sys.stderr, flush=True)
        else:
            print("[vllm] stopped; no process of it left", flush=True)


def run_stopping_servers(measure: Callable[[], int]) -> int:
    """measure(), with SIGTERM unwinding as Ctrl-C does, so that every server it started is stopped."""
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return measure()
    except (KeyboardInterrupt, _Terminated):
        print("\ninterrupted; the servers were stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
