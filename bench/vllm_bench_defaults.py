#!/usr/bin/env python
"""vLLM's own load tester, ``vllm bench serve``, at its defaults against vLLM-CPU's OpenAI server
and against ``pdserve serve``, side by side in one run, one server at a time, on the same model.

The load is ``vllm bench serve``'s default: its random dataset (1,024 input / 128 output tokens,
ignore_eos, seed 0), every request sent at once (request rate inf), the server's own sampling
defaults, over ``/v1/completions``; only ``--num-prompts`` (200 here, 1,000 in vLLM) is set, and
the model, base URL and result file. The same client (vLLM's, in ``--vllm-python``'s virtualenv)
measures both servers. vllm-cpu's ``vllm`` console script is broken in that distribution (its
version lookup asks for a package named vllm), so the client runs as that command does:
``vllm.benchmarks.serve``'s ``add_cli_args`` and ``main`` (VLLM_BENCH_SERVE).

The model (``--model``, else pdserve's default model, SmolLM2-135M-Instruct) is resolved to its
local checkpoint directory, which both servers serve and the client tokenizes with. vLLM's server
is started as ``bench/vs_vllm.py online`` starts it (``--vllm-dtype``, ``--vllm-kvcache-gib``,
``--vllm-omp-bind``: bench/vs_vllm_server.py), ``--vllm-args`` added; then ``pdserve serve``,
``--pdserve-args`` added. Each binds 127.0.0.1 on free ports and is stopped with its whole
process group (checked) after its run, also on an error, Ctrl-C or SIGTERM.

Each run's JSON result (``--save-result``) goes to ``--result-dir`` (``vllm.json``,
``pdserve.json``) with the servers' and the client's logs and ``summary.json``. Printed: a
table (completed / failed, duration, request and output throughput, TTFT p50 / p99, TPOT p50,
the ratio pdserve / vLLM of duration and throughputs), the CPU, the 1-minute load average before
each run and the git commit. The exit code is 1 when pdserve completed fewer than
``--num-prompts`` requests or a side gave no result::

    python bench/vllm_bench_defaults.py --vllm-python /work/vllm-venv/bin/python
    python bench/vllm_bench_defaults.py --pdserve-args "--disaggregation always"   # every prompt on the prefill worker
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.ecosystem_loadtesters import OFFLINE_ENV, pdserve_server  # noqa: E402
from bench.vs_vllm import VLLM_PYTHON_ENV  # noqa: E402
from bench.vs_vllm_commands import format_command, git_info, machine_info, vllm_dtype, warn_if_dirty  # noqa: E402
from bench.vs_vllm_compare import ratio  # noqa: E402
from bench.vs_vllm_procs import ProcessGroup  # noqa: E402
from bench.vs_vllm_server import add_vllm_args, run_stopping_servers, vllm_command, vllm_server  # noqa: E402

SIDES = ("vllm", "pdserve")    # the order they run in
# `vllm bench serve ARGS` without the console script: what its subcommand runs (add_cli_args, main)
VLLM_BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "from vllm.benchmarks.serve import add_cli_args, main; "
                    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
                    "main(p.parse_args(sys.argv[1:]))")
SUMMARY_STARTS = "Serving Benchmark Result"   # the line of the client's output that opens its summary


def bench_serve_args(base_url: str, model: str, num_prompts: int, result_dir: Path, side: str) -> list[str]:
    """`vllm bench serve`'s arguments: its defaults but for the number of prompts, and the result file."""
    return ["--base-url", base_url, "--model", model, "--num-prompts", str(num_prompts),
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{side}.json"]


def bench_serve_command(vllm_python: str, argv: list[str]) -> list[str]:
    return [vllm_python, "-c", VLLM_BENCH_SERVE, *argv]


def read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pair(r: dict[str, Any] | None, a: str, b: str, fmt: str) -> str:
    return "-" if r is None else f"{_num(r.get(a), fmt)} / {_num(r.get(b), fmt)}"


def _ratio(pd: dict[str, Any] | None, vl: dict[str, Any] | None, key: str) -> str:
    x = ratio(pd.get(key) if pd else None, vl.get(key) if vl else None)
    return "-" if x is None else f"{x:.2f}x"


def comparison_table(vl: dict[str, Any] | None, pd: dict[str, Any] | None,
                     loads: dict[str, float | None]) -> str:
    """vLLM's and pdserve's results side by side (a missing one: '-'), with pdserve / vLLM of the
    duration and throughputs. p50 is vllm bench serve's median."""
    get = lambda r, key, fmt: "-" if r is None else _num(r.get(key), fmt)  # noqa: E731
    lines = ["| | vLLM | pdserve | pdserve / vLLM |", "|---|---:|---:|---:|",
             f"| completed / failed | {_pair(vl, 'completed', 'failed', 'd')} | "
             f"{_pair(pd, 'completed', 'failed', 'd')} | |"]
    for label, key, fmt in (("duration (s)", "duration", ".1f"),
                            ("request throughput (req/s)", "request_throughput", ".3f"),
                            ("output throughput (tok/s)", "output_throughput", ".1f")):
        lines.append(f"| {label} | {get(vl, key, fmt)} | {get(pd, key, fmt)} | {_ratio(pd, vl, key)} |")
    lines.append(f"| TTFT p50 / p99 (ms) | {_pair(vl, 'median_ttft_ms', 'p99_ttft_ms', '.0f')} | "
                 f"{_pair(pd, 'median_ttft_ms', 'p99_ttft_ms', '.0f')} | |")
    lines.append(f"| TPOT p50 (ms) | {get(vl, 'median_tpot_ms', '.1f')} | {get(pd, 'median_tpot_ms', '.1f')} | |")
    lines.append(f"| 1-min load average before | {_num(loads.get('vllm'), '.2f')} | "
                 f"{_num(loads.get('pdserve'), '.2f')} | |")
    return "\n".join(lines)


def problems(results: dict[str, dict[str, Any] | None], num_prompts: int) -> list[str]:
    """What makes the run fail: a side without a result, pdserve completing fewer than asked for."""
    found = [f"{side}: no result" for side in SIDES if results.get(side) is None]
    pd = results.get("pdserve")
    if pd is not None and pd.get("completed", 0) < num_prompts:
        found.append(f"pdserve completed {pd.get('completed', 0)} of {num_prompts} requests")
    return found


def client_summary(output: str) -> str:
    """The client's summary table from its output (not found: its last lines)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if SUMMARY_STARTS in line), None)
    if start is None:
        return "\n".join(lines[-30:])
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and set(lines[i].strip()) == {"="}),
               len(lines) - 1)
    return "\n".join(lines[start:end + 1])


def run_side(side: str, server: ContextManager[str], args: argparse.Namespace, model: str, out: Path,
             record: dict[str, Any]) -> dict[str, Any] | None:
    """One server up, `vllm bench serve` against it in its own process group, the server down:
    the client's JSON result (None when it gave none; the reason in record)."""
    entry: dict[str, Any] = {}
    record["runs"][side] = entry
    try:
        with server as base:
            argv = bench_serve_args(base, model, args.num_prompts, out, side)
            cmd = bench_serve_command(args.vllm_python, argv)
            entry["loadavg_1m_before"] = round(os.getloadavg()[0], 2)
            entry["command"] = "vllm bench serve " + shlex.join(argv)
            entry["ran_as"] = format_command(cmd, OFFLINE_ENV)
            print(f"\n===== [{side}] load average {entry['loadavg_1m_before']:.2f}; {entry['command']}", flush=True)
            client = ProcessGroup(f"vllm-bench-{side}", cmd, out / f"bench-{side}.log", OFFLINE_ENV)
            try:
                rc = client.wait(args.bench_timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                left = client.stop()
            print(client_summary((out / f"bench-{side}.log").read_text(errors="replace")), flush=True)
            entry.update(rc=rc, client_left=left)
            if rc != 0:
                entry["error"] = f"vllm bench serve exit code {rc}" if rc is not None else \
                    f"vllm bench serve still running after {args.bench_timeout_s:.0f}s"
    except (RuntimeError, TimeoutError, OSError) as exc:   # a server not healthy, a client not started
        entry["error"] = str(exc)
    if "error" in entry:
        print(f"[{side}] FAILED: {entry['error']} (logs in {out})", file=sys.stderr, flush=True)
        return None
    return read_result(out / f"{side}.json")


def measure(args: argparse.Namespace) -> int:
    from pdserve.engine.checkpoints.resolve import ModelResolveError, ModelSpecError, resolve_model   # lazy: torch
    try:
        model = resolve_model(args.model, report=lambda text: print(text, flush=True))
    except (ModelSpecError, *ModelResolveError) as exc:
        raise SystemExit(f"--model: {exc}") from None
    out = drivers.result_dir(args.result_dir, "vllm-bench-defaults")
    info, git = machine_info(), git_info()
    warn_if_dirty(git)
    vllm_cmd, vllm_env = vllm_command(args, model, 0, extra=shlex.split(args.vllm_args))
    record: dict[str, Any] = {"model": model, "num_prompts": args.num_prompts, "git": git, "machine": info,
                              "vllm_server": format_command(vllm_cmd, vllm_env).replace("--port 0", "--port PORT"),
                              "pdserve_args": args.pdserve_args, "runs": {}}
    print(f"model {model}; results in {out}", flush=True)
    servers: dict[str, Callable[[], ContextManager[str]]] = {
        "vllm": lambda: vllm_server(args, model, out, extra=shlex.split(args.vllm_args)),
        "pdserve": lambda: pdserve_server(model, shlex.split(args.pdserve_args), out, args.pdserve_startup_timeout_s)}
    results = {}
    try:
        for side in SIDES:
            results[side] = run_side(side, servers[side](), args, model, out, record)
    finally:
        (out / "summary.json").write_text(json.dumps(record, indent=1))
    loads = {side: record["runs"].get(side, {}).get("loadavg_1m_before") for side in SIDES}
    print(f"\n`vllm bench serve` defaults, {args.num_prompts} prompts, model {Path(model).name}")
    print(comparison_table(results.get("vllm"), results.get("pdserve"), loads))
    print(f"machine: {info['cpu_model']}, {info['cpus']} CPUs; vLLM dtype {vllm_dtype(args.vllm_dtype)}; "
          f"git {git.get('short')}{' (dirty)' if git.get('dirty') else ''}; results in {out}")
    found = problems(results, args.num_prompts)
    for line in found:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if found else 0


def build_parser() -> argparse.ArgumentParser:
    p = drivers.parser(__doc__)
    p.add_argument("--num-prompts", type=int, default=200, help="requests, all sent at once (default 200)")
    p.add_argument("--model", default=None,
                   help="what pdserve's --model takes (default: pdserve's default model, SmolLM2-135M-Instruct)")
    p.add_argument("--result-dir", default=None, help="default: a new folder under /tmp")
    p.add_argument("--pdserve-args", default="",
                   help="more flags for pdserve serve, one string (a single flag: --pdserve-args=--FLAG)")
    p.add_argument("--vllm-args", default="", help="more flags for vLLM's server, one string")
    p.add_argument("--pdserve-startup-timeout-s", type=float, default=300.0)
    p.add_argument("--bench-timeout-s", type=float, default=3600.0, help="the most one vllm bench serve run may take")
    add_vllm_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.vllm_python:
        p.error(f"vllm bench serve and vLLM's server need vLLM's python: --vllm-python PATH or ${VLLM_PYTHON_ENV}")
    if not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist")
    if args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    return run_stopping_servers(lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main())
