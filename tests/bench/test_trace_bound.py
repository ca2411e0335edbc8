"""bench/trace_bound.py's bound on small cases worked by hand, and its prompt work with the
slice's shared prefixes cached."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace_bound import PrefillCost, max_attainment, prompt_work
from pdserve.services.loadtest.traces import TraceOptions


def test_a_burst_meets_the_target_only_as_far_as_its_cores_compute_its_smallest_prompts() -> None:
    offsets, work = [0.0] * 4, [0.4] * 4
    assert max_attainment(offsets, work, 1.0, cores=1.0, prompt_cores=1.0) == 0.5    # 2 of 0.4 s fit in 1 s
    assert max_attainment(offsets, work, 1.0, cores=2.0, prompt_cores=1.0) == 1.0
    # the smallest first: 0.1 + 0.2 + 0.3 fit one core's second, 0.9 does not
    assert max_attainment([0.0] * 4, [0.9, 0.1, 0.3, 0.2], 1.0, cores=1.0, prompt_cores=1.0) == 0.75


def test_a_prompt_longer_than_the_target_alone_misses_unless_it_runs_on_more_cores() -> None:
    assert max_attainment([0.0], [1.5], 1.0, cores=2.0, prompt_cores=1.0) == 0.0
    assert max_attainment([0.0], [1.5], 1.0, cores=2.0, prompt_cores=2.0) == 1.0


def test_bursts_close_together_share_a_window() -> None:
    """2 prompts of 0.5 s at 0 and 2 more at 0.5 (deadlines 1 and 1.5): alone each burst fits one
    core, together 2 s of work by 1.5 s leave one miss; far apart, none."""
    work = [0.5] * 4
    assert max_attainment([0.0, 0.0, 0.5, 0.5], work, 1.0, cores=1.0, prompt_cores=1.0) == 0.75
    assert max_attainment([0.0, 0.0, 5.0, 5.0], work, 1.0, cores=1.0, prompt_cores=1.0) == 1.0


def test_prompt_work_counts_only_the_blocks_no_earlier_prompt_had(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 500, "input_length": 2048, "output_length": 4, "hash_ids": [1, 2, 5, 6]},
            {"timestamp": 900, "input_length": 2048, "output_length": 4, "hash_ids": [7, 2, 3, 4]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cost = PrefillCost(a=1e-3, b=0.0)
    opts = TraceOptions(str(trace), token_scale=16 / 512)   # 64-token prompts of 16-token blocks
    offsets, work = prompt_work(opts, 3, cost)
    assert offsets == [0.0, 0.5, 0.9]
    # the second shares its first two blocks; the third's first block is new, so nothing after it is cached
    assert work == pytest.approx([64e-3, 32e-3, 64e-3])
    assert PrefillCost(a=0.0, b=1.0).seconds(2, 3) == 25 - 4
