"""Request workloads for ``pdserve bench serve``, the planner and the benchmark scripts.

Every synthetic prompt is a list of token ids, so its input length is exact: ids are drawn
uniformly from ``[MIN_TOKEN_ID, vocab_size)`` with the EOS id left out (pdserve's made models
put EOS at 0 and BOS at 1). vocab_size comes from the router's ``GetModelInfo``.

Datasets (``--dataset-name``):

``random``
    vLLM's random dataset: input length uniform in
    ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` for ``L = --random-input-len`` and
    ``r = --random-range-ratio``, output length likewise from ``--random-output-len``. With
    ``--random-prefix-len P > 0`` every prompt starts with the same P random tokens (then the
    prompt is P + input length tokens, as in vLLM).
``shared-prefix``
    A common prefix of ``--random-prefix-len`` tokens (256 when not given) + a random suffix
    of ``--random-input-len`` tokens (range ratio applies) per request: exercises the prefix
    cache, and in the disaggregated setup the skipped KV blocks. With
    ``--shared-prefix-num-prefixes N`` there are N distinct prefixes, each request drawing one
    uniformly (KV-aware routing: which worker holds which).
``mixed``
    The interference case: mostly short requests that decode for a while, and every
    ``round(1 / --mixed-long-fraction)``-th request (the 8th, 16th, ... by default) is a long
    prompt of ``--mixed-long-input-len`` (1024) tokens with a short output
    (``--mixed-long-output-len``, 16), so it is chunked by the prefill scheduler while the
    short ones are decoding. Short requests: ``--mixed-short-input-len`` (64) input tokens and
    ``--random-output-len`` output tokens; ``--random-range-ratio`` applies to both kinds.
``multi-turn``
    Sessions of several turns with a growing shared history (services/loadtest/multi_turn.py):
    each later turn's prompt is the previous prompt, the previous answer's token ids as
    generated, and new random tokens. Built per session while the load runs (a turn needs the
    previous answer), so ``sample_requests`` does not make it; its tokens come from
    ``TokenSource`` as the random dataset's do.
``jsonl``
    ``--dataset-path`` with one JSON object per line: ``"prompt"`` (text, tokenized by the
    router) or ``"prompt_token_ids"`` (a list of ids), and optionally ``"output_len"`` (else
    ``--random-output-len``). Lines are taken in order and cycled when ``--num-prompts`` is
    larger than the file.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

MIN_TOKEN_ID = 2          # skip EOS (0) and BOS (1) of pdserve's made models
DATASETS = ("random", "shared-prefix", "mixed", "multi-turn", "jsonl")
DEFAULT_SHARED_PREFIX_LEN = 256


@dataclass(slots=True)
class SampleRequest:
    """One request of a workload: token ids (exact input length) or text."""

    prompt: list[int] | str
    prompt_len: int           # -1 for a text prompt: the router's usage tells after the fact
    expected_output_len: int
    kind: str = ""            # "short" / "long" for the mixed dataset
    priority: int = 0         # its scheduling class (gRPC backend): lower first
    user: str = ""            # OpenAI's `user` (the fair-share key is the API key's principal)
    session_id: str = ""      # its conversation (multi-turn): the router keeps its turns together


@dataclass(slots=True)
class DatasetOptions:
    name: str = "random"
    path: str | None = None
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int | None = None
    mixed_short_input_len: int = 64
    mixed_long_input_len: int = 1024
    mixed_long_output_len: int = 16
    mixed_long_fraction: float = 0.125
    num_prefixes: int = 1     # shared-prefix: distinct prefixes


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """The inclusive range vLLM's random dataset samples lengths from."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return max(0, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))


class TokenSource:
    """Random prompt tokens and lengths from one generator: ids uniform in [MIN_TOKEN_ID,
    vocab_size), the EOS id replaced."""

    def __init__(self, rng: np.random.Generator, vocab_size: int, eos_token_id: int | None) -> None:
        if vocab_size <= MIN_TOKEN_ID + 1:
            raise ValueError(f"vocab_size {vocab_size} is too small")
        self.rng, self.vocab_size, self.eos = rng, vocab_size, eos_token_id

    def tokens(self, n: int) -> list[int]:
        ids = self.rng.integers(MIN_TOKEN_ID, self.vocab_size, size=n)
        if self.eos is not None and self.eos >= MIN_TOKEN_ID:
            ids[ids == self.eos] = MIN_TOKEN_ID if self.eos != MIN_TOKEN_ID else MIN_TOKEN_ID + 1
        return ids.tolist()

    def length(self, length: int, ratio: float, minimum: int = 1) -> int:
        lo, hi = length_range(length, ratio)
        return max(minimum, int(self.rng.integers(lo, hi + 1)))


def sample_requests(opts: DatasetOptions, num_prompts: int, vocab_size: int, seed: int = 0,
                    eos_token_id: int | None = 0) -> list[SampleRequest]:
    """num_prompts requests of the named dataset, deterministic for a seed."""
    if num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if opts.name == "jsonl":
        return _jsonl(opts, num_prompts)
    if opts.name == "multi-turn":
        raise ValueError("multi-turn sessions are built while the load runs: services/loadtest/multi_turn.py")
    src = TokenSource(np.random.default_rng(seed), vocab_size, eos_token_id)
    out: list[SampleRequest] = []
    if opts.name in ("random", "shared-prefix"):
        prefix_len = opts.prefix_len if opts.prefix_len is not None else (
            DEFAULT_SHARED_PREFIX_LEN if opts.name == "shared-prefix" else 0)
        if opts.name == "shared-prefix" and prefix_len < 1:
            raise ValueError("--dataset-name shared-prefix needs --random-prefix-len >= 1")
        if opts.num_prefixes < 1 or (opts.num_prefixes > 1 and opts.name != "shared-prefix"):
            raise ValueError("--shared-prefix-num-prefixes must be >= 1, and > 1 only with shared-prefix")
        prefixes = [src.tokens(prefix_len) for _ in range(opts.num_prefixes)]
        for _ in range(num_prompts):
            prefix = prefixes[int(src.rng.integers(len(prefixes)))] if len(prefixes) > 1 else prefixes[0]
            n_in = src.length(opts.input_len, opts.range_ratio, minimum=0 if prefix_len else 1)
            n_out = src.length(opts.output_len, opts.range_ratio)
            ids = prefix + src.tokens(n_in)
            out.append(SampleRequest(ids, len(ids), n_out, opts.name))
        return out
    if opts.name == "mixed":
        if not 0.0 < opts.mixed_long_fraction <= 1.0:
            raise ValueError(f"--mixed-long-fraction must be in (0, 1], got {opts.mixed_long_fraction}")
        period = max(1, round(1.0 / opts.mixed_long_fraction))
        for i in range(num_prompts):
            if i % period == period - 1:
                n_in = src.length(opts.mixed_long_input_len, opts.range_ratio)
                n_out = src.length(opts.mixed_long_output_len, opts.range_ratio)
                kind = "long"
            else:
                n_in = src.length(opts.mixed_short_input_len, opts.range_ratio)
                n_out = src.length(opts.output_len, opts.range_ratio)
                kind = "short"
            out.append(SampleRequest(src.tokens(n_in), n_in, n_out, kind))
        return out
    raise ValueError(f"unknown dataset {opts.name!r}; choose from {', '.join(DATASETS)}")


def _jsonl(opts: DatasetOptions, num_prompts: int) -> list[SampleRequest]:
    if not opts.path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    rows: list[SampleRequest] = []
    with open(opts.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{opts.path}:{lineno}: not JSON: {exc}") from exc
            n_out = int(obj.get("output_len", opts.output_len))
            if n_out < 1:
                raise ValueError(f"{opts.path}:{lineno}: output_len must be >= 1")
            if "prompt_token_ids" in obj:
                ids = [int(t) for t in obj["prompt_token_ids"]]
                rows.append(SampleRequest(ids, len(ids), n_out, "jsonl"))
            elif "prompt" in obj:
                rows.append(SampleRequest(str(obj["prompt"]), -1, n_out, "jsonl"))
            else:
                raise ValueError(f"{opts.path}:{lineno}: needs \"prompt\" or \"prompt_token_ids\"")
    if not rows:
        raise ValueError(f"{opts.path}: no requests")
    return [rows[i % len(rows)] for i in range(num_prompts)]
