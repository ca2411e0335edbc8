"""Internal proofs bound to their server and message, and membership changes kept for the admin
token (issue 41), over real processes: a proof made for one member is refused at another, and
with another message at its own; a member's cluster token changes no membership, the admin
token does; the router dials only HOST:PORT addresses, drains for a bounded time, lets a worker
join only itself, and trusts its own record of a worker's role; `pdserve workers` keeps the
plane rule (no plaintext off loopback)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pdserve.v1 import common_pb2, membership_pb2 as m, membership_pb2_grpc, worker_pb2
from pdserve.services.kv_transfer import tcp_wire
from pdserve.services.common.ports import free_port
from pdserve.services.common.security import ADMIN_TOKEN_ENV, CLUSTER_TOKEN_ENV, Credentials, new_token
from tests.serving import SteadyLoad, start_cluster, workers

ABORT = "/pdserve.v1.Worker/Abort"
PUSH = "/pdserve.v1.KVTransfer/PushBlocks"


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    c = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, drain_timeout_s=5)
    yield c
    c.stop()


def _abort(address: str, metadata, request_id: str) -> tuple[grpc.StatusCode, str]:
    """Worker.Abort at address over a bare channel, with the given proof; its status and details."""
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(ABORT, request_serializer=common_pb2.AbortRequest.SerializeToString,
                              response_deserializer=common_pb2.AbortResponse.FromString)
        try:
            call(common_pb2.AbortRequest(request_id=request_id), metadata=metadata, timeout=10)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""


def test_a_captured_proof_works_at_no_other_member_and_for_no_other_message(cluster) -> None:
    creds = cluster.spec.credentials   # the deployment's own token: the proof is genuine
    prefill, decode = workers(cluster, "prefill")[0], workers(cluster, "decode")[0]
    message = common_pb2.AbortRequest(request_id="r1").SerializeToString()
    captured = creds.call_proof(ABORT, prefill, message).metadata   # as the router sent it to the prefill worker
    code, details = _abort(decode, captured, "r1")                  # replayed at another member, same message
    assert code == grpc.StatusCode.UNAUTHENTICATED and "another server" in details, details
    code, details = _abort(prefill, captured, "r2")                 # at its own member, another message
    assert code == grpc.StatusCode.UNAUTHENTICATED and "first message" in details, details
    fresh = creds.call_proof(ABORT, prefill, message).metadata       # the control: its server, its message
    assert _abort(prefill, fresh, "r1") == (grpc.StatusCode.OK, "")
    assert _abort(prefill, fresh, "r1")[0] == grpc.StatusCode.UNAUTHENTICATED   # and once only


def test_a_request_streams_proof_is_checked_against_its_first_message_before_any_work(cluster) -> None:
    creds = cluster.spec.credentials
    decode = workers(cluster, "decode")[0]
    meant, sent = b"\x0a\x04open-meant", b"\x0a\x04open-other"

    def push(first: bytes, proof_for: bytes) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(decode) as ch:
            call = ch.stream_unary(PUSH, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            try:
                call(iter([first]), metadata=creds.call_proof(PUSH, decode, proof_for).metadata, timeout=10)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""

    code, details = push(sent, meant)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "first message" in details, details
    code, details = push(sent, sent)   # its own first frame: past the proof, refused by the receiver itself
    assert code != grpc.StatusCode.UNAUTHENTICATED, details


def _tcp_handshake(listener: str, dialed: str) -> str:
    """The KV data plane's handshake over a socket pair: a listener at `listener`, a sender that
    dialed `dialed` (a relay forwarding to another listener). What the sender got."""
    key = tcp_wire.auth_key(new_token())
    server, client = socket.socketpair()
    with server, client:
        server.settimeout(10)
        client.settimeout(10)
        served = threading.Thread(target=lambda: _swallow(tcp_wire.server_handshake, server, key, target=listener))
        served.start()
        try:
            tcp_wire.client_handshake(client, key, dialed)
            return "OK"
        except tcp_wire.Refused as exc:
            return exc.code
        finally:
            served.join(10)


def _swallow(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except (tcp_wire.Refused, OSError):
        pass


def test_the_kv_data_planes_handshake_names_the_listener_dialed() -> None:
    assert _tcp_handshake("127.0.0.1:7001", "127.0.0.1:7001") == "OK"
    assert _tcp_handshake("127.0.0.1:7001", "127.0.0.1:7002") == "UNAUTHENTICATED"   # relayed to another


def _members(credentials: Credentials, router: str) -> dict[str, m.Member]:
    with credentials.sync_channel(router) as ch:
        return {w.address: w for w in membership_pb2_grpc.MembershipStub(ch).ListWorkers(
            m.ListWorkersRequest(), timeout=10).workers}


def test_a_members_token_changes_no_membership_and_the_admin_token_does(cluster) -> None:
    spec = cluster.spec.credentials
    member, admin = Credentials(spec.cluster_token), Credentials(None, None, spec.admin_token)
    router, decode = cluster.router_address, workers(cluster, "decode")[0]
    assert set(_members(member, router)) == set(_members(admin, router))   # both may list
    changes = [("AddWorker", m.AddWorkerRequest(address="127.0.0.1:9", role=worker_pb2.WORKER_ROLE_DECODE)),
               ("DrainWorker", m.DrainWorkerRequest(address=decode)),
               ("RemoveWorker", m.DrainWorkerRequest(address=decode)),
               ("SwitchRole", m.SwitchRoleRequest(address=decode, role=worker_pb2.WORKER_ROLE_PREFILL)),
               ("ResumeWorker", m.MemberRequest(address=decode))]
    with member.sync_channel(router) as ch:
        stub = membership_pb2_grpc.MembershipStub(ch)
        for name, request in changes:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, name)(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "admin token" in err.value.details(), name
    assert all(w.state == m.MEMBER_STATE_SERVING for w in _members(admin, router).values())   # nothing changed
    with admin.sync_channel(router) as ch:
        stub = membership_pb2_grpc.MembershipStub(ch)
        assert stub.DrainWorker(m.DrainWorkerRequest(address=decode), timeout=10).state in (
            m.MEMBER_STATE_DRAINING, m.MEMBER_STATE_DRAINED)
        assert stub.ResumeWorker(m.MemberRequest(address=decode), timeout=10).address == decode
        for bad in (m.DrainWorkerRequest(address=decode, drain_timeout_s=float("inf")),
                    m.DrainWorkerRequest(address=decode, drain_timeout_s=1e9)):
            with pytest.raises(grpc.RpcError) as err:
                stub.RemoveWorker(bad, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "drain_timeout_s" in err.value.details()
        for url in ("http://127.0.0.1:80", "dns:///127.0.0.1:80", "unix:/tmp/x:1", "127.0.0.1:80/path"):
            with pytest.raises(grpc.RpcError) as err:
                stub.AddWorker(m.AddWorkerRequest(address=url, role=worker_pb2.WORKER_ROLE_DECODE), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "HOST:PORT" in err.value.details(), url
    assert _members(admin, router)[decode].state == m.MEMBER_STATE_SERVING


def test_only_the_router_holds_the_admin_token(cluster) -> None:
    for proc in cluster.processes:
        with open(f"/proc/{proc.popen.pid}/environ", "rb") as f:
            names = {entry.split(b"=", 1)[0].decode() for entry in f.read().split(b"\0") if entry}
        assert (ADMIN_TOKEN_ENV in names) == (proc.name == "router") and CLUSTER_TOKEN_ENV in names, proc.name


def test_the_router_trusts_its_own_record_of_a_workers_role(cluster) -> None:
    """A worker added as decode that says it is prefill is not routed to (it stays DOWN)."""
    admin = Credentials(None, None, cluster.spec.credentials.admin_token)
    proc = cluster.add_worker("prefill", "prefill-misnamed")   # not a member yet: no --router
    with admin.sync_channel(cluster.router_address) as ch:
        stub = membership_pb2_grpc.MembershipStub(ch)
        entry = stub.AddWorker(m.AddWorkerRequest(address=proc.address, role=worker_pb2.WORKER_ROLE_DECODE),
                               timeout=30)
        try:
            with SteadyLoad(cluster.router_address, seed=41) as load:
                load.served(4)
            entry = _members(admin, cluster.router_address)[proc.address]
            assert entry.state == m.MEMBER_STATE_DOWN and entry.placed_total == 0, entry
        finally:
            stub.RemoveWorker(m.DrainWorkerRequest(address=proc.address, drain_timeout_s=1), timeout=60)


def _env(**secrets: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_TOKEN_ENV, ADMIN_TOKEN_ENV)}
    return {**env, **secrets}


def _workers_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", "workers", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_pdserve_workers_keeps_the_plane_rule_and_wants_the_admin_token_for_changes() -> None:
    env = _env(**{CLUSTER_TOKEN_ENV: new_token(), ADMIN_TOKEN_ENV: new_token()})
    t0 = time.monotonic()
    out = _workers_cli("list", "--router", "192.0.2.1:50051", env=env)   # TEST-NET: never dialed
    assert out.returncode == 2 and "mutual TLS" in out.stderr and "--insecure-internal-plane" in out.stderr, out
    assert time.monotonic() - t0 < 60   # refused before any connection was tried
    out = _workers_cli("add", "http://127.0.0.1:80", "--role", "decode", "--router", "127.0.0.1:1", env=env)
    assert out.returncode == 2 and "WORKER must be HOST:PORT" in out.stderr, out
    out = _workers_cli("remove", "127.0.0.1:2", "--drain-timeout-s", "inf", "--router", "127.0.0.1:1", env=env)
    assert out.returncode == 2 and "--drain-timeout-s" in out.stderr, out
    out = _workers_cli("drain", "127.0.0.1:2", "--router", "127.0.0.1:1", env=_env(**{CLUSTER_TOKEN_ENV: new_token()}))
    assert out.returncode == 2 and "admin token" in out.stderr, out


def test_a_worker_joins_only_at_its_own_address(tiny_qwen3: str) -> None:
    """A router that may dial other hosts (--insecure-internal-plane) takes a Join only for the
    host the call comes from: a member cannot make it dial elsewhere."""
    token, port = new_token(), free_port()
    router = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "router", "--model", tiny_qwen3, "--host",
                             "127.0.0.1", "--port", str(port), "--insecure-internal-plane"],
                            env=_env(**{CLUSTER_TOKEN_ENV: token}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with Credentials(token).sync_channel(router) as ch:
            stub = membership_pb2_grpc.MembershipStub(ch)   # up once it lists (no worker: not SERVING yet)
            assert stub.ListWorkers(m.ListWorkersRequest(), timeout=120, wait_for_ready=True).workers == []
            elsewhere = stub.Join(m.JoinRequest(address="192.0.2.1:5000", role=worker_pb2.WORKER_ROLE_DECODE,
                                                worker_id="not-me"), timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(iter(elsewhere))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "own address" in err.value.details()
            itself = stub.Join(m.JoinRequest(address=f"localhost:{free_port()}", role=worker_pb2.WORKER_ROLE_DECODE,
                                             worker_id="me"), timeout=10)
            assert next(iter(itself)).state == m.MEMBER_STATE_JOINING   # its own host (loopback): a member
            itself.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
