"""The internal plane against a hostile local user, over real processes and sockets: the ports a
supervisor reserves (no other uid can bind a restarting worker's port), per-call proofs of the
cluster token (the token never goes on the wire; a server that cannot prove itself gets nothing
and is believed in nothing), the open-plane refusal, the TP rendezvous, the open health service
and ping floods."""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import worker_pb2
from pdserve.services.client import Client
from pdserve.services.kv_transfer import GrpcKVSender, KVTransferError
from pdserve.services.deployment.launcher import wait_serving
from pdserve.services.common.ports import PortReservations, RESERVED_PORTS_ENV
from pdserve.services.common.security import (Credentials,
    TLSFiles,
    require_cluster_token,
    require_secure_internal_plane)
from pdserve.services.common.proofs import AUTH_HEADER, ClusterKey, _Nonces
from pdserve.services.common.grpc_setup import MAX_HEALTH_WATCHES, start_server
from tests.conftest import random_prompts
from tests.serving import start_cluster, worker_status, workers

NOBODY = 65534
HOSTS = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"), (socket.AF_INET6, "::1")]
PROMPT = random_prompts(1, 12, 12, seed=3)[0]
INVENTED = 777   # the token id an impostor streams


def _try_bind(port: int) -> list[str]:
    """Every way to bind port (address x SO_REUSEADDR x SO_REUSEPORT x listen) that succeeded."""
    won = []
    for (family, host), reuseaddr, reuseport, listen in itertools.product(HOSTS, (0, 1), (0, 1), (0, 1)):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuseaddr)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuseport)
            s.bind((host, port))
            if listen:
                s.listen()
            won.append(f"{host} reuseaddr={reuseaddr} reuseport={reuseport} listen={listen}")
        except OSError:
            pass
        finally:
            s.close()
    return won


class Nobody:
    """A forked process running as uid nobody that binds ``port`` every way it can, over and over,
    until stopped; ``stop()`` returns (attempt rounds, the ways that won)."""

    def __init__(self, port: int, rounds: int | None = None) -> None:
        self.stop_r, self.stop_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:   # the child: sockets only, then _exit
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                n, won = 0, set()
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and (rounds is None or n < rounds):
                    won.update(_try_bind(port))
                    n += 1
                    if select.select([self.stop_r], [], [], 0.005)[0]:
                        break
                os.write(out_w, json.dumps([n, sorted(won), os.getuid()]).encode())
            finally:
                os._exit(0)
        os.close(out_w)

    def stop(self) -> tuple[int, list[str]]:
        os.write(self.stop_w, b"x")
        data = b""
        while chunk := os.read(self.out_r, 65536):
            data += chunk
        os.waitpid(self.pid, 0)
        for fd in (self.stop_r, self.stop_w, self.out_r):
            os.close(fd)
        n, won, uid = json.loads(data)
        assert uid == NOBODY
        return n, won


@pytest.fixture(autouse=True)
def _root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as uid nobody")


# ---- ports ---------------------------------------------------------------------------------------
def test_a_reserved_port_is_bound_by_no_other_user_and_by_our_servers() -> None:
    ports = PortReservations()
    try:
        port = ports.reserve()
        assert Nobody(port, rounds=1).stop() == (1, [])
        # our own servers, told the port is reserved for them, bind it (and answer on it)
        os.environ[RESERVED_PORTS_ENV] = str(port)

        async def serve() -> int:
            server = await start_server([], "127.0.0.1", port)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return reply.status
            finally:
                await server.server.stop(0)
        assert asyncio.run(serve()) == health_pb2.HealthCheckResponse.SERVING
    finally:
        os.environ.pop(RESERVED_PORTS_ENV, None)
        ports.close()
    assert _try_bind(port)   # released: anyone may bind it again


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    c = start_cluster(tiny_qwen3, prefill_workers=0, decode_workers=0, colocated_workers=1)
    yield c
    c.stop()


def _restart(cluster, name: str, timeout: float = 90.0) -> None:
    """Supervise until the child `name` has been restarted and serves again."""
    proc = next(p for p in cluster.processes if p.name == name)
    old = proc.popen.pid
    deadline = time.monotonic() + timeout
    while proc.popen.pid == old or not proc.alive:
        assert time.monotonic() < deadline, f"{name} not restarted"
        cluster.supervise_once()
        time.sleep(0.05)
    wait_serving(proc.address, proc.popen, timeout=deadline - time.monotonic())


def _kill(cluster, name: str) -> None:
    proc = next(p for p in cluster.processes if p.name == name)
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)


def test_a_restarting_workers_port_cannot_be_taken_by_another_user(cluster) -> None:
    worker = workers(cluster)[0]
    port = int(worker.rsplit(":", 1)[1])
    nobody = Nobody(port)                     # tries from before the kill until after the restart
    try:
        _kill(cluster, "both-0")
        _restart(cluster, "both-0")
    finally:
        rounds, won = nobody.stop()
    assert won == [] and rounds > 10, (rounds, won)
    assert worker_status(cluster, worker).num_total_blocks > 0   # the worker is back, on its port
    with Client(cluster.router_address, timeout=60) as client:
        assert len(client.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4


class Impostor:
    """A gRPC server on a member's address (as if it had won the port): records every call's
    metadata and answers like a healthy colocated worker that streams INVENTED tokens."""

    def __init__(self, port: int) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]]]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.so_reuseport", 1)])
        self.server.add_generic_rpc_handlers((self,))
        assert self.server.add_insecure_port(f"127.0.0.1:{port}") == port
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails):
        self.calls.append((details.method, [(k, v if isinstance(v, str) else v.decode("latin-1"))
                                            for k, v in details.invocation_metadata]))
        method = details.method.rsplit("/", 1)[-1]
        if method == "Check":
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING),
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        if method == "WatchStatus":
            def statuses(req, ctx):
                for _ in range(100):
                    yield worker_pb2.WorkerStatus(role=worker_pb2.WORKER_ROLE_BOTH, worker_id="both-0",
                                                  num_total_blocks=512, num_free_blocks=512, block_size=8,
                                                  max_model_len=4096, max_num_batched_tokens=512)
                    time.sleep(0.2)
            return grpc.unary_stream_rpc_method_handler(statuses, response_serializer=lambda m: m.SerializeToString())
        if method == "Generate":
            def invented(req, ctx):
                yield worker_pb2.GenerateLocalEvent(first_token=worker_pb2.FirstToken(token_id=INVENTED))
                yield worker_pb2.GenerateLocalEvent(decode=worker_pb2.DecodeEvent(
                    token_ids=[INVENTED] * 3, finished=True, finish_reason="length"))
            return grpc.unary_stream_rpc_method_handler(invented, response_serializer=lambda m: m.SerializeToString())
        return None   # UNIMPLEMENTED

    def stop(self) -> None:
        self.server.stop(0).wait(10)


def _leaks(token: str, calls) -> list[str]:
    """Metadata values holding the token or any 8-character piece of it."""
    pieces = {token[i:i + 8] for i in range(len(token) - 7)}
    return [f"{m} {k}={v}" for m, md in calls for k, v in md if any(p in v or p in k for p in pieces)]


def test_a_process_on_a_members_port_gets_no_token_and_relays_nothing(cluster) -> None:
    token = cluster.spec.credentials.cluster_token
    worker = workers(cluster)[0]
    _kill(cluster, "both-0")                   # not restarted meanwhile: the impostor holds the port
    impostor = Impostor(int(worker.rsplit(":", 1)[1]))
    try:
        wait_serving(worker, None, timeout=10, credentials=cluster.spec.credentials)   # the launcher's probe
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and not any(m.endswith("WatchStatus") for m, _ in impostor.calls):
            time.sleep(0.1)                    # the router reconnects its status stream to it
        with Client(cluster.router_address, timeout=30) as client:
            try:
                tokens = client.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids
            except grpc.RpcError as exc:
                tokens = []
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), exc
        assert INVENTED not in tokens
        methods = {m for m, _ in impostor.calls}
        assert "/pdserve.v1.Worker/WatchStatus" in methods and "/grpc.health.v1.Health/Check" in methods, methods
        assert _leaks(token, impostor.calls) == []
        probes = [md for m, md in impostor.calls if m.endswith("/Check")]
        assert all(k not in (AUTH_HEADER, "x-pdserve-cluster-token") for md in probes for k, _ in md), probes
        assert any(k == AUTH_HEADER for m, md in impostor.calls if m.endswith("WatchStatus") for k, _ in md)
    finally:
        impostor.stop()
        _restart(cluster, "both-0")


def test_kv_goes_only_to_a_receiver_that_proves_membership(cluster) -> None:
    """The prefill side's KV stream to an impostor: it receives the proof, never the token, and no
    frame (the sender waits for the receiver's proof before writing)."""
    import torch

    from pdserve.services.kv_transfer import KVBlock
    token = cluster.spec.credentials.cluster_token
    received: list[bytes] = []

    class Sink(grpc.GenericRpcHandler):
        def service(self, details):
            calls.append((details.method, list(details.invocation_metadata)))

            def push(frames, ctx):
                ctx.send_initial_metadata((("x-pdserve-auth-reply", "forged"),))
                received.extend(frames)
                return b""
            return grpc.stream_unary_rpc_method_handler(push)
    calls: list = []
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((Sink(),))
    bound = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def send() -> str:
        creds = cluster.spec.credentials
        sender = GrpcKVSender(lambda a: creds.channel(a, attach_token=False), proof=creds.call_proof)
        stream = sender.open(f"127.0.0.1:{bound}", "r1", b"t" * 16)
        await stream.send([KVBlock("r1", 0, 1, torch.zeros(2, 2, 8, 2, 4))])
        try:
            await stream.finish(timeout=10)
            return "OK"
        except KVTransferError as exc:
            return exc.code
        finally:
            await sender.close()
    try:
        assert asyncio.run(send()) == "UNAUTHENTICATED"
        assert calls and _leaks(token, calls) == []
        assert received == []
    finally:
        server.stop(0).wait(10)


# ---- proofs --------------------------------------------------------------------------------------
def test_a_proof_is_bound_to_its_method_server_message_time_key_and_used_once() -> None:
    key, other = ClusterKey("k" * 32), ClusterKey("x" * 32)
    now = int(time.time() * 1000)
    proof = dict(key.prove("/a/B", "127.0.0.1:5", b"msg", now_ms=now, nonce="n" * 16).metadata)[AUTH_HEADER]
    assert "k" * 8 not in proof
    claim = key.check("/a/B", proof)
    assert (claim.nonce, claim.target, claim.ms) == ("n" * 16, "127.0.0.1:5", now)
    assert claim.digest == dict(key.prove("/a/C", "x:1", b"msg").metadata)[AUTH_HEADER].split(".")[4]
    assert key.check("/a/C", proof) is None           # another method
    assert other.check("/a/B", proof) is None         # another token
    assert ClusterKey("k" * 32, "admin").check("/a/B", proof) is None   # the admin token's keys are others
    assert key.check("/a/B", proof[:-1] + ("A" if proof[-1] != "A" else "B")) is None
    parts = proof.split(".")
    for i, forged in ((3, "MTAuMC4wLjI6NQ"), (4, "A" * 43)):   # another server named, another message's digest
        assert key.check("/a/B", ".".join(parts[:i] + [forged] + parts[i + 1:])) is None
    for bad in ("", "v1", "v1.x.y.z", "v1." + proof[3:], proof + ".x"):
        assert key.check("/a/B", bad) is None
    nonces = _Nonces(window_ms=30_000, limit=4)
    assert nonces.admit(now, "n1", now) and not nonces.admit(now, "n1", now)     # replay
    assert not nonces.admit(now - 31_000, "n2", now)                              # stale
    assert not nonces.admit(now + 31_000, "n3", now)                              # from the future
    for i in range(10):                                                           # bounded: the floor rises
        assert nonces.admit(now + i + 1, f"m{i}", now)
    assert len(nonces.seen) <= 4 and not nonces.admit(now + 1, "m0", now)        # a forgotten one stays refused
    # the server's reply answers this call's nonce only
    p1, p2 = key.prove("/a/B"), key.prove("/a/B")
    assert p1.verify([("x-pdserve-auth-reply", key.reply("/a/B", dict(p1.metadata)[AUTH_HEADER].split(".")[2]))])
    assert not p2.verify([("x-pdserve-auth-reply", key.reply("/a/B", dict(p1.metadata)[AUTH_HEADER].split(".")[2]))])
    assert not p1.verify([])


# ---- no token, no start --------------------------------------------------------------------------
def _cli(args: list[str], env_extra: dict[str, str] | None = None, wait_for: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    env.update(env_extra or {})
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if wait_for is None:
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if wait_for in line:
                break
        return None, "".join(lines)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("role", [["decode"], ["router", "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"]],
                         ids=["worker", "router"])
def test_a_role_without_a_token_refuses_to_start(tiny_qwen3: str, role: list[str]) -> None:
    code, out = _cli([*role, "--model", tiny_qwen3, "--port", "0"])
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1, out
    assert "--cluster-token-file" in lines[0] and "$PDSERVE_CLUSTER_TOKEN" in lines[0] and "--insecure-no-auth" in lines[0]


def test_insecure_no_auth_starts_on_loopback_only_and_warns(tiny_qwen3: str) -> None:
    code, out = _cli(["decode", "--model", tiny_qwen3, "--port", "0", "--insecure-no-auth", "--host", "0.0.0.0"])
    assert code == 2 and "--insecure-no-auth is refused with --host 0.0.0.0" in out, out
    _, out = _cli(["decode", "--model", tiny_qwen3, "--port", "0", "--num-kv-blocks", "16", "--insecure-no-auth"],
                  wait_for="listening on")
    assert "listening on 127.0.0.1:" in out, out
    assert "--insecure-no-auth: the internal plane of this decode worker is open" in out, out


def test_require_cluster_token_rules() -> None:
    require_cluster_token(Credentials("t" * 32), "0.0.0.0", False, "router")   # a token: anywhere
    require_cluster_token(Credentials(), "::1", True, "router")
    for host, insecure in (("127.0.0.1", False), ("10.0.0.1", True), ("example.com", True)):
        with pytest.raises(ValueError):
            require_cluster_token(Credentials(), host, insecure, "router")


def test_the_internal_plane_rule() -> None:
    """Past loopback: mutual TLS, or the explicit flag (never with a wildcard bind)."""
    tls = Credentials("t" * 32, TLSFiles(Path("c"), Path("k"), Path("a")))
    plain = Credentials("t" * 32)
    for binds, dials in ((["127.0.0.1"], []), (["::1"], []), (["localhost"], []), ([], ["127.0.0.1:5", "[::1]:6"])):
        require_secure_internal_plane(plain, "worker", binds=binds, dials=dials)   # loopback: nothing asked
    require_secure_internal_plane(tls, "worker", binds=["0.0.0.0"])                # TLS: anywhere
    require_secure_internal_plane(plain, "worker", binds=["10.1.2.3"], insecure_plane=True)
    require_secure_internal_plane(plain, "router", dials=["10.1.2.3:50052"], insecure_plane=True)
    for binds, dials, flag, words in ((["10.1.2.3"], [], False, "would bind 10.1.2.3"),
                                      ([], ["127.0.0.1:1", "10.1.2.3:5"], False, "would reach 10.1.2.3"),
                                      (["0.0.0.0"], [], True, "refuses --host 0.0.0.0"),
                                      (["::"], [], True, "refuses --host ::")):
        with pytest.raises(ValueError, match=words) as err:
            require_secure_internal_plane(plain, "worker", binds=binds, dials=dials, insecure_plane=flag)
        assert "--tls-cert" in str(err.value)


@pytest.mark.parametrize("argv", [["decode", "--host", "0.0.0.0", "--insecure-internal-plane"],
                                  ["router", "--decode", "10.9.9.9:1", "--prefill", "127.0.0.1:2"]],
                         ids=["wildcard-worker", "router-dialing-another-host"])
def test_a_plane_past_loopback_without_tls_refuses_to_start(tiny_qwen3: str, argv: list[str]) -> None:
    code, out = _cli([*argv, "--model", tiny_qwen3, "--port", "0"], env_extra={"PDSERVE_CLUSTER_TOKEN": "t" * 32})
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out, out
    assert "without mutual TLS" in lines[0] and "--tls-cert" in lines[0], out


# ---- the TP rendezvous ---------------------------------------------------------------------------
def test_the_tp_rendezvous_is_closed_to_other_users(tiny_qwen3: str) -> None:
    from pdserve.engine import LLM, SamplingParams
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, dtype="float32", block_size=8, num_kv_blocks=64, num_threads=1)
    try:
        ranks = llm.engine.runner.ranks
        store_dir = ranks.store_dir
        assert os.stat(store_dir).st_mode & 0o777 == 0o700
        for pid in ranks.pids:   # nothing of the rendezvous on a port
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"--store-port" not in f.read()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                import torch.distributed as dist
                outcomes = []
                for attempt in (lambda: os.listdir(store_dir), lambda: open(os.path.join(store_dir, "store"), "rb"),
                                lambda: dist.FileStore(os.path.join(store_dir, "store"), 2).set("up/1", "1")):
                    try:
                        attempt()
                        outcomes.append("joined")
                    except (OSError, RuntimeError):
                        outcomes.append("refused")
                os.write(w, json.dumps(outcomes).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = os.read(r, 4096)
        os.waitpid(pid, 0)
        os.close(r)
        assert json.loads(data) == ["refused"] * 3
        out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    finally:
        llm.close()
    assert not os.path.exists(store_dir)


# ---- the open health service and HTTP/2 pings ----------------------------------------------------
def test_health_watch_streams_are_capped() -> None:
    async def run() -> tuple[int, str, bool]:
        server = await start_server([], "127.0.0.1", 0)
        calls = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                calls = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(MAX_HEALTH_WATCHES)]
                for w in calls:
                    await asyncio.wait_for(w.read(), 10)   # each one open: its first status arrived
                extra = stub.Watch(health_pb2.HealthCheckRequest())
                calls.append(extra)
                try:
                    await asyncio.wait_for(extra.read(), 10)
                    refused = "served"
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code().name
                check = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)   # Check stays open
                calls[0].cancel()
                deadline = time.monotonic() + 10
                while server.health.watches >= MAX_HEALTH_WATCHES:   # the server ends the cancelled stream
                    assert time.monotonic() < deadline, "the cancelled Watch stream still counts"
                    await asyncio.sleep(0.01)
                again = stub.Watch(health_pb2.HealthCheckRequest())
                calls.append(again)
                reopened = (await asyncio.wait_for(again.read(), 10)).status == health_pb2.HealthCheckResponse.SERVING
                return check.status, refused, reopened
        finally:
            for w in calls:
                w.cancel()
            await server.health.enter_graceful_shutdown()   # ends the Watch streams still open
            await server.server.stop(0)
    status, refused, reopened = asyncio.run(asyncio.wait_for(run(), 60))
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert refused == "RESOURCE_EXHAUSTED" and reopened


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def test_a_ping_flood_gets_goaway() -> None:
    """Raw HTTP/2: PING frames back to back, no data; the server answers a GOAWAY with
    ENHANCE_YOUR_CALM after a few strikes instead of acking forever."""
    result: dict[str, object] = {}

    def flood(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
            buf, deadline = b"", time.monotonic() + 10
            for i in range(200):
                s.sendall(_frame(6, 0, 0, struct.pack(">Q", i)))
                time.sleep(0.01)
                s.setblocking(False)
                try:
                    while chunk := s.recv(65536):
                        buf += chunk
                except (BlockingIOError, ConnectionError):
                    pass
                s.setblocking(True)
                pos = 0
                while pos + 9 <= len(buf):
                    length = int.from_bytes(buf[pos:pos + 3], "big")
                    if buf[pos + 3] == 7 and pos + 9 + length <= len(buf):   # GOAWAY
                        result["goaway"] = int.from_bytes(buf[pos + 13:pos + 17], "big")
                        result["pings"] = i + 1
                        return
                    pos += 9 + length
                if time.monotonic() > deadline:
                    break
            result["pings"] = 200

    async def run() -> None:
        server = await start_server([], "127.0.0.1", 0)
        try:
            t = threading.Thread(target=flood, args=(server.port,))
            t.start()
            while t.is_alive():
                await asyncio.sleep(0.05)
        finally:
            await server.server.stop(0)
    asyncio.run(run())
    assert result.get("goaway") == 0xB, result   # ENHANCE_YOUR_CALM
    assert result["pings"] < 50, result
