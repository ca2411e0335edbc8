#!/usr/bin/env python
"""pdserve's OpenAI-compatible HTTP API against its gRPC API: one cluster, one workload, three
load generators, back to back.

It starts ``pdserve up --http-port PORT`` (router + workers as separate processes on
127.0.0.1; disaggregated 1P+1D by default, ``--colocated`` for one colocated worker), then runs

* ``grpc``:        ``pdserve bench serve`` against the router's gRPC API (token-id prompts);
* ``openai``:      ``vllm bench serve --backend openai`` against ``/v1/completions``;
* ``openai-chat``: ``vllm bench serve --backend openai-chat`` against ``/v1/chat/completions``;

each with random prompts of ``--input-len`` tokens, ``--output-len`` output tokens
(``ignore_eos``), greedy, Poisson arrivals at ``--request-rate``, ``--num-prompts`` prompts and
``--num-warmups`` warmups, and a different seed per run so no run hits another's prefix cache.
vLLM is never a dependency of pdserve: its benchmark runs as ``vllm.benchmarks.serve``
(``add_cli_args`` + ``main``) under another interpreter, ``--vllm-python`` (default
``/work/vllm-venv/bin/python``), with ``--tokenizer`` set to the model directory. vLLM's random
dataset decodes random token ids to text, so its prompts are re-tokenized by the router
(``input_lens`` come from the usage the server reports) and chat prompts carry the chat
template's few extra tokens.

Finally it prints a table: every metric of each run as its load generator measured it, the mean
TTFT / ITL / E2E as the router measured them (its Prometheus histograms, the same code for both
protocols), the CPU time the router, the workers and the
load generator spent during each run (read from /proc: on a shared machine the one figure that
does not depend on what else runs), and each HTTP run over the mean of the gRPC
runs (``--runs grpc,openai,openai-chat,grpc`` brackets the HTTP runs with gRPC ones, which shows
how much the shared machine drifted meanwhile). Example::

    PYTHONPATH=. python bench/openai_vs_grpc.py --num-prompts 100 --request-rate 4
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

RUNS = ("grpc", "openai", "openai-chat")
PERCENTILES = (50, 90, 99)
SERVED_NAME = "pdserve-small"
VLLM_MAIN = ("import argparse, sys\n"
             "from vllm.benchmarks.serve import add_cli_args, main\n"
             "p = argparse.ArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


def start_up(model: str, port: int, http_port: int, args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    setup = ["--colocated-workers", "1"] if args.colocated else ["--prefill-workers", "1", "--decode-workers", "1"]
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--http-port", str(http_port), "--served-model-name", SERVED_NAME, "--threads", str(args.threads),
           *setup, *shlex.split(args.engine_args)]
    return drivers.start_up(cmd, log_path, "$")


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_pids(up_pid: int) -> dict[str, list[int]]:
    """The router's and the workers' pids among `pdserve up`'s children."""
    out: dict[str, list[int]] = {"router": [], "workers": []}
    children = subprocess.run(["pgrep", "-P", str(up_pid)], capture_output=True, text=True).stdout.split()
    for pid in map(int, children):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        out["router" if b"router" in argv else "workers"].append(pid)
    return out


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far: the router, the workers, this process (the gRPC load generator) and
    its waited-for children (vLLM's load generator)."""
    import resource
    return {"router": sum(map(_cpu_s, pids["router"])), "workers": sum(map(_cpu_s, pids["workers"])),
            "client": time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
            + resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime}


ROUTER_HISTOGRAMS = {"ttft": "pdserve:time_to_first_token_seconds", "itl": "pdserve:inter_token_latency_seconds",
                     "e2el": "pdserve:e2e_request_latency_seconds"}


def router_histograms(http_port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of the router's latency histograms, from its /metrics on the HTTP port."""
    from pdserve.services.common.metrics import scrape_by_name
    values = scrape_by_name(f"127.0.0.1:{http_port}")
    return {k: (values.get(f"{m}_sum", 0.0), values.get(f"{m}_count", 0.0)) for k, m in ROUTER_HISTOGRAMS.items()}


def run_grpc(args: argparse.Namespace, port: int, seed: int, out_dir: Path, label: str = "grpc") -> dict[str, Any]:
    from pdserve.services.loadtest.serve import main as bench_main
    name = f"{label.replace('#', '-')}.json"
    argv = ["--router", f"127.0.0.1:{port}", "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(args.request_rate), "--seed", str(seed), "--ignore-eos", "--temperature", "0",
            "--num-warmups", str(args.num_warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--save-result", "--result-dir", str(out_dir),
            "--result-filename", name, "--no-plot"]
    print(f"[{label}] pdserve bench serve {shlex.join(argv)}", flush=True)
    if bench_main(argv) != 0:
        raise RuntimeError("pdserve bench serve failed")
    return json.loads((out_dir / name).read_text())


def run_vllm(backend: str, args: argparse.Namespace, model: str, http_port: int, seed: int, out_dir: Path,
             label: str | None = None) -> dict[str, Any]:
    stem = (label or backend).replace("#", "-")
    name = f"{stem}.json"
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    argv = ["--backend", backend, "--base-url", f"http://127.0.0.1:{http_port}", "--endpoint", endpoint,
            "--model", SERVED_NAME, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", str(seed),
            "--ignore-eos", "--temperature", "0", "--num-warmups", str(args.num_warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--ready-check-timeout-sec", "60", "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", name, "--disable-tqdm"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    print(f"[{stem}] vllm bench serve {shlex.join(argv)}", flush=True)
    log_path = out_dir / f"{stem}.log"
    with open(log_path, "w") as log:
        rc = subprocess.run([args.vllm_python, "-c", VLLM_MAIN, *argv], cwd=out_dir, env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    text = log_path.read_text()
    print(text[text.find("============ Serving Benchmark Result"):][-3000:] if "Serving Benchmark" in text
          else text[-3000:], flush=True)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve --backend {backend} failed (rc {rc}); see {log_path}")
    return json.loads((out_dir / name).read_text())


def _kind(label: str) -> str:
    return label.split("#", 1)[0]


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """One column per run (in run order), then each non-gRPC run over the mean of the gRPC runs."""
    runs = list(results)
    grpc_runs = [results[r] for r in runs if _kind(r) == "grpc"]
    others = [r for r in runs if _kind(r) != "grpc"]
    header = "| metric | " + " | ".join(runs) + " | " + " | ".join(f"{r} / grpc" for r in others) + " |"
    lines = [header, "|---|" + "---:|" * (len(runs) + len(others))]

    def row(label: str, key: str, fmt: str = "{:.1f}") -> None:
        cells = [fmt.format(results[r][key]) for r in runs]
        base = sum(g[key] for g in grpc_runs) / len(grpc_runs) if grpc_runs else 0
        ratios = [f"{results[r][key] / base:.2f}x" if base else "-" for r in others]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")

    lines.append("| completed / failed | " + " | ".join(f"{results[r]['completed']} / {results[r]['failed']}"
                                                       for r in runs) + " |" + " |" * len(others))
    row("mean input tokens", "mean_input_len")
    row("duration (s)", "duration")
    row("request throughput (req/s)", "request_throughput", "{:.2f}")
    row("output throughput (tok/s)", "output_throughput")
    for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        row(f"{label} mean (ms)", f"mean_{m}_ms")
        for p in PERCENTILES:
            row(f"{label} p{p} (ms)", f"p{p}_{m}_ms")
    if all("router_mean_itl_ms" in results[r] for r in runs):
        row("router-side TTFT mean (ms)", "router_mean_ttft_ms")
        row("router-side ITL mean (ms)", "router_mean_itl_ms")
        row("router-side E2E mean (ms)", "router_mean_e2el_ms")
    if all("cpu_router_s" in results[r] for r in runs):
        row("router CPU (s)", "cpu_router_s")
        row("router CPU per output token (us)", "router_cpu_us_per_token", "{:.0f}")
        row("workers CPU (s)", "cpu_workers_s")
        row("load generator CPU (s)", "cpu_client_s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = drivers.parser(__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the small model, made on first use)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, in order, of {', '.join(RUNS)}; "
                                                        "a run may repeat (e.g. grpc,openai,openai-chat,grpc)")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each run wait (up to --max-wait-s) until the 1-min load average is at most this")
    p.add_argument("--max-wait-s", type=float, default=600.0)
    p.add_argument("--colocated", action="store_true", help="one colocated worker instead of 1 prefill + 1 decode")
    drivers.add_load_flags(p, seed_help="run i uses seed + i")
    p.add_argument("--engine-args", default="", help="extra engine flags for every worker")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                   help="an interpreter with vLLM installed (for its benchmark only)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs = drivers.names(args.runs, RUNS, "run")
    from pdserve.services.deployment.launcher import free_port, wait_serving

    model, out_dir = drivers.model_and_results(args, "openai-vs-grpc")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"model {model}; {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out tokens, Poisson "
          f"{args.request_rate} req/s, {'colocated' if args.colocated else '1P+1D'}, commit {commit}, "
          f"{os.cpu_count()} CPUs; results in {out_dir}", flush=True)
    port, http_port = free_port(), free_port()
    popen = start_up(model, port, http_port, args, out_dir / "up.log")
    results: dict[str, dict[str, Any]] = {}
    load: dict[str, list[float]] = {}
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        time.sleep(1.0)
        pids = cluster_pids(popen.pid)
        for i, run in enumerate(runs):
            label = run if runs[:i].count(run) == 0 else f"{run}#{runs[:i].count(run) + 1}"
            drivers.wait_for_quiet(args.max_load, args.max_wait_s)
            before = os.getloadavg()[0]
            seed = args.seed + i
            cpu0, hist0 = cpu_snapshot(pids), router_histograms(http_port)
            result = (run_grpc(args, port, seed, out_dir, label) if run == "grpc"
                      else run_vllm(run, args, model, http_port, seed, out_dir, label))
            cpu1, hist1 = cpu_snapshot(pids), router_histograms(http_port)
            for key in ROUTER_HISTOGRAMS:   # the same latencies, as the router saw them (warmups included)
                total, count = (hist1[key][0] - hist0[key][0]), (hist1[key][1] - hist0[key][1])
                result[f"router_mean_{key}_ms"] = total / count * 1e3 if count else 0.0
            for who in cpu0:   # whole runs (warmups, dataset set-up included), in CPU seconds
                result[f"cpu_{who}_s"] = cpu1[who] - cpu0[who]
            result["router_cpu_us_per_token"] = result["cpu_router_s"] / max(1, result["total_output_tokens"]) * 1e6
            lens = result.get("input_lens") or []
            result["mean_input_len"] = sum(lens) / len(lens) if lens else float(result.get(
                "total_input_tokens", 0)) / max(1, result["completed"])
            results[label] = result
            load[label] = [round(before, 2), round(os.getloadavg()[0], 2)]
            print(f"[{label}] 1-min load average before / after: {load[label][0]} / {load[label][1]}", flush=True)
    finally:
        drivers.stop_up(popen, 60.0)
    table = comparison_table(results)
    print("\n" + table + "\n")
    summary = {"args": vars(args), "commit": commit, "model": model, "table_markdown": table,
               "loadavg_before_after": load,
               "results": {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, (list, dict))}
                           for k, v in results.items()}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out_dir / 'summary.json'}", flush=True)
    return 0 if all(r["failed"] == 0 and r["completed"] == args.num_prompts for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
