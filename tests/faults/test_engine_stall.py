"""A decode worker alive but not stepping (its engine thread hung, holding the engine lock: gRPC
server and process alive), under `pdserve up`'s supervisor (under Ray: tests/e2e/test_ray_serving.py, which holds the one
local Ray cluster of its test process): its watchdog ends it
within --engine-stall-timeout-s, the supervisor (Ray: max_restarts) starts a new process, the router
migrates its requests. No request is lost, every one has exactly a fault-free run's greedy tokens,
and free KV blocks return to the baseline on every worker."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.settings import ENV
from pdserve.services.deployment.launcher import RESTART_BACKOFF_S, SUPERVISE_POLL_S
from pdserve.services.workers.config import ENGINE_STALL_EXIT_CODE
from tests.conftest import random_prompts
from tests.faults.harness import FAULT_WORKER, FaultCluster, observe, record, wait_for

pytestmark = pytest.mark.faults

ENGINE_STALL_S = 4.0
MAX_TOKENS = 320   # 10 streams' blocks fit one decode worker (512 of 8 tokens, the Ray test's) after a migration
RUNNING, ARRIVING = 6, 4     # streams under way when the engine hangs, and requests sent during the hang
PROMPTS = random_prompts(RUNNING + ARRIVING, 8, 40, seed=4101)
# The watchdog sees a stall within its timeout plus a check (1 s); the supervisor restarts after its
# first backoff and a poll. The slack absorbs a loaded machine (a check, a poll, a fork run late).
REPLACED_WITHIN_S = ENGINE_STALL_S + 1.0 + RESTART_BACKOFF_S[0] + SUPERVISE_POLL_S + 15.0
# Ray restarts at once, and a new pid is seen when the restarted actor answers: after its start-up
# (the Ray case: tests/e2e/test_ray_serving.py).
RAY_REPLACED_WITHIN_S = ENGINE_STALL_S + 1.0 + 40.0
STALL_WORKER = ["--engine-stall-timeout-s", str(ENGINE_STALL_S)]
STALL_ROUTER = ["--stall-timeout-s", "3", "--migration-limit", "3"]


@pytest.fixture(scope="module")
def reference(tiny_qwen3: str) -> list[list[int]]:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def hang_dir():
    """The test hook's directory (0700): a file engine-hang-PID there hangs worker PID's engine thread."""
    path = tempfile.mkdtemp(prefix="pdserve-hang-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fc(tiny_qwen3: str, hang_dir: Path):
    """1 prefill + 2 decode workers under the supervisor, with the hook's directory in their
    environment (each child's is copied when the cluster makes it, restarts included)."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in ENV.TEST_ENGINE_HANG_DIR.env(hang_dir).items():
            env.setenv(key, value)
        cluster = FaultCluster(tiny_qwen3, prefill=1, decode=2, worker_args=[*FAULT_WORKER, *STALL_WORKER])
    yield cluster
    cluster.close()


def _caught_decoding(fc: FaultCluster, running: list) -> str:
    """A decode worker running sequences, caught frozen (the caller resumes it): asked while it runs,
    a tiny model's streams could end between the answer and the hook (on a loaded machine they did)."""
    while not all(o.done.is_set() for o in running):
        victim = fc.catch_holding("decode", lambda s: s.num_running > 0, keep_frozen=True)
        if victim is not None:
            return victim
        time.sleep(0.005)
    raise AssertionError("every stream ended before a decode worker was caught running one")


def test_a_decode_worker_whose_engine_hangs_is_replaced_and_loses_no_request(fc, reference, hang_dir) -> None:
    wait_for(fc.all_healthy, 120, "every worker healthy")
    wait_for(fc.at_baseline, 30, "free blocks at baseline")
    running = [observe(fc.router, p, MAX_TOKENS, timeout=180) for p in PROMPTS[:RUNNING]]
    # caught as soon as a decode worker runs one: what the client has seen lags the workers (on a
    # loaded machine, waiting for the streams' first tokens left too little of them to catch)
    victim = _caught_decoding(fc, running)   # frozen: what it runs is still there when the hook is set
    old = fc.process(victim).popen
    (hang_dir / f"engine-hang-{old.pid}").write_text("")   # its engine thread hangs before its next step
    os.kill(old.pid, signal.SIGCONT)
    t_hang = time.monotonic()
    arriving = [observe(fc.router, p, MAX_TOKENS, timeout=180) for p in PROMPTS[RUNNING:]]
    wait_for(lambda: fc.process(victim).popen.pid != old.pid, REPLACED_WITHIN_S,
             f"{victim} replaced within {REPLACED_WITHIN_S:g}s of its engine hanging\n{fc.logs()}", interval=0.05)
    replaced_after = time.monotonic() - t_hang
    assert old.returncode == ENGINE_STALL_EXIT_CODE, old.returncode   # its watchdog ended it, nothing else
    for obs in running + arriving:
        assert obs.done.wait(180), "a request hung through the stall"
    failed = [(o.code, o.details) for o in running + arriving if o.code is not None]
    assert not failed, f"{len(failed)} of {len(running + arriving)} requests failed: {failed[:3]}\n{fc.logs()}"
    assert [o.tokens for o in running + arriving] == reference   # exactly a fault-free run's tokens
    assert all(o.finish_reason == "length" for o in running + arriving)
    # The hook hangs an engine only when it has a sequence to step: that request moved elsewhere.
    assert any(o.migrations for o in running + arriving), "no stream was on the hung worker"
    assert "engine loop made no progress" in Path(fc.process(victim).log_path).read_text(errors="replace")
    assert replaced_after >= ENGINE_STALL_S   # not before its timeout
    record("engine thread hung", replaced_after_s=round(replaced_after, 2),
           migrated=sum(1 for o in running + arriving if o.migrations),
           longest_silence_s=round(max(o.recovery_after(t_hang) for o in running), 2))
    wait_for(fc.all_healthy, 60, "the new worker serving")
    wait_for(fc.at_baseline, 30, "free blocks back at baseline on every worker")
