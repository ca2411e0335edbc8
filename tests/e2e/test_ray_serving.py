"""pdserve on a real Ray cluster (one loopback-only head shared by the module).

Deploys 1 prefill + 1 decode and 2 + 2 as detached Ray actors, over both KV
transports (object store and gRPC), checks concurrent greedy requests against the
offline engine token for token, kills decode actors between requests, and checks
that nothing of the cluster or the deployment listens beyond 127.0.0.1 and that
Ray's token authentication is on. Skipped when Ray is not installed
(`pip install 'pdserve[ray]'`).
"""
from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.settings import ENV
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient
from pdserve.services.deployment.launcher import free_port
from pdserve.services.common.process_table import group_pids, is_alive
from pdserve.services.common.security import API_KEY_ENV, CLUSTER_TOKEN_ENV, Credentials
from tests.conftest import random_prompts
from tests.faults.harness import observe, record, wait_for
from tests.faults.test_engine_stall import (ENGINE_STALL_S, MAX_TOKENS, PROMPTS as STALL_PROMPTS,  # noqa: F401
                                            RAY_REPLACED_WITHIN_S, RUNNING, STALL_ROUTER, STALL_WORKER, reference)
from tests.serving import SteadyLoad, catch_holder, pinned_disaggregation

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

REPO_ROOT = str(Path(__file__).resolve().parents[2])
NAMESPACE = "pdserve-test"
PROMPTS = random_prompts(8, 5, 60, seed=31)
MAX_NEW = 12
ENGINE = {"block_size": 8, "num_kv_blocks": 512, "dtype": "float32"}
ENGINE_FLAGS = ["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32"]
SMALL = {"worker_cpus": 0.5, "router_cpus": 0.5}   # logical CPUs: 2 + 2 and a router fit a 4-CPU head
CLUSTER_TOKEN = secrets.token_urlsafe(32)          # the deployments' internal-plane secret (via the env)
API_KEY = secrets.token_urlsafe(24)                # every deployment's router wants it (clients read the env)


# ---- cluster -----------------------------------------------------------------------
@contextmanager
def _scoped_env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def ray_hang_dir() -> Iterator[Path]:
    """The engine-hang test hook's directory (a file engine-hang-PID there hangs worker PID's engine
    thread): in the raylet's environment, so in every actor's."""
    path = Path(tempfile.mkdtemp(prefix="pdserve-hang-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(ray_hang_dir: Path):
    """`ray start --head` on 127.0.0.1 (token auth with a throwaway token, no dashboard,
    4 logical CPUs, 200 MB object store); this process connected as a driver."""
    from pdserve.services.ray_deploy.cluster import LOOPBACK_ENV, start_local_cluster, stop_local_cluster, use_loopback_node

    path = os.environ.get("PYTHONPATH", "")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), LOOPBACK_ENV: "0",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, path) if p), CLUSTER_TOKEN_ENV: CLUSTER_TOKEN,
           API_KEY_ENV: API_KEY, **ENV.TEST_ENGINE_HANG_DIR.env(ray_hang_dir)}
    with _scoped_env(**env):
        use_loopback_node()
        cluster = start_local_cluster(num_cpus=4, object_store_bytes=200 << 20, save=False)
        try:
            import ray

            ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
            try:
                yield cluster
            finally:
                ray.shutdown()
        finally:
            stop_local_cluster(cluster)


@pytest.fixture(scope="module")
def offline_reference(tiny_qwen3: str) -> list[list[int]]:
    llm = LLM(tiny_qwen3, **ENGINE)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                          ignore_eos=True))]


# ---- helpers ----------------------------------------------------------------------------
async def _generate_all(address: str, prompts: list[list[int]], timeout: float = 60.0):
    async with AsyncClient(address, timeout=timeout) as client:
        return await asyncio.gather(*(client.generate(p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                                      for p in prompts))


def _tokens(address: str, timeout: float = 60.0, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in asyncio.run(_generate_all(address, prompts, timeout))]


def _actor(name: str):
    import ray
    return ray.get_actor(name, namespace=NAMESPACE)


def _info(name: str, timeout: float = 60.0) -> dict:
    """The actor's info(); while it restarts (calls then fail fast), ask again."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(_actor(name).info.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _kill_and_wait_dead(name: str) -> dict:
    """ray.kill(no_restart=False) and wait until the old process is gone (the kill is asynchronous)."""
    import ray

    before = _info(name)
    ray.kill(_actor(name), no_restart=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(before["pid"], 0)
        except ProcessLookupError:
            return before
        time.sleep(0.05)
    raise AssertionError(f"{name} (pid {before['pid']}) did not die")


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def _hex_ip(hex_addr: str):
    host = hex_addr.split(":")[0]
    if len(host) == 8:
        return ipaddress.IPv4Address(bytes.fromhex(host)[::-1])
    addr = ipaddress.IPv6Address(b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, 32, 8)))
    return addr.ipv4_mapped or addr


def _listening(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, ip:port) of every listening TCP socket owned by pids (from /proc)."""
    owner = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[int(link[8:-1])] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in owner:
                out.append((owner[int(f[9])], f"{_hex_ip(f[1])}:{int(f[1].split(':')[1], 16)}"))
    return out


def _deploy(model: str, name: str, **kwargs):
    from pdserve.services.ray_deploy import RayDeployment, deploy
    kwargs["router_args"] = pinned_disaggregation(kwargs.get("router_args", ()))   # KV through Ray's transports
    spec = RayDeployment(model=model, name=name, namespace=NAMESPACE, port=free_port(), engine=dict(ENGINE),
                         ready_timeout_s=180, **{**SMALL, **kwargs})
    return deploy(spec)


def _teardown(name: str) -> None:
    from pdserve.services.ray_deploy import teardown
    teardown(name, NAMESPACE)


# ---- deployed with the CLI: 1 prefill + 1 decode, KV through the object store ---------------
@pytest.fixture(scope="module")
def cli_deployment(ray_cluster, tiny_qwen3: str):
    res = _cli("ray", "up", "--address", ray_cluster.address, "--namespace", NAMESPACE, "--name", "cli",
               "--model", tiny_qwen3, "--prefill-workers", "1", "--decode-workers", "1", "--port", str(free_port()),
               "--worker-cpus", "0.5", "--router-cpus", "0.5", "--timeout", "180", "--json", *ENGINE_FLAGS,
               *pinned_disaggregation([]))   # its tests follow the KV through Ray's object store
    assert res.returncode == 0, res.stderr[-4000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    yield info
    _teardown("cli")


def test_cli_up_returns_serving_and_detached(cli_deployment) -> None:
    # `pdserve ray up` has exited: its actors live on, named, in the namespace.
    from pdserve.services.ray_deploy.deploy import list_actors
    assert list_actors("cli", NAMESPACE) == ["cli-decode-0", "cli-prefill-0", "cli-router"]
    decode = next(w for w in cli_deployment["workers"] if w["role"] == "decode")
    assert decode["kv_address"] == f"ray://{NAMESPACE}/cli-decode-0"
    assert cli_deployment["router_address"].startswith("127.0.0.1:")


def _kv_bytes_settled(sender: str, receiver: str, timeout: float = 10.0) -> tuple[float, float]:
    """(bytes the prefill actor counted as sent, bytes the decode actor received), once equal: a
    prefill worker counts its bytes when the acknowledgement arrives, after the tokens may have."""
    deadline = time.monotonic() + timeout
    while True:
        sent = _info(sender)["metrics"]["kv_transfer_bytes"]
        received = _info(receiver)["metrics"]["kv_transfer_bytes"]
        if sent == received or time.monotonic() > deadline:
            return sent, received
        time.sleep(0.1)


def test_object_store_kv_matches_offline_1p1d(cli_deployment, offline_reference) -> None:
    assert _tokens(cli_deployment["router_address"]) == offline_reference
    decode = _info("cli-decode-0")
    assert decode["ray_receiver"]["blocks_received"] > 0
    sent, received = _kv_bytes_settled("cli-prefill-0", "cli-decode-0")
    assert sent == received == decode["ray_receiver"]["bytes_received"] > 0


def test_killed_decode_actor_is_restarted_and_followed(cli_deployment, offline_reference) -> None:
    """The only decode worker dies between requests: Ray restarts it on a new port, the router
    finds it there (through its actor name) and holds the next requests until it is back."""
    before = _kill_and_wait_dead("cli-decode-0")
    t0 = time.monotonic()
    assert _tokens(cli_deployment["router_address"], timeout=90) == offline_reference
    served_s = time.monotonic() - t0
    after = _info("cli-decode-0")
    assert after["pid"] != before["pid"]
    assert after["ray_receiver"]["blocks_received"] > 0   # the restarted actor took the KV
    router = _info("cli-router")
    assert router["workers"][after["address"]] == "cli-decode-0"
    assert served_s < 60


def test_corrupted_block_through_the_object_store_is_refused(cli_deployment) -> None:
    """A block with the wrong chain hash, pushed through the object store by this driver: the decode
    actor refuses it, fails the request closed (Decode: DATA_LOSS), frees it, and keeps serving."""
    import grpc
    import torch

    from pdserve.engine.kv.block_manager import transfer_block_hashes
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from pdserve.services.kv_transfer import KVBlock, KVTransferError
    from pdserve.services.kv_transfer.ray_transport import RayKVSender

    decode = _info("cli-decode-0")
    prompt = random_prompts(1, 20, 20, seed=51)[0]

    async def run() -> None:
        async with Credentials(CLUSTER_TOKEN).channel(decode["address"]) as ch:
            info, stub = worker_pb2_grpc.WorkerStub(ch), worker_pb2_grpc.DecodeWorkerStub(ch)
            status = await info.GetStatus(worker_pb2.StatusRequest())
            shape = (status.num_layers, 2, status.block_size, status.num_kv_heads, status.head_dim)
            res = await stub.Reserve(worker_pb2.ReserveRequest(request_id="corrupt", prompt_token_ids=prompt,
                                                               params=common_pb2.SamplingParams(max_tokens=4)))
            assert list(res.needed_block_indices) == [0, 1, 2]
            hashes = transfer_block_hashes(prompt, status.block_size)
            stream = RayKVSender(cluster_token=CLUSTER_TOKEN).open(decode["kv_address"], "corrupt", res.transfer_token)
            await stream.send([KVBlock("corrupt", 0, hashes[0] ^ 1, torch.zeros(shape))])
            with pytest.raises(KVTransferError) as refused:
                await stream.finish(timeout=30)
            assert refused.value.code == "DATA_LOSS" and "chain hash" in str(refused.value)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Decode(worker_pb2.DecodeRequest(request_id="corrupt", first_token_id=5)):
                    pass
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            status = await info.GetStatus(worker_pb2.StatusRequest())
            assert status.num_reserved == 0 and status.num_free_blocks == status.num_total_blocks
    asyncio.run(run())
    assert _tokens(cli_deployment["router_address"])   # still serving


def test_nothing_listens_beyond_loopback(ray_cluster, cli_deployment) -> None:
    actors = {_info(n)["pid"] for n in ("cli-router", "cli-prefill-0", "cli-decode-0")}
    pids = group_pids(ray_cluster.pgid, include_zombies=True) | actors | {os.getpid()}
    listeners = _listening(pids)
    assert any(pid in actors for pid, _ in listeners)   # the check sees the actors' servers
    assert [(p, a) for p, a in listeners if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback] == []


def test_token_auth_is_required(ray_cluster) -> None:
    """The GCS refuses calls without the cluster's token (what ray.init would send)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    def get_cluster_id(token: str | None):
        with grpc.insecure_channel(ray_cluster.address) as ch:
            metadata = [("authorization", f"Bearer {token}")] if token is not None else None
            return gcs_service_pb2_grpc.NodeInfoGcsServiceStub(ch).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), metadata=metadata, timeout=10)

    for token in (None, "0" * 32):
        with pytest.raises(grpc.RpcError) as err:
            get_cluster_id(token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert get_cluster_id(os.environ["RAY_AUTH_TOKEN"]).cluster_id


def test_no_secret_is_in_any_actors_state(ray_cluster, cli_deployment) -> None:
    """What Ray's state API and dashboard show of every actor of the deployment (the GCS's actor
    table: runtime env, resources, names, all of it) carries neither the cluster token nor the API
    key: the actors read them from 0600 files on their node."""
    import grpc
    from google.protobuf.json_format import MessageToJson
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    from pdserve.services.ray_deploy.deploy import secret_path

    with grpc.insecure_channel(ray_cluster.address) as ch:
        reply = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(ch).GetAllActorInfo(
            gcs_service_pb2.GetAllActorInfoRequest(), metadata=[("authorization",
                                                                 f"Bearer {os.environ['RAY_AUTH_TOKEN']}")],
            timeout=30)
    actors = {a.name: a for a in reply.actor_table_data if a.name.startswith("cli-") and a.ray_namespace == NAMESPACE}
    assert sorted(actors) == ["cli-decode-0", "cli-prefill-0", "cli-router"]
    for name, actor in actors.items():
        shown = MessageToJson(actor) + actor.serialized_runtime_env
        assert CLUSTER_TOKEN not in shown and API_KEY not in shown, name
    for kind in ("cluster-token", "api-key"):
        assert secret_path("cli", NAMESPACE, kind).stat().st_mode & 0o777 == 0o600


def test_router_actor_enforces_the_api_key(cli_deployment) -> None:
    """The router actor got the deployment's API key: a call without it, or with another, is refused."""
    import grpc

    from pdserve.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(cli_deployment["router_address"]) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for metadata in (None, [("authorization", "Bearer " + "x" * 32)]):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetModelInfo(router_pb2.ModelInfoRequest(), metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(router_pb2.ModelInfoRequest(), metadata=[("authorization", f"Bearer {API_KEY}")],
                                 timeout=10).model_name


def test_stop_without_the_cluster_token_is_refused_and_the_actor_keeps_serving(cli_deployment,
                                                                              offline_reference) -> None:
    """Any job can call an actor's methods: stop() with no proof, a forged one, one made for
    another actor, or a replayed one is refused (PermissionError), and every actor still serves."""
    import ray

    from pdserve.services.ray_deploy.actors import control_proof

    creds = Credentials(CLUSTER_TOKEN)
    used = control_proof(creds, "cli-prefill-0", "info")   # a valid proof, for another method
    forged = control_proof(Credentials("y" * 32), "cli-prefill-0", "stop")
    for name in ("cli-prefill-0", "cli-decode-0", "cli-router"):
        for proof in ("", "v1.0.abcdefgh.xyz", used, forged, control_proof(creds, "cli-other", "stop"), 42):
            with pytest.raises(ray.exceptions.RayTaskError) as err:
                ray.get(_actor(name).stop.remote(proof), timeout=30)
            assert isinstance(err.value.cause, PermissionError) and "cluster token" in str(err.value.cause)
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(_actor(name).stop.remote(), timeout=30)
    assert _tokens(cli_deployment["router_address"]) == offline_reference
    assert ray.get(_actor("cli-router").health.remote(), timeout=30) == "SERVING"


def test_cli_scale_adds_and_removes_a_decode_worker_under_load(ray_cluster, cli_deployment, tiny_qwen3) -> None:
    """`pdserve ray scale` changes the running deployment through its router's membership API: a
    new decode actor joins and takes requests, then is drained, removed and stopped; under a
    steady load no request is lost and every one has the offline engine's tokens."""
    from pdserve.services.ray_deploy.deploy import list_actors

    def scale(decode: int) -> subprocess.CompletedProcess:
        res = _cli("ray", "scale", "--address", ray_cluster.address, "--namespace", NAMESPACE, "--name", "cli",
                   "--decode-workers", str(decode))
        assert res.returncode == 0, res.stderr[-4000:]
        return res

    with SteadyLoad(cli_deployment["router_address"], seed=11) as load:
        load.served(3)
        assert "added: cli-decode-1" in scale(2).stdout
        assert "cli-decode-1" in list_actors("cli", NAMESPACE)
        deadline = time.monotonic() + 60
        while _info("cli-decode-1")["metrics"]["generation_tokens"] == 0:   # it decodes requests now
            assert time.monotonic() < deadline, "the added decode worker took no request"
            time.sleep(0.2)
        assert "cli-decode-1" in _info("cli-router")["workers"].values()   # followed across restarts by name
        assert "removed: cli-decode-1" in scale(1).stdout
        load.served(3)
    load.check(LLM(tiny_qwen3, **ENGINE))
    assert list_actors("cli", NAMESPACE) == ["cli-decode-0", "cli-prefill-0", "cli-router"]


def test_cli_down_removes_the_deployment(ray_cluster, cli_deployment) -> None:
    from pdserve.services.ray_deploy.deploy import list_actors
    res = _cli("ray", "down", "--address", ray_cluster.address, "--namespace", NAMESPACE, "--name", "cli")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "cli-router" in res.stdout and "placement group cli-workers" in res.stdout
    assert list_actors("cli", NAMESPACE) == []
    from pdserve.services.ray_deploy.deploy import secret_path
    assert not secret_path("cli", NAMESPACE, "cluster-token").exists()   # the secrets it wrote went too


# ---- gRPC KV, model shipped in the runtime env (CLI), restart after the CLI has exited -----------
def test_grpc_kv_with_shipped_model_matches_offline_1p1d(ray_cluster, tiny_qwen3, offline_reference) -> None:
    """--kv-transport grpc --ship-model: the actors read the model from the working_dir that Ray
    unpacked on their node, also after a restart that happens once `pdserve ray up` has exited."""
    res = _cli("ray", "up", "--address", ray_cluster.address, "--namespace", NAMESPACE, "--name", "ship",
               "--model", tiny_qwen3, "--ship-model", "--kv-transport", "grpc", "--port", str(free_port()),
               "--worker-cpus", "0.5", "--router-cpus", "0.5", "--timeout", "180", "--json", *ENGINE_FLAGS)
    assert res.returncode == 0, res.stderr[-4000:]
    try:
        router = json.loads(res.stdout.strip().splitlines()[-1])["router_address"]
        assert _tokens(router) == offline_reference
        decode, prefill = _info("ship-decode-0"), _info("ship-prefill-0")
        assert decode["kv_address"] == decode["address"]            # KVTransfer on the worker's gRPC port
        assert decode["ray_receiver"]["blocks_received"] == 0
        sent, received = _kv_bytes_settled("ship-prefill-0", "ship-decode-0")
        assert sent == received > 0
        for w in (decode, prefill, _info("ship-router")):           # read from the shipped copy
            assert w["model"] != tiny_qwen3 and Path(w["model"], "config.json").exists()
        before = _kill_and_wait_dead("ship-decode-0")
        assert _tokens(router, timeout=90) == offline_reference
        after = _info("ship-decode-0")
        assert after["pid"] != before["pid"] and Path(after["model"], "config.json").exists()
        _stop_with_proof("ship-prefill-0")
    finally:
        _teardown("ship")


def _stop_with_proof(name: str) -> None:
    """stop() with the cluster token's proof: the actor drains and exits for good (not restarted,
    not left alive serving nothing)."""
    import ray

    from pdserve.services.ray_deploy.actors import control_proof

    pid = _info(name)["pid"]
    try:
        ray.get(_actor(name).stop.remote(control_proof(Credentials(CLUSTER_TOKEN), name, "stop")), timeout=60)
    except ray.exceptions.RayActorError:   # the call may see its actor exit
        pass
    deadline = time.monotonic() + 30
    while not _gone(pid):
        assert time.monotonic() < deadline, f"{name} did not exit after an authorized stop()"
        time.sleep(0.1)
    time.sleep(2)   # a restart would have begun by now
    with pytest.raises(ValueError):   # gone for good: its name is released
        _actor(name)


# ---- deployments that cannot work fail with a reason, and leave nothing behind --------------
def test_deployment_too_big_for_the_head_fails_fast(ray_cluster, tiny_qwen3) -> None:
    from pdserve.services.ray_deploy import DeploymentError
    from pdserve.services.ray_deploy.deploy import list_actors

    t0 = time.monotonic()
    with pytest.raises(DeploymentError, match="worker-host node-ip"):
        _deploy(tiny_qwen3, "big", prefill_workers=8, decode_workers=8)
    assert time.monotonic() - t0 < 10 and list_actors("big", NAMESPACE) == []


def test_worker_that_cannot_start_fails_the_deployment(ray_cluster, tmp_path) -> None:
    from pdserve.services.ray_deploy import DeploymentError
    from pdserve.services.ray_deploy.deploy import list_actors

    with pytest.raises(DeploymentError, match="workers failed to start"):
        _deploy(str(tmp_path / "no-such-model"), "broken")
    assert list_actors("broken", NAMESPACE) == []


def test_a_deployment_not_ready_by_its_deadline_names_the_late_actors_and_is_removed(ray_cluster, tiny_qwen3) -> None:
    from pdserve.services.ray_deploy import DeploymentError, RayDeployment, deploy
    from pdserve.services.ray_deploy.deploy import list_actors

    spec = RayDeployment(model=tiny_qwen3, name="late", namespace=NAMESPACE, port=free_port(), engine=dict(ENGINE),
                         router_args=pinned_disaggregation(()), **{**SMALL, "ready_timeout_s": 0.2})
    with pytest.raises(DeploymentError, match=r"workers not ready in time \(--timeout\): late-prefill-0, "
                                              r"late-decode-0 still starting"):
        deploy(spec)
    assert list_actors("late", NAMESPACE) == []


# ---- 2 prefill + 2 decode through the Python API ---------------------------------------------
def test_2p2d_matches_offline_and_survives_a_decode_kill(ray_cluster, tiny_qwen3, offline_reference) -> None:
    """KV through the object store (over gRPC, with a decode actor killed and followed after its
    restart: test_grpc_kv_with_shipped_model_matches_offline_1p1d)."""
    import ray

    name = "two-ray"
    info = _deploy(tiny_qwen3, name, prefill_workers=2, decode_workers=2, kv_transport="ray")
    prefills, decodes = [f"{name}-prefill-{i}" for i in range(2)], [f"{name}-decode-{i}" for i in range(2)]
    try:
        table = ray.util.placement_group_table(ray.util.get_placement_group(f"{name}-workers"))
        assert table["strategy"] == "SPREAD" and len(table["bundles"]) == 5   # the router's and 4 workers'
        assert _tokens(info.router_address) == offline_reference
        for n in prefills:   # both prefill workers took part
            assert _info(n)["metrics"]["generation_tokens"] > 0, n
        # The busier decode worker dies between requests: the router routes around it at once ...
        busy, other = sorted(decodes, key=lambda n: -_info(n)["metrics"]["generation_tokens"])
        before = _kill_and_wait_dead(busy)
        assert before["metrics"]["generation_tokens"] > 0
        assert _tokens(info.router_address, timeout=60) == offline_reference
        survivor = _info(other)
        assert survivor["metrics"]["generation_tokens"] > 0   # so both decode workers served
        assert survivor["ray_receiver"]["blocks_received"] > 0
        # ... and Ray brings it back, where the router finds it again.
        deadline = time.monotonic() + 60
        while _info(busy)["address"] not in _info(f"{name}-router")["workers"]:
            assert time.monotonic() < deadline, "the router did not follow the restarted actor"
            time.sleep(0.2)
    finally:
        _teardown(name)


# ---- tensor parallelism: any prefill layout feeds any decode layout through the object store ------
def _gone(pid: int) -> bool:
    """No such process, or only its zombie (a process reaped while /proc/PID/stat was read counts as gone)."""
    return not is_alive(pid)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_tp_layouts_through_the_object_store_match_offline(ray_cluster, tiny_qwen3, offline_reference,
                                                           prefill_tp, decode_tp) -> None:
    """1P(TP=2) -> 1D(TP=1) and 1P(TP=1) -> 1D(TP=2), KV through the object store, give the
    offline engine's tokens. Each worker's bundle holds the CPUs of all its ranks (0.5 per rank);
    the TP=2 worker's actor starts its rank process itself. Then that rank is killed: the worker
    fails, its actor exits, Ray restarts it (with a new rank), and the next requests are exact."""
    import ray

    name = f"tp{prefill_tp}{decode_tp}"
    prompts, want = PROMPTS[:2], offline_reference[:2]
    info = _deploy(tiny_qwen3, name, prefill_tp=prefill_tp, decode_tp=decode_tp)
    ranks: list[int] = []
    try:
        table = ray.util.placement_group_table(ray.util.get_placement_group(f"{name}-workers"))
        # bundle 0 is the router's, then the prefill worker's and the decode worker's
        assert [b["CPU"] for _, b in sorted(table["bundles"].items())] == [0.5, 0.5 * prefill_tp, 0.5 * decode_tp]
        tps = {"prefill": prefill_tp, "decode": decode_tp}
        for role, tp in tps.items():
            worker = _info(f"{name}-{role}-0")
            assert worker["tensor_parallel_size"] == tp and len(worker["rank_pids"]) == tp - 1
            ranks += worker["rank_pids"]
        assert _tokens(info.router_address, prompts=prompts) == want
        assert _info(f"{name}-decode-0")["ray_receiver"]["blocks_received"] > 0

        parallel = f"{name}-{'prefill' if prefill_tp == 2 else 'decode'}-0"
        before = _info(parallel)
        os.kill(before["rank_pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not _gone(before["pid"]):   # the worker noticed (while idle), drained and exited
            assert time.monotonic() < deadline, f"{parallel} did not exit after its rank died"
            time.sleep(0.1)
        assert _tokens(info.router_address, timeout=90, prompts=prompts) == want
        after = _info(parallel)
        assert after["pid"] != before["pid"] and len(after["rank_pids"]) == 1
        ranks += after["rank_pids"]
    finally:
        _teardown(name)
    deadline = time.monotonic() + 10   # ranks die with their actor
    while not all(_gone(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in ranks)


# ---- a hung engine (tests/faults/test_engine_stall.py under `pdserve up`): the actor's process exits,
# Ray restarts it, the router follows it ----------------------------------------------------------
def _actor_info(name: str, timeout: float = 5.0) -> dict | None:
    """The actor's info(), or None while it does not answer (hung, dead, restarting)."""
    import ray

    try:
        return ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=timeout)
    except Exception:  # noqa: BLE001 - any of Ray's unavailable / timeout / died errors: not now
        return None


def _status(address: str) -> worker_pb2.WorkerStatus | None:
    if not address:
        return None
    try:
        with Credentials(CLUSTER_TOKEN).sync_channel(address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=5)
    except grpc.RpcError:
        return None


def test_a_ray_decode_actor_whose_engine_hangs_is_restarted_and_loses_no_request(ray_cluster, ray_hang_dir: Path,
                                                                                  tiny_qwen3, reference) -> None:
    hang_dir = ray_hang_dir
    name = "stall"
    info = _deploy(tiny_qwen3, name, prefill_workers=1, decode_workers=2, kv_transport="grpc",
                   worker_args=STALL_WORKER, router_args=STALL_ROUTER)
    decodes = [f"{name}-decode-{i}" for i in range(2)]
    workers = [f"{name}-prefill-0", *decodes]
    try:
        before = {n: _actor_info(n, 60) for n in decodes}
        running = [observe(info.router_address, p, MAX_TOKENS, timeout=180) for p in STALL_PROMPTS[:RUNNING]]
        # A decode actor running sequences, caught frozen (tests.serving.catch_holder): asked while it
        # runs, the tiny model's streams could end between its answer and the hook.
        victim = None
        while victim is None and not all(o.done.is_set() for o in running):
            victim = catch_holder(decodes, lambda n: (_status(before[n]["address"]) or
                                                      worker_pb2.WorkerStatus()).num_running > 0,
                                  lambda n: before[n]["pid"], keep_frozen=True)
        assert victim is not None, "every stream ended before a decode actor was caught running one"
        old_pid = before[victim]["pid"]
        (hang_dir / f"engine-hang-{old_pid}").write_text("")   # its engine thread hangs before its next step
        os.kill(old_pid, signal.SIGCONT)
        t_hang = time.monotonic()
        arriving = [observe(info.router_address, p, MAX_TOKENS, timeout=180) for p in STALL_PROMPTS[RUNNING:]]
        wait_for(lambda: (_actor_info(victim) or {"pid": old_pid})["pid"] != old_pid, RAY_REPLACED_WITHIN_S,
                 f"{victim} restarted within {RAY_REPLACED_WITHIN_S:g}s of its engine hanging", interval=0.2)
        replaced_after = time.monotonic() - t_hang
        for obs in running + arriving:
            assert obs.done.wait(180), "a request hung through the stall"
        failed = [(o.code, o.details) for o in running + arriving if o.code is not None]
        assert not failed, f"{len(failed)} of {len(running + arriving)} requests failed: {failed[:3]}"
        assert [o.tokens for o in running + arriving] == reference
        assert any(o.migrations for o in running + arriving), "no stream was on the hung worker"
        assert replaced_after >= ENGINE_STALL_S
        record("engine thread hung (Ray)", replaced_after_s=round(replaced_after, 2),
               migrated=sum(1 for o in running + arriving if o.migrations))

        def at_baseline() -> bool:
            statuses = [_status((_actor_info(n) or {}).get("address", "")) for n in workers]
            return all(s is not None and s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0
                       for s in statuses)
        wait_for(at_baseline, 60, "free blocks back at baseline on every worker", interval=0.5)
    finally:
        _teardown(name)
