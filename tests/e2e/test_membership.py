"""Workers join and leave a running router, and change role, while it serves (real processes,
real gRPC on loopback): services/router/membership.py, services/workers/membership_client.py,
`pdserve workers`.

One deployment for the module (router + 1 prefill + 1 decode named by flag); the tests add
workers that join with --router, under a steady load whose every request must finish with the
tokens it had before any change (greedy, batch-invariant)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.v1 import membership_pb2 as m
from pdserve.v1 import membership_pb2_grpc, worker_pb2
from pdserve.services.common.security import Credentials, new_token
from tests.serving import SteadyLoad, start_cluster, worker_status



@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, drain_timeout_s=5)
    yield cluster
    cluster.stop()


def members(cluster, credentials: Credentials | None = None) -> dict[str, m.Member]:
    with (credentials or cluster.spec.credentials).sync_channel(cluster.router_address) as ch:
        return {w.address: w for w in membership_pb2_grpc.MembershipStub(ch).ListWorkers(
            m.ListWorkersRequest(), timeout=10).workers}


def wait_member(cluster, address: str, ok, timeout: float = 30.0) -> m.Member | None:
    """The member entry of address once ok(entry) holds (entry None: not a member)."""
    deadline = time.monotonic() + timeout
    while True:
        entry = members(cluster).get(address)
        if ok(entry):
            return entry
        if time.monotonic() > deadline:
            raise AssertionError(f"{address}: {entry} after {timeout}s; members: {list(members(cluster).values())}")
        time.sleep(0.1)


def serving(entry: m.Member | None) -> bool:
    return entry is not None and entry.state == m.MEMBER_STATE_SERVING


def workers_cli(cluster, *args: str, token: bool = True, admin: bool = True) -> subprocess.CompletedProcess:
    """`pdserve workers ARGS` with the deployment's cluster token (token) and admin token (admin)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_CLUSTER_TOKEN", "PDSERVE_ADMIN_TOKEN")}
    if token:
        env.update(cluster.spec.credentials.child_env(admin=admin))
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", "workers", *args, "--router", cluster.router_address],
                          env=env, capture_output=True, text=True, timeout=120)


def joined_worker(cluster, role: str, name: str):
    return cluster.add_worker(role, name, ["--router", cluster.router_address])


def test_the_membership_api_needs_the_cluster_token(cluster) -> None:
    listed = members(cluster)
    assert {w.state for w in listed.values()} == {m.MEMBER_STATE_SERVING}
    assert sorted(worker_pb2.WorkerRole.Name(w.role) for w in listed.values()) == ["WORKER_ROLE_DECODE",
                                                                                   "WORKER_ROLE_PREFILL"]
    for creds in (Credentials(), Credentials(new_token())):   # no proof; a proof of another token
        with pytest.raises(grpc.RpcError) as err:
            members(cluster, creds)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with creds.sync_channel(cluster.router_address) as ch, pytest.raises(grpc.RpcError) as err:
            membership_pb2_grpc.MembershipStub(ch).AddWorker(
                m.AddWorkerRequest(address="127.0.0.1:1", role=worker_pb2.WORKER_ROLE_DECODE), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert set(members(cluster)) == set(listed)   # nothing was added
    cli = workers_cli(cluster, "list", token=False)
    assert cli.returncode == 1 and "cluster token" in cli.stderr, cli.stderr
    cli = workers_cli(cluster, "list")
    assert cli.returncode == 0 and all(a in cli.stdout for a in listed), cli.stdout + cli.stderr


@pytest.mark.parametrize("request_, code", [
    (m.AddWorkerRequest(address="no-port", role=worker_pb2.WORKER_ROLE_DECODE), "INVALID_ARGUMENT"),
    (m.AddWorkerRequest(address="127.0.0.1:9", role=worker_pb2.WORKER_ROLE_UNSPECIFIED), "INVALID_ARGUMENT"),
    (m.AddWorkerRequest(address="10.99.0.2:5000", role=worker_pb2.WORKER_ROLE_DECODE), "FAILED_PRECONDITION"),
    (m.DrainWorkerRequest(address="127.0.0.1:9"), "NOT_FOUND"),
])
def test_bad_membership_requests_are_refused_with_a_clear_status(cluster, request_, code) -> None:
    with cluster.spec.credentials.sync_channel(cluster.router_address) as ch:
        stub = membership_pb2_grpc.MembershipStub(ch)
        call = stub.AddWorker if isinstance(request_, m.AddWorkerRequest) else stub.DrainWorker
        with pytest.raises(grpc.RpcError) as err:
            call(request_, timeout=10)
    assert err.value.code().name == code, err.value.details()
    assert len(members(cluster)) >= 2   # the router still serves its members


def test_a_decode_worker_joins_under_load_takes_requests_then_is_removed_without_a_loss(
        cluster, served_reference) -> None:
    with SteadyLoad(cluster.router_address, seed=1) as load:
        load.served(4)
        proc = joined_worker(cluster, "decode", "decode-joined")
        t0 = time.monotonic()
        entry = wait_member(cluster, proc.address, lambda e: e is not None and e.placed_total > 0, timeout=20)
        took = time.monotonic() - t0
        assert entry.joined and entry.role == worker_pb2.WORKER_ROLE_DECODE
        load.served(6)
        cli = workers_cli(cluster, "remove", proc.address, "--drain-timeout-s", "10")
        assert cli.returncode == 0, cli.stderr
        assert "removed" in cli.stdout, cli.stdout
        assert proc.address not in members(cluster)
        load.served(4)
    load.check(served_reference)
    status = worker_status(cluster, proc.address)   # the process runs on, empty, and does not join again
    assert status.num_free_blocks == status.num_total_blocks
    time.sleep(1.5)   # kept: a window in which it must not join again
    assert proc.address not in members(cluster)
    print(f"the joined decode worker took its first request {took:.2f}s after it was up")


def test_a_drain_timeout_moves_the_requests_left_to_other_workers(cluster, served_reference) -> None:
    proc = joined_worker(cluster, "decode", "decode-evicted")
    wait_member(cluster, proc.address, serving)
    with SteadyLoad(cluster.router_address, clients=3, seed=2, max_tokens=400) as load:
        wait_member(cluster, proc.address, lambda e: e is not None and e.inflight > 0, timeout=30)
        # a drain time shorter than a request
        with cluster.spec.credentials.sync_channel(cluster.router_address) as ch:
            gone = membership_pb2_grpc.MembershipStub(ch).RemoveWorker(
                m.DrainWorkerRequest(address=proc.address, drain_timeout_s=0.001), timeout=60)
        assert gone.state == m.MEMBER_STATE_REMOVED
        load.served(6)
    load.check(served_reference)
    assert load.migrations >= 1   # what was still on the worker moved, and finished with its exact tokens
    status = worker_status(cluster, proc.address)
    assert status.num_free_blocks == status.num_total_blocks


def test_drain_and_resume(cluster, served_reference) -> None:
    decode = next(a for a, w in members(cluster).items() if w.role == worker_pb2.WORKER_ROLE_DECODE)
    cli = workers_cli(cluster, "drain", decode)
    assert cli.returncode == 0 and "drain" in cli.stdout, cli.stdout + cli.stderr
    wait_member(cluster, decode, lambda e: e.state == m.MEMBER_STATE_DRAINED)
    cli = workers_cli(cluster, "resume", decode, "--json")
    assert cli.returncode == 0 and '"state": "serving"' in cli.stdout, cli.stdout + cli.stderr
    with SteadyLoad(cluster.router_address, seed=3) as load:
        load.served(3)
    load.check(served_reference)


def serves_in_its_role(cluster, address: str, others: list[str]) -> None:
    """address takes requests in its role: the other workers of that role are drained meanwhile
    (placement by cost could keep preferring them), then resumed."""
    before = members(cluster)[address].placed_total
    for other in others:
        assert workers_cli(cluster, "drain", other).returncode == 0
    try:
        wait_member(cluster, address, lambda e: e.placed_total > before)
    finally:
        for other in others:
            assert workers_cli(cluster, "resume", other).returncode == 0


def test_a_worker_switches_role_under_load_without_a_loss(cluster, served_reference) -> None:
    proc = joined_worker(cluster, "prefill", "prefill-switched")
    wait_member(cluster, proc.address, serving)

    def of_role(role: int) -> list[str]:
        return [a for a, w in members(cluster).items() if w.role == role and a != proc.address]
    with SteadyLoad(cluster.router_address, seed=5) as load:
        load.served(4)
        cli = workers_cli(cluster, "switch-role", proc.address, "--role", "decode", "--json")
        assert cli.returncode == 0 and '"role": "decode"' in cli.stdout, cli.stdout + cli.stderr
        assert worker_status(cluster, proc.address).role == worker_pb2.WORKER_ROLE_DECODE
        serves_in_its_role(cluster, proc.address, of_role(worker_pb2.WORKER_ROLE_DECODE))   # it decodes now
        load.served(4)
        cli = workers_cli(cluster, "switch-role", proc.address, "--role", "prefill")
        assert cli.returncode == 0, cli.stderr
        assert members(cluster)[proc.address].role == worker_pb2.WORKER_ROLE_PREFILL
        serves_in_its_role(cluster, proc.address, of_role(worker_pb2.WORKER_ROLE_PREFILL))  # and prefills again
        load.served(4)
    load.check(served_reference)
    status = worker_status(cluster, proc.address)
    assert status.role == worker_pb2.WORKER_ROLE_PREFILL and status.num_free_blocks == status.num_total_blocks


def test_a_worker_turns_colocated_among_prefill_and_decode_workers_and_back_under_load(
        cluster, served_reference) -> None:
    """prefill -> colocated -> decode -> prefill under load: colocated, it prefills and decodes
    its own requests beside the others, and serves alone while every other worker is drained."""
    proc = joined_worker(cluster, "prefill", "colocated-switched")
    wait_member(cluster, proc.address, serving)
    others = [a for a in members(cluster) if a != proc.address]
    with SteadyLoad(cluster.router_address, seed=7) as load:
        load.served(3)
        cli = workers_cli(cluster, "switch-role", proc.address, "--role", "both", "--json")
        assert cli.returncode == 0 and '"role": "both"' in cli.stdout, cli.stdout + cli.stderr
        assert worker_status(cluster, proc.address).role == worker_pb2.WORKER_ROLE_BOTH
        before = members(cluster)[proc.address].placed_total
        serves_in_its_role(cluster, proc.address, others)   # alone: no prefill or decode worker admits
        assert members(cluster)[proc.address].placed_total > before
        load.served(3)
        cli = workers_cli(cluster, "switch-role", proc.address, "--role", "decode")
        assert cli.returncode == 0, cli.stderr
        decoders = [a for a, w in members(cluster).items()
                    if w.role == worker_pb2.WORKER_ROLE_DECODE and a != proc.address]
        serves_in_its_role(cluster, proc.address, decoders)
        cli = workers_cli(cluster, "switch-role", proc.address, "--role", "prefill")
        assert cli.returncode == 0, cli.stderr
        load.served(3)
    load.check(served_reference)
    status = worker_status(cluster, proc.address)
    assert status.role == worker_pb2.WORKER_ROLE_PREFILL and status.num_free_blocks == status.num_total_blocks
    assert workers_cli(cluster, "remove", proc.address).returncode == 0   # the module's deployment as it was


def test_a_restarted_router_gets_its_joined_workers_back(cluster, served_reference) -> None:
    proc = joined_worker(cluster, "prefill", "prefill-joined")
    wait_member(cluster, proc.address, serving)
    router = next(p for p in cluster.processes if p.name == "router")
    router.popen.send_signal(signal.SIGTERM)
    router.popen.wait(30)
    router.start()
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(grpc.RpcError):
            if serving(members(cluster).get(proc.address)):
                break
        assert time.monotonic() < deadline, "the joined worker did not come back to the restarted router"
        time.sleep(0.2)
    others = [a for a, w in members(cluster).items() if w.role == worker_pb2.WORKER_ROLE_PREFILL and a != proc.address]
    with SteadyLoad(cluster.router_address, seed=4) as load:
        serves_in_its_role(cluster, proc.address, others)   # (placement by cost could keep preferring them)
        load.served(2)
    load.check(served_reference)


def decode_heavy(cost):
    """The fixed tiny cost model with decoding made dear (20 ms per sequence in a step): at any
    rate the load below reaches, more decode workers serve more, so the planner's choice does not
    hang on how fast this machine is today."""
    import dataclasses

    from pdserve.engine.step_cost import KindFit
    fits = {**cost.fits, "decode": KindFit({"const": 0.005, "decode_seqs": 0.02, "decode_context": 0.0}, 0, 0.0),
            "mixed": KindFit({**cost.fits["mixed"].coefficients, "decode_seqs": 0.02}, 0, 0.0)}
    return dataclasses.replace(cost, fits=fits)


def test_the_planner_in_the_loop_moves_prefill_workers_to_decode_under_a_decode_heavy_load(cluster, served_reference,
                                                                                          cost, tmp_path) -> None:
    """`pdserve plan --watch --apply` reads the router's /metrics, simulates every split of its
    workers on that traffic (a decode-heavy cost model) and switches roles through the membership
    API, while the load runs on without a loss."""
    before = members(cluster)
    prefill = [a for a, w in before.items() if w.role == worker_pb2.WORKER_ROLE_PREFILL]
    if len(prefill) < 2:   # the split to move from: at least 2 prefill workers, 1 decode
        wait_member(cluster, joined_worker(cluster, "prefill", "prefill-planned").address, serving)
    profile = decode_heavy(cost).save(tmp_path / "profile.json")
    router_metrics = next(p.metrics_address for p in cluster.processes if p.name == "router")
    env = {**os.environ, **cluster.spec.credentials.child_env(admin=True)}   # the planner changes membership
    with SteadyLoad(cluster.router_address, clients=3, seed=6, max_tokens=120) as load:
        load.served(3)
        planner = subprocess.run(
            [sys.executable, "-m", "pdserve.services.cli", "plan", "--watch", "--apply", "--profile", str(profile),
             "--router", cluster.router_address, "--router-metrics", router_metrics, "--slo", "ttft:600000",
             "--interval-s", "3", "--confirmations", "1", "--min-dwell-s", "0",
             "--min-window-requests", "3", "--num-prompts", "60", "--max-windows", "2"],
            env=env, capture_output=True, text=True, timeout=300)
        load.served(3)
    assert planner.returncode == 0, planner.stdout + planner.stderr
    assert '"applied": true' in planner.stdout and "switched" in planner.stdout, planner.stdout
    after = members(cluster)
    decode_before = sum(w.role == worker_pb2.WORKER_ROLE_DECODE for w in before.values())
    assert sum(w.role == worker_pb2.WORKER_ROLE_DECODE for w in after.values()) > decode_before, planner.stdout
    load.check(served_reference)
