"""The vLLM side of bench/spec_decode.py, run with vLLM's python (standard library + vllm only).

Reads a job (--job FILE, JSON: model, dtype, prompts as token ids, max_tokens, repeats,
speculative_config or null, out: a file path) and writes JSON there: per prompt, the best decode rate of
`repeats` alternations (tokens after the first over the time after it: the time of a full
generate less that of a one-token generate of the same prompt) and the output token ids, with
vLLM's acceptance counters where it speculates."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="the job's JSON file (written by bench/spec_decode.py)")
    with open(p.parse_args().job) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams
    kwargs = {"speculative_config": job["speculative_config"]} if job["speculative_config"] else {}
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=2048, **kwargs)
    full = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    one = SamplingParams(temperature=0.0, max_tokens=1)

    def timed(ids: list[int], params) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        return time.perf_counter() - t0, list(out.token_ids)

    results = []
    for ids in job["prompts"]:
        timed(ids, full)   # warm-up
        best, tokens = 0.0, []
        for _ in range(job["repeats"]):
            first_s, _ = timed(ids, one)
            total_s, tokens = timed(ids, full)
            if total_s > first_s and len(tokens) > 1:
                best = max(best, (len(tokens) - 1) / (total_s - first_s))
        results.append({"tok_s": best, "token_ids": tokens})
    import vllm
    with open(job["out"], "w") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
