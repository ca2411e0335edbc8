"""The planner sizes a running deployment (`pdserve plan --watch --apply --spares`, real processes):
router + 1 prefill + 1 decode worker, and an idle decode worker process that is not a member.
Under a paced load that one decode worker cannot keep within the TPOT target (a cost model that
makes decoding dear), the planner adds the spare as a decode worker; with a cost model under which
one decode worker is enough, it drains and removes it again. No request is lost, and every one
has the offline engine's tokens."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.v1 import worker_pb2
from tests.e2e.test_membership import decode_heavy, members, wait_member
from tests.serving import SteadyLoad, start_cluster, worker_status


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, drain_timeout_s=5)
    yield cluster
    cluster.stop()


def _planner(cluster, profile, spare: str) -> subprocess.CompletedProcess:
    """Two windows of 4 s, acting at once (no confirmations, no dwell). The paced load below sends
    1-4 req/s (2 clients, 0.5 s between a client's requests); for this load's shape (about 24
    tokens in, 40 out) the dear cost model calls for the spare anywhere from 1 to 6 req/s, and
    the cheap one for 1P1D."""
    router_metrics = next(p.metrics_address for p in cluster.processes if p.name == "router")
    return subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "plan", "--watch", "--apply", "--profile", str(profile),
         "--router", cluster.router_address, "--router-metrics", router_metrics, "--slo", "tpot:100",
         "--spares", spare, "--interval-s", "4", "--confirmations", "1", "--min-dwell-s", "0",
         "--min-window-requests", "3", "--num-prompts", "60", "--max-windows", "2"],
        env={**os.environ, **cluster.spec.credentials.child_env(admin=True)}, capture_output=True, text=True,
        timeout=300)   # the planner changes membership: it proves the admin token


def test_the_planner_adds_a_spare_worker_under_load_and_removes_it_when_it_is_not_needed(
        cluster, served_reference, cost, tmp_path) -> None:
    spare = cluster.add_worker("decode", "decode-spare")   # running, not a member
    assert spare.address not in members(cluster)
    decode = lambda: [a for a, w in members(cluster).items() if w.role == worker_pb2.WORKER_ROLE_DECODE]  # noqa: E731
    assert len(decode()) == 1
    with SteadyLoad(cluster.router_address, clients=2, seed=8, max_tokens=40, pause_s=0.5) as load:
        load.served(3)
        up = _planner(cluster, decode_heavy(cost).save(tmp_path / "dear.json"), spare.address)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"added {spare.address} as decode" in up.stdout, up.stdout
        assert "scale up to 1P2D" in up.stdout, up.stdout
        entry = wait_member(cluster, spare.address, lambda e: e is not None and e.placed_total > 0, timeout=30)
        assert entry.role == worker_pb2.WORKER_ROLE_DECODE and len(decode()) == 2
        down = _planner(cluster, cost.save(tmp_path / "cheap.json"), spare.address)
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"removed {spare.address} (decode)" in down.stdout and "scale down to 1P1D" in down.stdout, down.stdout
        assert spare.address not in members(cluster) and len(decode()) == 1
        load.served(3)
    load.check(served_reference)
    status = worker_status(cluster, spare.address)   # drained: every block back
    assert status.num_free_blocks == status.num_total_blocks
