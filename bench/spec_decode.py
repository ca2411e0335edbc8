"""Speculative decoding (n-gram prompt lookup, greedy verification) against plain decoding: single
stream, in process, on the default model (SmolLM2-135M-Instruct) by default.

Each prompt (chat-templated) runs alone, greedily, with and without --speculative-config, the two
engines side by side in one process, alternating, best of --repeats; decode tok/s counts the tokens
after the first over the time after the first (the prompt's prefill is the same in both). Prints a
markdown table (plain and speculative tok/s, speedup, acceptance rate, mean tokens per
verification), whether every output matched token for token, the command, the commit and the CPU.

    python bench/spec_decode.py                               # bf16, one thread, 4 prompts x 128 tokens
    python bench/spec_decode.py --model /path/ckpt --dtype float32 --max-tokens 64
"""
from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.checkpoints.resolve import resolve_model  # noqa: E402
from pdserve.engine.tokenizer import load_tokenizer  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch, drinking his "
        "morning coffee and wondering whether it will rain before the harvest is done.")
CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
PROMPTS = {
    "repeat": f"Repeat this sentence exactly: {TEXT}",
    "spelling": "Fix the spelling and write the whole text again: Teh quick brown fox jumsp over the lazzy dog "
                "while the farmer wathces from the porch, drinkin his morning cofee.",
    "code": f"Add a docstring to each function and write the whole code again:\n{CODE}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def decode_rate(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """(decode tok/s: the tokens after the first over the time after it, the output tokens)."""
    engine = llm.engine
    engine.add_request("bench", ids, params)
    out: list[int] = []
    first_at = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
        if first_at is None and out:
            first_at, first_n = time.perf_counter(), len(out)
    elapsed = time.perf_counter() - first_at
    return (len(out) - first_n) / elapsed if elapsed > 0 else 0.0, out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    p = drivers.parser(__doc__)
    drivers.add_flags(p, model=None, dtype="bfloat16", compute_dtype="auto", threads=1, max_tokens=128, repeats=3,
                      prompts=",".join(PROMPTS), speculative_config=json.dumps(SPEC))
    args = p.parse_args()
    model = resolve_model(args.model)
    names = drivers.names(args.prompts, PROMPTS, "prompt")
    common = dict(dtype=args.dtype, compute_dtype=args.compute_dtype, num_threads=args.threads)
    plain = LLM(model, **common)
    spec = LLM(model, speculative_config=args.speculative_config, **common)
    tokenizer = load_tokenizer(model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, all_equal = [], True
    for name in names:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[name]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        decode_rate(plain, ids, params), decode_rate(spec, ids, params)   # warm-up
        before = dict(spec.stats())
        best_plain = best_spec = 0.0
        for _ in range(args.repeats):
            rate, out_plain = decode_rate(plain, ids, params)
            best_plain = max(best_plain, rate)
            rate, out_spec = decode_rate(spec, ids, params)
            best_spec = max(best_spec, rate)
            all_equal &= out_plain == out_spec
        after = spec.stats()
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        rows.append((name, len(out_plain), best_plain, best_spec, drafts / args.repeats, proposed / args.repeats,
                     accepted / proposed if proposed else 0.0, 1 + accepted / drafts if drafts else 1.0))
    print("| prompt | tokens | plain tok/s | speculative tok/s | speedup | drafts | draft tokens | acceptance "
          "| tokens / verification |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, a, b, drafts, proposed, rate, mean in rows:
        print(f"| {name} | {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {drafts:.0f} | {proposed:.0f} | {rate:.0%} "
              f"| {mean:.2f} |")
    print(f"\noutputs equal token for token: {all_equal}")
    print(f"command: python bench/spec_decode.py {shlex.join(sys.argv[1:])}")
    print(f"commit {commit()}, CPU {cpu_model()}, compute {plain.engine.runner.compute_dtype}, "
          f"batch-invariant {plain.engine.runner.batch_invariant}")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
