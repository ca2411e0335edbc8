"""What bench/grammar_backends.py collects and how it reports it: the timing helpers (nanosecond
samples -> mean/min/p50/p95/max ms), the CPU it ran on, the ``Results`` container (also what
``--json-out`` writes), and the Markdown tables made from it.

    python bench/grammar_results.py /tmp/grammar.json     # the tables again, from a --json-out file
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable


def ms(ns: float) -> float:
    return ns / 1e6


def summarize(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    if not s:
        return {}
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"n": len(s), "mean_ms": ms(statistics.fmean(s)), "min_ms": ms(s[0]), "p50_ms": ms(pick(0.5)),
            "p95_ms": ms(pick(0.95)), "max_ms": ms(s[-1])}


def timed(fn: Callable[[], Any]) -> tuple[int, Any]:
    t0 = time.perf_counter_ns()
    out = fn()
    return time.perf_counter_ns() - t0, out


def cpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"logical_cpus": os.cpu_count(), "machine": platform.machine()}
    try:
        first = open("/proc/cpuinfo").read().split("\n\n")[0]
        fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["model_name"] = fields.get("model name", "?")
        info["family_model_stepping"] = f"{fields.get('cpu family')}/{fields.get('model')}/{fields.get('stepping')}"
        info["mhz"] = fields.get("cpu MHz")
        flags = set(fields.get("flags", "").split())
        info["simd"] = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile") if f in flags]
    except OSError:
        info["model_name"] = platform.processor() or "?"
    return info


@dataclass
class Results:
    """Every measurement's rows, by table; ``meta``: the machine, versions, vocabularies, flags."""
    meta: dict[str, Any] = field(default_factory=dict)
    tokenizer_info: list[dict[str, Any]] = field(default_factory=list)
    compile: list[dict[str, Any]] = field(default_factory=list)
    mask: list[dict[str, Any]] = field(default_factory=list)
    agreement: list[dict[str, Any]] = field(default_factory=list)
    apply: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if abs(x) < 100 else f"{x:.1f}"
    return str(x).replace("|", "\\|").replace("\n", " ")   # a Markdown cell


def table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(f(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def examples(count: int, names: list[str]) -> str:
    return f"{count} e.g. {' '.join(names)}" if names else str(count)


def apply_table(rows: list[dict[str, Any]]) -> str:
    """The apply rows (bench/bitmask_apply.py): one per variant, vocabulary and batch size."""
    return table(["variant", "vocab", "B", "mean", "min", "p95", "first call", "== xgrammar"],
                 [[r["variant"], r["vocab"], r["batch"], r.get("mean_ms"), r.get("min_ms"), r.get("p95_ms"),
                   r.get("first_call_ms"), r.get("identical_to_xgrammar", r.get("error"))] for r in rows])


def report(res: Results) -> str:
    m = res.meta
    parts = [f"## grammar backends on {m['cpu']['model_name']} ({m['cpu']['logical_cpus']} logical CPUs, "
             f"family/model/stepping {m['cpu'].get('family_model_stepping')}, SIMD {m['cpu'].get('simd')})",
             f"xgrammar {m['versions']['xgrammar']}, llguidance {m['versions']['llguidance']}, torch "
             f"{m['versions']['torch']}, transformers {m['versions']['transformers']}; threads: {m['threads']} "
             f"({m['thread_settings']}); repeats {m['repeats']}",
             "vocabularies: " + "; ".join(f"{v['key']} = {v['label']} (tokenizer {v['tokenizer_size']} ids, "
                                           f"logits/bitmask width {v['model_vocab']}, eos {v['eos']})"
                                           for v in m["vocabs"]),
             "", "### tokenizer-info construction (once per vocabulary)",
             table(["lib", "vocab", "mean ms", "min ms", "n"],
                   [[r["lib"], r["vocab"], r["mean_ms"], r["min_ms"], r["n"]] for r in res.tokenizer_info]),
             "", "### JSON-schema compile + the request's matcher (ms, mean of repeats; first mask = the first "
                 "fill after it)",
             "cold: xgrammar compile_json_schema on an empty GrammarCompiler + GrammarMatcher; llguidance "
             "grammar_from_json_schema + LLMatcher. cached: xgrammar the same compile again (a hit in the "
             "compiler's cache) + GrammarMatcher; llguidance a new LLMatcher from the same grammar string "
             "(it has no compiled-grammar cache).",
             table(["lib", "vocab", "case", "cold compile", "+first mask", "cold max", "cached compile",
                    "+first mask"],
                   [[r["lib"], r["vocab"], r["case"], r["cold"]["mean_ms"], r["cold_first_mask"]["mean_ms"],
                     r["cold"]["max_ms"], r["cached"]["mean_ms"], r["cached_first_mask"]["mean_ms"]]
                    for r in res.compile]),
             "", "### mask computation per decode step, whole batch (fill every row, then accept every "
                 "token; ms/step over all steps of all repeats)",
             "slowest step: the step with the largest median over repeats, and lane 0's text before it + its token.",
             table(["lib", "vocab", "case", "B", "api", "steps", "mean", "p50", "p95", "max", "of which accept",
                    "rejected", "slowest step (median ms @ where)"],
                   [[r["lib"], r["vocab"], r["case"], r["batch"], r["api"], r["steps"], r["mean_ms"], r["p50_ms"],
                     r["p95_ms"], r["max_ms"], r["accept_mean_ms"], r["rejected"],
                     f"{r['slowest_step_median_ms']:.3f} @ {r['slowest_step_at']}"]
                    for r in res.mask])]
    # a summary: mean over cases (excluding "mixed") of mean ms/step
    summary: dict[tuple, list[float]] = {}
    for r in res.mask:
        if r["case"] != "mixed":
            summary.setdefault((r["lib"], r["vocab"], r["batch"], r["api"]), []).append(r["mean_ms"])
    parts += ["", "### summary: mask ms/step, averaged over the schemas",
              table(["lib", "vocab", "B", "api", "mean of means", "worst schema"],
                    [[*k, statistics.fmean(v), max(v)] for k, v in sorted(summary.items())])]
    if res.agreement:
        parts += ["", "### do the two libraries compute the same masks? (B=1 walk, per step)",
                  table(["vocab", "case", "steps", "identical", "token-steps only xgrammar allows (most frequent)",
                         "token-steps only llguidance allows"],
                        [[r["vocab"], r["case"], r["steps"], r["identical_steps"],
                          examples(r['tokens_only_xgrammar_allows'], r['examples_only_xgrammar']),
                          examples(r['tokens_only_llguidance_allows'], r['examples_only_llguidance'])]
                         for r in res.agreement])]
    if res.probes:
        parts += ["", "### edge probes: can the library produce this valid text? (compile, walk its tokens, EOS)",
                  table(["probe", "vocab", "text", "xgrammar", "llguidance"],
                        [[r["probe"], r["vocab"], repr(r["text"]), r.get("xgrammar"), r.get("llguidance")]
                         for r in res.probes])]
    parts += ["", "### applying the bitmask to float32 logits [B, V] in place (ms per call)", apply_table(res.apply)]
    if res.problems:
        parts += ["", "### problems", *[f"- {p}" for p in res.problems]]
    return "\n".join(parts)



def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json_file", help="a file written by bench/grammar_backends.py --json-out")
    args = p.parse_args(argv)
    with open(args.json_file) as fh:
        print(report(Results(**json.load(fh))))


if __name__ == "__main__":
    main()
