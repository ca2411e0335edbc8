"""Production traces replayed by ``pdserve bench serve``: arrival times and lengths from a
public trace, prompts made of token ids that keep the trace's prefix sharing.

``mooncake_trace`` (AIPerf's name; Mooncake's FAST'25 traces, e.g.
``FAST25-release/traces/conversation_trace.jsonl`` in github.com/kvcache-ai/Mooncake): JSON
lines of ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, the ids of
the prompt's blocks of ``--trace-block-size`` (512) tokens, equal ids for equal content. Each id
becomes one block of random tokens drawn from the id (and ``--seed``) alone, so that the same id
is the same tokens in every prompt, and the prompt is its blocks cut to its length.

``azure_trace`` (the Azure LLM inference traces' CSV: ``TIMESTAMP``, ``ContextTokens``,
``GeneratedTokens``): no block ids, so each prompt is its own random tokens.

Scaling a trace to a smaller machine: ``--trace-token-scale`` multiplies input lengths (a
512-token block becomes round(512 x scale) tokens), ``--trace-output-scale`` output lengths,
``--trace-time-scale`` the gaps between arrivals (0.5: twice as fast), or ``--request-rate R``
rescales the slice's arrivals to a mean of R requests/s instead. ``--trace-start`` skips that
many rows, ``--num-prompts`` takes the rows after it.
"""
from __future__ import annotations

import csv
import json
import math
import os
import stat
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from pdserve.services.loadtest.datasets import MIN_TOKEN_ID, SampleRequest

TRACES = ("mooncake_trace", "azure_trace")
MOONCAKE_BLOCK = 512          # tokens per hash id in Mooncake's traces
MAX_TRACE_BYTES = 1 << 30     # a trace file larger than this is refused before it is read
MAX_HASH_ID = 2 ** 62


@dataclass(slots=True)
class TraceOptions:
    path: str
    name: str = "mooncake_trace"
    start: int = 0                  # rows skipped
    token_scale: float = 1.0        # input lengths (and block sizes) x this
    output_scale: float = 1.0       # output lengths x this
    time_scale: float = 1.0         # gaps between arrivals x this
    block_size: int = MOONCAKE_BLOCK
    rate: float | None = None       # instead of time_scale: the slice's mean arrival rate (req/s)

    def validate(self) -> None:
        if self.name not in TRACES:
            raise ValueError(f"unknown trace format {self.name!r}; choose from {', '.join(TRACES)}")
        for name in ("token_scale", "output_scale", "time_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--trace-{name.replace('_', '-')} must be a number > 0, got {value}")
        if self.start < 0:
            raise ValueError(f"--trace-start must be >= 0, got {self.start}")
        if self.block_size < 1:
            raise ValueError(f"--trace-block-size must be >= 1, got {self.block_size}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"--request-rate must be a finite number > 0 with a trace, got {self.rate}")


@dataclass(slots=True)
class TraceRow:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class TraceWorkload:
    requests: list[SampleRequest]
    offsets: list[float]            # send times, seconds after the first request of the slice
    shared_blocks: int              # blocks whose hash id appears in more than one prompt


def load_trace(opts: TraceOptions, num_prompts: int, vocab_size: int, seed: int = 0,
               eos_token_id: int | None = 0) -> TraceWorkload:
    """num_prompts rows of the trace from opts.start on, as requests and send times."""
    opts.validate()
    if num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if vocab_size <= MIN_TOKEN_ID + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small")
    rows = _read(opts, num_prompts)
    if not rows:
        raise ValueError(f"{opts.path}: no rows from --trace-start {opts.start}")
    block = max(1, round(opts.block_size * opts.token_scale))
    blocks: dict[int, list[int]] = {}
    seen: dict[int, int] = {}
    requests = []
    for row in rows:
        n_in = max(1, round(row.input_length * opts.token_scale))
        n_out = max(1, round(row.output_length * opts.output_scale))
        ids: list[int] = []
        for h in row.hash_ids:
            if len(ids) >= n_in:
                break
            if h not in blocks:
                blocks[h] = _block_tokens(h, block, vocab_size, seed, eos_token_id)
            seen[h] = seen.get(h, 0) + 1
            ids.extend(blocks[h])
        if len(ids) < n_in:   # no (or too few) block ids: the rest is this prompt's own
            rng = np.random.default_rng([seed, len(requests), 1])
            ids.extend(_tokens(rng, n_in - len(ids), vocab_size, eos_token_id))
        requests.append(SampleRequest(ids[:n_in], n_in, n_out, opts.name))
    t0 = rows[0].timestamp_s
    offsets = [max(0.0, r.timestamp_s - t0) for r in rows]
    if opts.rate is not None:
        span = offsets[-1]
        factor = (len(rows) - 1) / (opts.rate * span) if span > 0 and len(rows) > 1 else 0.0
    else:
        factor = opts.time_scale
    return TraceWorkload(requests, [o * factor for o in offsets], sum(1 for n in seen.values() if n > 1))


def _tokens(rng: np.random.Generator, n: int, vocab_size: int, eos: int | None) -> list[int]:
    ids = rng.integers(MIN_TOKEN_ID, vocab_size, size=n)
    if eos is not None and eos >= MIN_TOKEN_ID:
        ids[ids == eos] = MIN_TOKEN_ID if eos != MIN_TOKEN_ID else MIN_TOKEN_ID + 1
    return ids.tolist()


def _block_tokens(hash_id: int, n: int, vocab_size: int, seed: int, eos: int | None) -> list[int]:
    """A block's tokens: a function of its hash id and the seed alone."""
    return _tokens(np.random.default_rng([seed, hash_id, 0]), n, vocab_size, eos)


def _open(path: str):
    """The trace, opened without following a last-component link or blocking on a FIFO, then
    checked (a regular file, at most MAX_TRACE_BYTES) before a byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--dataset-path {path!r}: {exc.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TRACE_BYTES:
        os.close(fd)
        raise ValueError(f"--dataset-path {path!r} is not a regular file of at most {MAX_TRACE_BYTES >> 20} MiB")
    return open(fd, encoding="utf-8", newline="")


def _read(opts: TraceOptions, num_prompts: int) -> list[TraceRow]:
    reader = _mooncake_rows if opts.name == "mooncake_trace" else _azure_rows
    rows = []
    with _open(opts.path) as f:
        for i, row in enumerate(reader(f, opts.path)):
            if i >= opts.start:
                rows.append(row)
                if len(rows) == num_prompts:
                    break
    return rows


def _mooncake_rows(f, where: str):
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ts, n_in, n_out = float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"])
            hashes = [int(h) for h in obj.get("hash_ids", [])]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}:{lineno}: not a Mooncake trace row (timestamp, input_length, "
                             f"output_length, hash_ids): {type(exc).__name__}: {str(exc)[:80]}") from None
        if n_in < 1 or n_out < 1 or not math.isfinite(ts) or any(not 0 <= h < MAX_HASH_ID for h in hashes):
            raise ValueError(f"{where}:{lineno}: lengths must be >= 1, the timestamp finite, hash ids in [0, 2**62)")
        yield TraceRow(ts / 1e3, n_in, n_out, hashes)


def _azure_rows(f, where: str):
    reader = csv.DictReader(f)
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not need <= set(reader.fieldnames):
        raise ValueError(f"{where}: an Azure LLM inference trace needs the columns {', '.join(sorted(need))}")
    for lineno, rec in enumerate(reader, 2):
        try:
            ts = _azure_time(rec["TIMESTAMP"])
            n_in, n_out = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
        except ValueError as exc:
            raise ValueError(f"{where}:{lineno}: {str(exc)[:80]}") from None
        if n_in < 1 or n_out < 1:
            raise ValueError(f"{where}:{lineno}: ContextTokens and GeneratedTokens must be >= 1")
        yield TraceRow(ts, n_in, n_out, [])


def _azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) -> seconds since the epoch."""
    text = text.strip()
    head, dot, frac = text.partition(".")
    stamp = datetime.fromisoformat(head).timestamp()
    return stamp + (float(f"0.{frac}") if dot and frac.isdigit() else 0.0)
