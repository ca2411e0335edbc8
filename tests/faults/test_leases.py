"""A decode worker's reservation lives on progress, not a fixed clock: a prefill that keeps making
progress (or whose lease is long enough) completes however long it takes; one that stalls past
its lease fails with a status that names the lease. Migration is off here, so the failure shows."""
from __future__ import annotations

import signal
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.faults.harness import FaultCluster, observe, wait_for

pytestmark = pytest.mark.faults

PROMPT_LEN = 1900
SLOW_PREFILL = ["--block-size", "8", "--num-kv-blocks", "1024", "--dtype", "float32", "--max-num-batched-tokens", "4"]
NO_MIGRATION = ["--stall-timeout-s", "90", "--migration-limit", "0"]
IDLE_LEASE_S = 0.5   # above a loaded 2-core machine's scheduling stalls (0.2 s was not: a CI run missed it)


def _cluster(model: str, lease_idle_s: float) -> FaultCluster:
    return FaultCluster(model, prefill=1, decode=1, engine_args=SLOW_PREFILL, router_args=NO_MIGRATION,
                        worker_args=["--kv-lease-idle-s", str(lease_idle_s), "--kv-lease-max-s", "120"])


def _expected(model: str, prompt: list[int], n: int) -> list[int]:
    llm = LLM(model, dtype="float32", block_size=8, num_kv_blocks=1024)
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids


def _stall_prefill(fc: FaultCluster, prompt: list[int], stall_s: float):
    obs = observe(fc.router, prompt, 8)
    found: list[str | None] = []
    wait_for(lambda: bool(found.append(fc.holding("prefill", "num_running")) or found[-1]), 30, "prefill computing")
    assert not obs.tokens
    fc.signal(found[-1], signal.SIGSTOP)
    time.sleep(stall_s)   # kept: the stall's length is the fault under test
    fc.signal(found[-1], signal.SIGCONT)
    assert obs.done.wait(120)
    return obs


def test_progress_keeps_a_reservation_alive_well_past_its_idle_lease(tiny_qwen3: str) -> None:
    # One prompt token a step: ~1900 steps, 0.9 to 2.5 s on an AVX-512 EPYC core (two a step took
    # 0.69 s on a Zen 4 core), so the prefill outlives its 0.5 s idle lease on every CPU seen so far.
    fc = FaultCluster(tiny_qwen3, prefill=1, decode=1, engine_args=[*SLOW_PREFILL[:-1], "1"], router_args=NO_MIGRATION,
                      worker_args=["--kv-lease-idle-s", str(IDLE_LEASE_S), "--kv-lease-max-s", "120"])
    try:
        prompt = random_prompts(1, PROMPT_LEN, PROMPT_LEN, seed=601)[0]
        obs = observe(fc.router, prompt, 8)
        assert obs.done.wait(120)
        assert obs.code is None, f"{obs.code}: {obs.details}\n{fc.logs()}"
        # The prefill alone outlived the idle lease (a fixed clock of that length would have failed it).
        assert obs.arrivals[0] - obs.started > IDLE_LEASE_S, (obs.arrivals[0] - obs.started, IDLE_LEASE_S)
        assert obs.tokens == _expected(tiny_qwen3, prompt, 8)
        wait_for(fc.at_baseline, 10, "free blocks at baseline")
    finally:
        fc.close()


def test_a_prefill_frozen_longer_than_the_old_30_s_clock_completes_when_its_lease_allows(
        tiny_qwen3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "INFO")   # the router's log says why, should the request fail
    # 29 s of lease left once it resumes: room for a loaded machine (it runs beside other tests)
    fc = _cluster(tiny_qwen3, lease_idle_s=60)
    try:
        prompt = random_prompts(1, PROMPT_LEN, PROMPT_LEN, seed=602)[0]
        obs = _stall_prefill(fc, prompt, 31.0)
        assert obs.code is None, f"{obs.code}: {obs.details} after {len(obs.tokens)} token(s)\n{fc.logs()}"
        assert obs.tokens == _expected(tiny_qwen3, prompt, 8)
        wait_for(fc.at_baseline, 10, "free blocks at baseline")
    finally:
        fc.close()


def test_a_prefill_frozen_past_its_lease_fails_with_a_status_naming_the_lease(tiny_qwen3: str) -> None:
    fc = _cluster(tiny_qwen3, lease_idle_s=2)
    try:
        obs = _stall_prefill(fc, random_prompts(1, PROMPT_LEN, PROMPT_LEN, seed=603)[0], 4.0)
        assert obs.code == "DEADLINE_EXCEEDED", (obs.code, obs.details)
        assert "expired" in obs.details and "no KV progress for 2s" in obs.details
        wait_for(fc.at_baseline, 10, "free blocks at baseline on both workers")
    finally:
        fc.close()


def test_a_backlog_past_the_data_planes_connections_keeps_every_lease(tiny_qwen3: str) -> None:
    """More requests queued on the prefill worker than the decode worker's TCP data plane serves
    connections, most of them queued longer than their idle lease: their streams hold no
    connection while queued, and beats keep every reservation. None fails (migration is off)."""
    lease_s = 4.0   # eight heartbeats (0.5 s apart): room for a loaded machine's lag
    fc = FaultCluster(tiny_qwen3, prefill=1, decode=1, engine_args=[*SLOW_PREFILL[:-1], "1"], router_args=NO_MIGRATION,
                      worker_args=["--kv-lease-idle-s", str(lease_s), "--kv-lease-max-s", "120",
                                   "--kv-data-max-connections", "2"])
    try:
        prompts = random_prompts(24, 400, 400, seed=604)   # one token a step: 9,600 steps of backlog
        runs = [observe(fc.router, p, 4) for p in prompts]
        for obs in runs:
            assert obs.done.wait(120)
        failed = [(o.code, o.details) for o in runs if o.code is not None]
        assert not failed, f"{failed}\n{fc.logs()}"
        waited = max(o.arrivals[0] - o.started for o in runs)
        assert waited > lease_s, waited   # the backlog outlived the lease
        llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=1024)
        expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4,
                                                                               ignore_eos=True))]
        assert [o.tokens for o in runs] == expected
        wait_for(fc.at_baseline, 10, "free blocks at baseline on both workers")
    finally:
        fc.close()
