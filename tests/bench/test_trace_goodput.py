"""bench/trace_goodput.py's planner side: each fixed setup simulated as it is deployed, and the
planned setup's pick, on a small trace (its serving side is the load generator's, tested there)."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from bench.trace_goodput import UP_FLAGS, plan_pick, predict, rate_at_attainment, setup_candidate
from pdserve.services.planner.cost_model import CostModel


def _args(tmp_path: Path) -> argparse.Namespace:
    trace = tmp_path / "trace.jsonl"
    with open(trace, "w") as f:
        for i in range(24):   # bursts of 6 at a timestamp; a shared opening block
            f.write(json.dumps({"timestamp": 2000 * (i // 6), "input_length": 512 * (1 + i % 4),
                                "output_length": 64, "hash_ids": [7, *range(100 * i, 100 * i + 3)]}) + "\n")
    return argparse.Namespace(trace=str(trace), trace_start=0, token_scale=1 / 8, output_scale=0.25, num_prompts=24,
                              ttft_ms=2000.0, tpot_ms=100.0)


def test_each_setup_is_simulated_as_it_is_deployed(cost: CostModel, tmp_path: Path) -> None:
    for setup, flags in UP_FLAGS.items():
        cand = setup_candidate(setup)
        deployed = shlex.split(cand.up_flags())
        for flag in ("--prefill-workers", "--decode-workers", "--colocated-workers", "--disaggregation",
                     "--prompt-order"):
            if flag in flags:
                assert deployed[deployed.index(flag) + 1] == flags[flags.index(flag) + 1], (setup, flag)
    assert setup_candidate("default").disaggregation == "conditional"   # the router's default
    assert setup_candidate("default").prompt_order is None              # the engine's default
    args = _args(tmp_path)
    default = predict(cost, setup_candidate("default"), args, 4.0, seed=1)
    always = predict(cost, setup_candidate("disagg"), args, 4.0, seed=1)
    assert 0.0 <= always["attainment"] <= default["attainment"] <= 1.0
    assert always["local_prefills"] == 0 < default["local_prefills"]


def test_the_planned_setup_is_the_planner_s_best_goodput_within_the_cores(cost: CostModel, tmp_path: Path,
                                                                          monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    args = _args(tmp_path)
    pick = plan_pick(cost, args, 4.0, seed=1)
    assert pick.cores <= 2
    best = predict(cost, pick, args, 4.0, seed=1)["attainment"]
    for setup in UP_FLAGS:
        assert predict(cost, setup_candidate(setup), args, 4.0, seed=1)["attainment"] <= best + 1e-9


def test_goodput_as_the_highest_rate_that_keeps_the_target() -> None:
    rows = [{"setup": "a", "rate": 1.0, "attainment": 0.95}, {"setup": "a", "rate": 2.0, "attainment": 0.85},
            {"setup": "b", "rate": 1.0, "attainment": 0.97}, {"setup": "b", "rate": 2.0, "attainment": 0.96},
            {"setup": "c", "rate": 1.0, "attainment": 0.5}]
    assert rate_at_attainment(rows, "a", 0.9) == (pytest.approx(1.5), True)
    assert rate_at_attainment(rows, "b", 0.9) == (2.0, False)
    assert rate_at_attainment(rows, "c", 0.9) is None
