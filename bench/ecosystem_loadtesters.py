#!/usr/bin/env python
"""The load testers users already have, unchanged, against pdserve's OpenAI API: NVIDIA's aiperf
and the vLLM project's guidellm, each in its own virtualenv, each at a version pinned here.

For each tool in ``--tools``: its virtualenv under ``--venv-dir`` (default
``$PDSERVE_HOME/loadtesters/TOOL``) is made once and the pinned release pip-installed there (reused
while it holds that version); then the tool runs one short profile against ``--base-url``, or
else against a ``pdserve serve`` this script starts on free ports on 127.0.0.1 (``--model``, else
the default model; ``--serve-args`` added to its flags) and stops, with every process of it, at
the end, also on an error, Ctrl-C or SIGTERM. The profile: ``--requests`` streamed chat
completions of synthetic prompts of ``--input-tokens`` tokens asking for ``--output-tokens``
tokens (``ignore_eos``), ``--concurrency`` at a time. The tokenizer is the model's local directory
(``--tokenizer``, else the model's): the Hugging Face Hub is never asked (guidellm runs with
HF_HUB_OFFLINE=1; aiperf 0.13.0 cannot load a directory in offline mode, see AIPERF_ENV).

Printed per tool: the exact command, the tool's own output (its summary table at the end), and
what its report says went wrong; the exit code is non-zero when a tool failed or its report counts
a failed request. Every tool's output, report and the server's logs go to ``--result-dir``::

    PDSERVE_HOME=/tmp/ph1 python bench/ecosystem_loadtesters.py
    python bench/ecosystem_loadtesters.py --tools aiperf --base-url http://127.0.0.1:8000 \\
        --tokenizer /path/to/checkpoint

guidellm depends on torch: its virtualenv takes a few GB (the CUDA build from PyPI)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.vs_vllm_commands import format_command, machine_info, wait_for_quiet  # noqa: E402
from bench.vs_vllm_procs import ProcessGroup, free_port, wait_http  # noqa: E402
from bench.vs_vllm_server import run_stopping_servers  # noqa: E402

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass(frozen=True, slots=True)
class Profile:
    requests: int = 32
    concurrency: int = 4
    input_tokens: int = 128
    output_tokens: int = 32
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str     # http://HOST:PORT, without /v1
    model: str        # the served name (GET /v1/models)
    tokenizer: str    # the model's local checkpoint directory


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    package: str
    version: str
    command: Callable[[Path, Target, Profile, Path], list[str]]   # (venv, target, profile, out) -> argv
    problems: Callable[[Path, Profile], list[str]]                # (out) -> what its report says went wrong
    summary_starts: str                                           # the line of its output that opens its summary
    env: dict[str, str] = field(default_factory=lambda: dict(OFFLINE_ENV))

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# ---- aiperf ------------------------------------------------------------------------------------
def aiperf_command(venv: Path, target: Target, profile: Profile, out: Path) -> list[str]:
    """--apply-chat-template: the prompt is --isl tokens with the chat template, as the server counts
    it. (aiperf 0.13.0 still reports its ISL without the template: with transformers 5,
    apply_chat_template returns a BatchEncoding, not the list it checks for; hence its "Token Count
    Discrepancy" warning.)"""
    return [str(venv / "bin" / "aiperf"), "profile", "--model", target.model, "--url", target.base_url,
            "--endpoint-type", "chat", "--streaming", "--tokenizer", target.tokenizer, "--apply-chat-template",
            "--isl", str(profile.input_tokens), "--isl-stddev", "0",
            "--osl", str(profile.output_tokens), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(profile.concurrency), "--request-count", str(profile.requests),
            "--random-seed", str(profile.seed), "--artifact-dir", str(out), "--ui", "none",
            "--no-gpu-telemetry"]


def aiperf_problems(out: Path, profile: Profile) -> list[str]:
    """From profile_export_aiperf.json: failed requests, and fewer completed than asked for."""
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    done = int((report.get("request_count") or {}).get("avg", 0))
    failed = int((report.get("error_request_count") or {}).get("avg", 0))
    problems = [f"{failed} failed requests: {report.get('error_summary')}"] if failed else []
    if done != profile.requests:
        problems.append(f"{done} requests completed, {profile.requests} sent")
    return problems


# ---- guidellm ----------------------------------------------------------------------------------
def guidellm_command(venv: Path, target: Target, profile: Profile, out: Path) -> list[str]:
    return [str(venv / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={target.base_url},model={target.model},"
                         "request_format=/v1/chat/completions",
            "--profile", f"kind=concurrent,streams={profile.concurrency}",
            "--constraint", f"kind=max_requests,count={profile.requests}",
            "--tokenizer", f"kind=huggingface_auto,model={target.tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={profile.input_tokens},"
                      f"output_tokens={profile.output_tokens}",
            "--seed", f"kind=static,value={profile.seed}",
            "--output", f"kind=json,path={out / 'benchmarks.json'}",
            "--disable-console-interactive"]


def guidellm_problems(out: Path, profile: Profile) -> list[str]:
    """From benchmarks.json: errored or incomplete requests, and fewer successful than asked for."""
    report = json.loads((out / "benchmarks.json").read_text())
    problems = []
    for bench in report["benchmarks"]:
        totals = bench["scheduler_metrics"]["requests_made"]
        if totals["errored"] or totals["incomplete"]:
            problems.append(f"{totals['errored']} errored, {totals['incomplete']} incomplete requests")
        if totals["successful"] != profile.requests:
            problems.append(f"{totals['successful']} requests successful, {profile.requests} asked for")
    return problems or ([] if report["benchmarks"] else ["no benchmark in the report"])


# aiperf 0.13.0 in offline mode looks a tokenizer up only in the Hub's cache, through
# snapshot_download(name), which refuses a directory (HFValidationError: "Repo id must be in the
# form ..."); out of offline mode a local directory is loaded as it is, the Hub never asked.
AIPERF_ENV = {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "HF_DATASETS_OFFLINE": "1"}
TOOLS = {t.name: t for t in (Tool("aiperf", "aiperf", "0.13.0", aiperf_command, aiperf_problems,
                                  "NVIDIA AIPerf | LLM Metrics", AIPERF_ENV),
                             Tool("guidellm", "guidellm", "0.8.1", guidellm_command, guidellm_problems,
                                  "Run Summary Info"))}
SUMMARY_LINES_ON_FAILURE = 60


# ---- venvs, server, runs -----------------------------------------------------------------------
def ensure_venv(tool: Tool, root: Path) -> Path:
    """root/TOOL, a virtualenv holding the pinned release (made, or brought to it, when not)."""
    venv = root / tool.name
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"[{tool.name}] making a virtualenv in {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = f"import importlib.metadata as m; print(m.version({tool.package!r}))"
    held = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if held.returncode != 0 or held.stdout.strip() != tool.version:
        print(f"[{tool.name}] pip install {tool.requirement} into {venv}", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", tool.requirement], check=True)
    return venv


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def default_tokenizer(model: str | None) -> str:
    """The model's checkpoint directory: --model when it is one, else the default model's."""
    if model and Path(model).is_dir():
        return str(model)
    from pdserve.engine.checkpoints.default_model import default_model_dir
    from pdserve.engine.settings import pdserve_home
    path = default_model_dir(pdserve_home())
    if not (path / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer in {path}: pass --tokenizer DIR (a local checkpoint directory)")
    return str(path)


@contextlib.contextmanager
def pdserve_server(model: str | None, serve_args: list[str], logs: Path, timeout: float) -> Iterator[str]:
    """`pdserve serve` on free ports of 127.0.0.1 in its own process group, healthy: its base URL.
    On leaving, the group is stopped as a whole and checked for leftovers."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve.services.cli", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
           "--log-dir", str(logs / "pdserve"), *serve_args]
    env = {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"[pdserve] {format_command(cmd)}", flush=True)
    server = ProcessGroup("pdserve", cmd, logs / "pdserve-serve.log", env)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        wait_http(server, [f"{base}/health"], timeout)
        server.refresh()
        print(f"[pdserve] healthy after {time.monotonic() - t0:.0f}s at {base}", flush=True)
        yield base
    finally:
        left = server.stop()
        print(f"WARNING: [pdserve] processes left after the stop: {left}" if left
              else "[pdserve] stopped; no process of it left", file=sys.stderr if left else sys.stdout, flush=True)


def run_tool(tool: Tool, venv: Path, target: Target, profile: Profile, out: Path, timeout: float) -> list[str]:
    """One run of tool in its own process group (stopped as a whole after); its output printed;
    what went wrong (nothing: an empty list)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = tool.command(venv, target, profile, out)
    print(f"\n===== {tool.name} {tool.version}\n$ {format_command(cmd, tool.env)}", flush=True)
    run = ProcessGroup(tool.name, cmd, out / f"{tool.name}.log", tool.env)
    try:
        rc = run.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        left = run.stop()
    print(summary(tool, (out / f"{tool.name}.log").read_text(errors="replace")), flush=True)
    problems = [f"processes left after its run: {left}"] if left else []
    if rc != 0:
        return [*problems, f"exit code {rc}" if rc is not None else f"still running after {timeout:.0f}s"]
    try:
        return problems + tool.problems(out, profile)
    except (OSError, KeyError, ValueError) as exc:
        return [*problems, f"unreadable report: {exc!r}"]


def summary(tool: Tool, output: str) -> str:
    """The tool's output from the line that opens its summary (none: its last lines)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if tool.summary_starts in line), None)
    return "\n".join(lines[start:] if start is not None else lines[-SUMMARY_LINES_ON_FAILURE:])


def measure(args: argparse.Namespace) -> int:
    tools = [TOOLS[n] for n in drivers.names(args.tools, TOOLS, "tool")]
    profile = Profile(**{f.name: getattr(args, f.name) for f in fields(Profile)})
    out = drivers.result_dir(args.result_dir, "ecosystem-loadtesters")
    venvs = {t.name: ensure_venv(t, Path(args.venv_dir)) for t in tools}
    info = machine_info()
    load = wait_for_quiet(args.max_load, 600)
    print(f"machine: {info['cpu_model']}, {info['cpus']} CPUs, load {load:.2f}; results in {out}", flush=True)
    tokenizer = args.tokenizer or default_tokenizer(args.model)
    with (contextlib.nullcontext(args.base_url.rstrip("/")) if args.base_url
          else pdserve_server(args.model, shlex.split(args.serve_args), out, args.startup_timeout_s)) as base:
        target = Target(base, served_model(base), tokenizer)
        failed: dict[str, list[str]] = {}
        for tool in tools:
            problems = run_tool(tool, venvs[tool.name], target, profile, out / tool.name, args.tool_timeout_s)
            print(f"[{tool.name}] " + ("; ".join(problems) if problems else "completed, no failed request"),
                  flush=True)
            if problems:
                failed[tool.name] = problems
    print(f"\nload after the runs: {os.getloadavg()[0]:.2f}; results in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from pdserve.engine.settings import pdserve_home
    p = drivers.parser(__doc__)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    p.add_argument("--venv-dir", default=str(pdserve_home() / "loadtesters"),
                   help="where each tool's virtualenv lives (default: $PDSERVE_HOME/loadtesters)")
    p.add_argument("--base-url", default=None, help="a running server (http://HOST:PORT); default: start pdserve serve")
    p.add_argument("--model", default=None, help="pdserve serve's MODEL (default: its default model)")
    p.add_argument("--serve-args", default="", help="more flags for pdserve serve, one string")
    p.add_argument("--tokenizer", default=None, help="a local checkpoint directory (default: the model's)")
    drivers.add_flags(p, **asdict(Profile()), startup_timeout_s=300.0, tool_timeout_s=600.0)
    p.add_argument("--result-dir", default=None, help="default: a new folder under /tmp")
    p.add_argument("--max-load", type=float, default=None,
                   help="first wait (at most 10 min) for the 1-minute load average to drop to this")
    return run_stopping_servers(lambda: measure(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
