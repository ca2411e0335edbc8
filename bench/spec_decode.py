"""Speculative decoding against plain decoding and against vLLM-CPU's n-gram speculator, on the
default model (SmolLM2-135M-Instruct), greedy, side by side in one run.

single (default): each prompt (chat-templated) alone, in process, one thread, with and without
--speculative-config, alternating, best of --repeats; then, given vLLM's python (--vllm-python,
default $PDSERVE_VLLM_PYTHON), vLLM-CPU plain and with --vllm-speculative-config (vLLM's own
n-gram settings: the issue's) on the same token ids (bench/spec_decode_vllm.py, one process
each). Decode tok/s = (output tokens - 1) / (time of the whole generate - time of a one-token
generate of the same prompt), for every engine alike. Prints a markdown table per prompt, the
geometric mean over the prompts that copy their input and over those that do not, whether
pdserve's speculative output equals its plain output token for token, the command, the commit
and the CPU.

streams: a 1P1D deployment (router, one prefill and one decode worker as processes, one thread
each) with and without --speculative-config, alternating, --repeats each; --streams concurrent
clients each send the prompt mix in turn over gRPC. Output tok/s over the run's wall time,
inter-chunk latency (ITL: the gap between two streamed messages of a request) p50 / p99, TTFT p50.

    python bench/spec_decode.py --vllm-python /work/vllm-venv/bin/python
    python bench/spec_decode.py streams --streams 8
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.vs_vllm_commands import default_omp_bind, vllm_dtype, vllm_env  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.checkpoints.resolve import resolve_model  # noqa: E402
from pdserve.engine.tokenizer import load_tokenizer  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch, drinking his "
        "morning coffee and wondering whether it will rain before the harvest is done. His wife calls from the "
        "kitchen that breakfast is ready, and the children run in from the barn with straw in their hair.")
CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
PROMPTS = {
    "repeat": f"Repeat this text exactly: {TEXT}",
    "spelling": "Fix the spelling and write the whole text again: Teh quick brown fox jumsp over the lazzy dog "
                "while the farmer wathces from the porch, drinkin his morning cofee and wonderring whether it "
                "will rain befor the harvest is done.",
    "past-tense": "Rewrite this text in the past tense: The quick brown fox jumps over the lazy dog while the "
                  "farmer watches from the porch. He drinks his morning coffee and wonders whether it will rain "
                  "before the harvest is done.",
    "code": f"Add a docstring to each function and write the whole code again:\n{CODE}",
    "summarize": f"Summarize this text in one sentence: {TEXT}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
COPYING = ("repeat", "spelling", "past-tense", "code")   # the answer copies the prompt
SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" (dirty tree)" if dirty else "")


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values and all(v > 0 for v in values) else 0.0


def prompt_ids(model: str, names: list[str]) -> dict[str, list[int]]:
    tokenizer = load_tokenizer(model)
    return {name: tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[name]}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"] for name in names}


# ---- single stream --------------------------------------------------------------------------------

def timed(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].token_ids
    return time.perf_counter() - t0, out


def decode_rate(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    first_s, _ = timed(llm, ids, 1)
    total_s, out = timed(llm, ids, max_tokens)
    return ((len(out) - 1) / (total_s - first_s) if total_s > first_s and len(out) > 1 else 0.0), out


def run_vllm(python: str, model: str, dtype: str, ids: dict[str, list[int]], max_tokens: int, repeats: int,
             spec: dict | None, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pdserve-spec-bench-") as tmp:
        out, job_file = Path(tmp) / "vllm.json", Path(tmp) / "job.json"
        job_file.write_text(json.dumps({"model": model, "dtype": dtype, "prompts": list(ids.values()),
                                        "max_tokens": max_tokens, "repeats": repeats, "speculative_config": spec,
                                        "out": str(out)}))
        env = {**os.environ, **vllm_env(4, default_omp_bind(threads)), "OMP_NUM_THREADS": str(threads)}
        print(f"vLLM {'n-gram ' + json.dumps(spec) if spec else 'plain'} ...", file=sys.stderr, flush=True)
        done = subprocess.run([python, str(REPO_ROOT / "bench" / "spec_decode_vllm.py"), "--job", str(job_file)],
                              capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode or not out.exists():
            raise SystemExit(f"vLLM run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def single(args, model: str, names: list[str]) -> int:
    ids = prompt_ids(model, names)
    common = dict(dtype=args.dtype, compute_dtype=args.compute_dtype, num_threads=args.threads)
    plain = LLM(model, **common)
    spec = LLM(model, speculative_config=args.speculative_config, **common)
    rows, all_equal = {}, True
    for name in names:
        decode_rate(plain, ids[name], args.max_tokens), decode_rate(spec, ids[name], args.max_tokens)   # warm-up
        before = dict(spec.stats())
        best_plain = best_spec = 0.0
        for _ in range(args.repeats):
            rate, out_plain = decode_rate(plain, ids[name], args.max_tokens)
            best_plain = max(best_plain, rate)
            rate, out_spec = decode_rate(spec, ids[name], args.max_tokens)
            best_spec = max(best_spec, rate)
            all_equal &= out_plain == out_spec
        after = spec.stats()
        drafts, proposed, accepted = (after[k] - before[k] for k in (
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
        rows[name] = dict(tokens=len(out_plain), plain=best_plain, spec=best_spec,
                          acceptance=accepted / proposed if proposed else 0.0,
                          per_verification=1 + accepted / drafts if drafts else 1.0)
    plain.close(), spec.close()
    del plain, spec
    vllm = {}
    if args.vllm_python:
        dtype = vllm_dtype(args.vllm_dtype)
        for label, cfg in (("vllm", None), ("vllm_ngram", json.loads(args.vllm_speculative_config))):
            got = run_vllm(args.vllm_python, model, dtype, ids, args.max_tokens, args.repeats, cfg, args.threads)
            vllm["version"], vllm["dtype"] = got["vllm"], dtype
            for name, result in zip(names, got["results"]):
                rows[name][label] = result["tok_s"]
    has_vllm = bool(vllm)
    head = "| prompt | tokens | pdserve plain tok/s | pdserve speculative tok/s | speculative / plain |"
    if has_vllm:
        head += " vLLM tok/s | vLLM n-gram tok/s | pdserve speculative / vLLM n-gram |"
    print(head + " acceptance | tokens / verification |")
    print("|" + "---|" * (head.count("|") + 1))
    for name in names:
        r = rows[name]
        line = f"| {name} | {r['tokens']} | {r['plain']:.1f} | {r['spec']:.1f} | {r['spec'] / r['plain']:.2f}x |"
        if has_vllm:
            line += f" {r['vllm']:.1f} | {r['vllm_ngram']:.1f} | {r['spec'] / r['vllm_ngram']:.2f}x |"
        print(line + f" {r['acceptance']:.0%} | {r['per_verification']:.2f} |")
    for label, group in (("copying", [n for n in names if n in COPYING]),
                         ("not copying", [n for n in names if n not in COPYING])):
        if not group:
            continue
        line = (f"| geometric mean, {label} | | | | {geomean([rows[n]['spec'] / rows[n]['plain'] for n in group]):.2f}x |")
        if has_vllm:
            line += f" | | {geomean([rows[n]['spec'] / rows[n]['vllm_ngram'] for n in group]):.2f}x |"
        print(line + " | |")
    print(f"\npdserve speculative output equals plain output token for token: {all_equal}")
    print(f"pdserve --speculative-config {args.speculative_config}; dtype {args.dtype}, {args.threads} thread(s)")
    if has_vllm:
        print(f"vLLM {vllm['version']} --dtype {vllm['dtype']}, n-gram {args.vllm_speculative_config}, "
              f"OMP bind {default_omp_bind(args.threads)}")
    print(f"command: python bench/spec_decode.py {shlex.join(sys.argv[1:])}")
    print(f"commit {commit()}, CPU {cpu_model()}, load {os.getloadavg()[0]:.2f}")
    return 0 if all_equal else 1


# ---- concurrent streams through a 1P1D deployment --------------------------------------------------

async def _stream_mix(address: str, order: list[list[int]], max_tokens: int) -> list[tuple[float, list[float], int]]:
    """One client sending each prompt in turn: per request (TTFT s, inter-chunk gaps s, tokens;
    its TPOT: the gaps' sum over tokens - 1)."""
    from pdserve.services.client import AsyncClient
    out = []
    async with AsyncClient(address, timeout=600) as client:
        for ids in order:
            t0 = time.perf_counter()
            arrivals, tokens = [], 0
            async for msg in client.generate_stream(ids, max_tokens=max_tokens, temperature=0.0):
                if msg.token_ids:
                    arrivals.append(time.perf_counter())
                    tokens += len(msg.token_ids)
            out.append((arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens))
    return out


async def _run_streams(address: str, ids: list[list[int]], streams: int, max_tokens: int):
    orders = [ids[i % len(ids):] + ids[:i % len(ids)] for i in range(streams)]   # each client starts elsewhere
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_stream_mix(address, order, max_tokens) for order in orders))
    return time.perf_counter() - t0, [r for client in results for r in client]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def streams(args, model: str, names: list[str]) -> int:
    from pdserve.services.deployment.launcher import Cluster, Deployment, free_port
    ids = list(prompt_ids(model, names).values())
    base = ["--dtype", args.dtype, "--compute-dtype", args.compute_dtype]
    setups = {"plain": base, "speculative": [*base, "--speculative-config", args.speculative_config]}
    runs: dict[str, list] = {k: [] for k in setups}
    outputs: dict[str, list] = {}
    for _ in range(args.repeats):
        for label, engine_args in setups.items():
            cluster = Cluster(Deployment(model=model, port=free_port(), engine_args=engine_args,
                                         threads_per_worker=args.threads))
            cluster.start(timeout=300)
            try:
                asyncio.run(_run_streams(cluster.router_address, ids[:2], 2, 8))   # warm-up
                wall, results = asyncio.run(_run_streams(cluster.router_address, ids, args.streams, args.max_tokens))
            finally:
                cluster.stop()
            runs[label].append((wall, results))
            outputs.setdefault(label, sum(r[2] for r in results))
    print("| deployment | output tok/s | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms "
          "| requests | tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for label, label_runs in runs.items():
        rates = [sum(r[2] for r in results) / wall for wall, results in label_runs]
        gaps = [g for _, results in label_runs for r in results for g in r[1]]
        ttfts = [r[0] for _, results in label_runs for r in results]
        tpots = [sum(r[1]) / (r[2] - 1) for _, results in label_runs for r in results if r[2] > 1]
        summary[label] = (sorted(rates)[len(rates) // 2], percentile(gaps, 0.99))
        print(f"| 1P1D {label} | {summary[label][0]:.1f} | {percentile(gaps, 0.5) * 1e3:.1f} | "
              f"{summary[label][1] * 1e3:.1f} | {percentile(tpots, 0.5) * 1e3:.1f} | "
              f"{percentile(tpots, 0.99) * 1e3:.1f} | {percentile(ttfts, 0.5) * 1e3:.0f} | "
              f"{len(label_runs[0][1])} | {outputs[label]} |")
    print(f"\nspeculative / plain output tok/s (median of {args.repeats}): "
          f"{summary['speculative'][0] / summary['plain'][0]:.2f}x; ITL p99 ratio "
          f"{summary['speculative'][1] / summary['plain'][1]:.2f}")
    print(f"same token counts: {outputs['plain'] == outputs['speculative']}")
    print(f"--speculative-config {args.speculative_config}; {args.streams} streams x {len(ids)} prompts, "
          f"dtype {args.dtype}, {args.threads} thread(s) per worker")
    print(f"command: python bench/spec_decode.py {shlex.join(sys.argv[1:])}")
    print(f"commit {commit()}, CPU {cpu_model()}, load {os.getloadavg()[0]:.2f}")
    return 0


def main() -> int:
    p = drivers.parser(__doc__)
    p.add_argument("mode", nargs="?", default="single", choices=("single", "streams"))
    drivers.add_flags(p, model=None, dtype="bfloat16", compute_dtype="auto", threads=1, max_tokens=128, repeats=3,
                      prompts=",".join(PROMPTS), speculative_config=json.dumps(SPEC),
                      vllm_python=os.environ.get("PDSERVE_VLLM_PYTHON"), vllm_dtype="auto",
                      vllm_speculative_config=json.dumps(VLLM_SPEC), streams=8)
    args = p.parse_args()
    model = resolve_model(args.model)
    names = drivers.names(args.prompts, PROMPTS, "prompt")
    return single(args, model, names) if args.mode == "single" else streams(args, model, names)


if __name__ == "__main__":
    sys.exit(main())
