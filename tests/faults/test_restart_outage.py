"""A role with a single worker, killed under load: the restart is an outage of the whole role.

Every request that needs that role (the streams it held, those that arrive meanwhile) waits for
the restart, all of them bounded by the same time: the supervisor's known restart (`pdserve up`
passes the router --worker-wait-s from its workers' measured start-up) or the request's own
deadline. None is lost when the restart fits in its deadline; one whose deadline is shorter
fails UNAVAILABLE, naming the missing role, before its deadline."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.client import Client
from tests.conftest import random_prompts
from tests.faults.harness import FaultCluster, observe, wait_for

pytestmark = pytest.mark.faults

MAX_TOKENS = 40
IN_FLIGHT, ARRIVING = 10, 4     # streams running when the worker dies, and requests sent during the outage
PROMPTS = {role: random_prompts(IN_FLIGHT + ARRIVING, 8, 40, seed=700 + i) for i, role in enumerate(("decode", "prefill"))}
SHORT_S = 3.0                   # a client deadline well inside the outage (a backoff plus a start)
ROUTER = ["--stall-timeout-s", "3", "--migration-limit", "3"]   # no --worker-wait-s: the supervisor's


@pytest.fixture(scope="module")
def reference(tiny_qwen3: str) -> dict[str, list[list[int]]]:
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {role: [out.token_ids for out in llm.generate(prompts, params)] for role, prompts in PROMPTS.items()}


@pytest.fixture(scope="module")
def single(tiny_qwen3: str):
    cluster = FaultCluster(tiny_qwen3, prefill=1, decode=1, router_args=ROUTER)
    yield cluster
    cluster.close()


def test_the_router_waits_as_long_as_the_supervisor_needs_for_a_restart(single) -> None:
    cmd = single.process("router").cmd
    wait_s = float(cmd[cmd.index("--worker-wait-s") + 1])
    slowest = max(p.start_s for p in single.cluster.processes if p.name != "router")
    assert slowest > 0 and wait_s > 1.0 + 2 * slowest, (wait_s, slowest)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_single_worker_role_killed_under_load_loses_no_request(single, reference, role: str) -> None:
    wait_for(single.all_healthy, 120, "every worker healthy")
    wait_for(single.at_baseline, 30, "free blocks at baseline")
    prompts = PROMPTS[role]
    running = [observe(single.router, p, MAX_TOKENS, timeout=180) for p in prompts[:IN_FLIGHT]]
    wait_for(lambda: sum(1 for o in running if o.tokens) >= IN_FLIGHT // 2, 60, "streams under way")
    victim = single.names(role)[0]
    proc = single.process(victim)
    old_pid = proc.popen.pid
    # As if it were its third restart in a row: a 4 s backoff, so that the outage is longer than
    # the fixed 5 s wait of old even on a fast machine (and still within the supervisor's bound).
    proc.restarts, proc.started_at = 2, time.monotonic()
    t_kill = time.monotonic()
    single.signal(victim, signal.SIGKILL)
    arriving = [observe(single.router, p, MAX_TOKENS, timeout=180) for p in prompts[IN_FLIGHT:]]
    # A request whose deadline ends well inside the outage (a restart takes the backoff plus a start).
    short_code, short_details = None, ""
    t0 = time.monotonic()
    try:
        with Client(single.router, timeout=SHORT_S) as client:
            client.generate(random_prompts(1, 12, 12, seed=800 + len(role))[0], max_tokens=4)
    except grpc.RpcError as exc:
        short_code, short_details = exc.code().name, exc.details() or ""
    short_s = time.monotonic() - t0
    for obs in running + arriving:
        assert obs.done.wait(180), "a request hung through the restart"
    restarted_after = None
    if single.process(victim).popen.pid != old_pid:
        restarted_after = single.process(victim).started_at - t_kill
    failed = [(o.code, o.details) for o in running + arriving if o.code is not None]
    assert not failed, f"{len(failed)} of {len(running + arriving)} requests failed: {failed[:3]}"
    assert [o.tokens for o in running + arriving] == reference[role]   # exactly a fault-free run's tokens
    assert all(o.finish_reason == "length" for o in running + arriving)
    assert restarted_after is not None and restarted_after > 3.5, restarted_after
    assert short_code == "UNAVAILABLE" and f"no healthy {role} worker" in short_details, (short_code, short_details,
                                                                                          short_s)
    assert short_s < SHORT_S, short_s   # before the client's own deadline: it is told why
    wait_for(single.all_healthy, 60, "the restarted worker serving")
    wait_for(single.at_baseline, 30, "free blocks back at baseline on every worker")
