"""Trace replay (services/loadtest/traces.py): Mooncake / AIPerf JSON lines and Azure CSV rows
become requests whose prompts keep the trace's block sharing, at the trace's arrival times,
scaled in tokens and time; a malformed trace is refused naming the line."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdserve.services.loadtest.datasets import MIN_TOKEN_ID
from pdserve.services.loadtest.traces import TraceOptions, load_trace

ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1100, "output_length": 80, "hash_ids": [0, 1, 3]},
    {"timestamp": 500, "input_length": 300, "output_length": 8, "hash_ids": [4]},
    {"timestamp": 2500, "input_length": 1600, "output_length": 4, "hash_ids": [0, 5, 6, 7]},
]
VOCAB = 1000


def _write(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mooncake_rows_keep_their_shared_blocks_scaled(tmp_path: Path) -> None:
    opts = TraceOptions(_write(tmp_path, ROWS), token_scale=1 / 32, output_scale=0.25, time_scale=2.0)
    replay = load_trace(opts, 10, VOCAB, seed=3)
    reqs = replay.requests
    assert [r.prompt_len for r in reqs] == [38, 34, 9, 50] == [len(r.prompt) for r in reqs]
    assert [r.expected_output_len for r in reqs] == [10, 20, 2, 1]
    assert reqs[0].prompt[:32] == reqs[1].prompt[:32] and reqs[0].prompt[32:] != reqs[1].prompt[32:34]
    assert reqs[3].prompt[:16] == reqs[0].prompt[:16] and reqs[3].prompt[16:32] != reqs[0].prompt[16:32]
    assert replay.shared_blocks == 2                       # ids 0 and 1
    assert replay.offsets == [0.0, 1.0, 1.0, 5.0]          # ms -> s, x2
    assert all(MIN_TOKEN_ID <= t < VOCAB and t != 0 for r in reqs for t in r.prompt)
    # the same seed gives the same prompts; another seed others, shared alike
    assert [r.prompt for r in load_trace(opts, 10, VOCAB, seed=3).requests] == [r.prompt for r in reqs]
    other = load_trace(opts, 10, VOCAB, seed=4).requests
    assert other[0].prompt != reqs[0].prompt and other[0].prompt[:32] == other[1].prompt[:32]


def test_a_slice_and_a_target_rate(tmp_path: Path) -> None:
    path = _write(tmp_path, ROWS)
    replay = load_trace(TraceOptions(path, start=1, rate=1.0), 2, VOCAB)
    assert [r.expected_output_len for r in replay.requests] == [80, 8]
    assert replay.offsets == [0.0, 0.0]                     # both at 500 ms: no span to rescale
    replay = load_trace(TraceOptions(path, rate=2.0), 4, VOCAB)
    assert replay.offsets == pytest.approx([0.0, 0.3, 0.3, 1.5])   # 3 gaps over 2.5 s -> 1.5 s at 2 req/s
    with pytest.raises(ValueError, match="no rows from --trace-start 9"):
        load_trace(TraceOptions(path, start=9), 4, VOCAB)


def test_azure_csv_rows(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.0,1500,2\n")
    replay = load_trace(TraceOptions(str(path), name="azure_trace", token_scale=0.1), 3, VOCAB)
    assert [r.prompt_len for r in replay.requests] == [37, 40, 150]
    assert replay.offsets == pytest.approx([0.0, 4.314579, 4.31942], abs=1e-5)
    assert replay.shared_blocks == 0 and replay.requests[0].prompt[:5] != replay.requests[1].prompt[:5]


@pytest.mark.parametrize("text,match", [
    ('{"timestamp": 0, "input_length": 5}\n', r"trace\.jsonl:1: not a Mooncake trace row"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n', r":1: lengths must be >= 1"),
    ('\n{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [-1]}\n', r":2: .*hash ids in"),
    ("not json\n", r":1: not a Mooncake trace row"),
])
def test_a_malformed_trace_is_refused_naming_the_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_trace(TraceOptions(str(path)), 4, VOCAB)


def test_bad_options_and_files_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, ROWS)
    for bad, match in ((dict(token_scale=0), "--trace-token-scale"), (dict(time_scale=float("nan")), "time-scale"),
                       (dict(start=-1), "--trace-start"), (dict(name="csv"), "unknown trace format"),
                       (dict(rate=float("inf")), "--request-rate")):
        with pytest.raises(ValueError, match=match):
            load_trace(TraceOptions(path, **bad), 4, VOCAB)
    with pytest.raises(ValueError, match="is not a regular file"):
        load_trace(TraceOptions(str(tmp_path)), 4, VOCAB)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)   # opened without blocking, then refused
    with pytest.raises(ValueError, match="is not a regular file"):
        load_trace(TraceOptions(str(fifo)), 4, VOCAB)
    (tmp_path / "link.jsonl").symlink_to(path)
    with pytest.raises(ValueError, match="Too many levels of symbolic links"):
        load_trace(TraceOptions(str(tmp_path / "link.jsonl")), 4, VOCAB)
    (tmp_path / "a.csv").write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="needs the columns ContextTokens, GeneratedTokens, TIMESTAMP"):
        load_trace(TraceOptions(str(tmp_path / "a.csv"), name="azure_trace"), 4, VOCAB)
