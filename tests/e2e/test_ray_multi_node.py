"""pdserve on a real multi-node Ray cluster: a head and two worker nodes, each in its own network
namespace (services/deployment/netns.py), joined by `ray start --head` / `ray start --address`.

Everything that talks to the cluster runs inside the head's namespace (the test process's own
cannot reach the hosts, by design): `pdserve ray up|scale|down` and the clients. Workers bind
their node's address (`--worker-host node-ip`), STRICT_SPREAD puts the prefill and the decode
worker on different nodes, and KV crosses nodes through the object store or over gRPC. The
token-authenticated cluster carries the whole story (scale under load, a node lost); a plain
cluster (no Ray authentication) serves exact tokens too. Skipped where namespaces cannot be made
or Ray is not installed, with the reason."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.deployment import netns
from pdserve.services.common.security import CLUSTER_TOKEN_ENV, new_token

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
              pytest.mark.skipif(not netns.available()[0], reason=f"no network namespaces: {netns.available()[1]}")]

REPO_ROOT = str(Path(__file__).resolve().parents[2])
RAY_PORT = 6379
NAMESPACE = "pdserve-mn"
ENGINE_FLAGS = ["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32"]
ENGINE = {"block_size": 8, "num_kv_blocks": 512, "dtype": "float32"}
MAX_NEW = 10


class RayHosts:
    """A Ray cluster over namespace hosts: the head on host 0, a worker node on each other host."""

    def __init__(self, net: netns.HostNetwork, workdir: Path, token: str | None) -> None:
        self.net, self.workdir = net, workdir
        # Ray's unix sockets live under its temp dir, whose paths must stay under 108 bytes
        self.ray_tmp = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
        self.head = net[0]
        self.address = f"{self.head.address}:{RAY_PORT}"
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH"))
                                                                 if p),
                    CLUSTER_TOKEN_ENV: new_token(), "PDSERVE_HOME": str(workdir / "home"), "OMP_NUM_THREADS": "1"}
        self.env.pop("RAY_ADDRESS", None)
        if token is not None:
            self.env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        else:
            for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
                self.env.pop(name, None)

    def start(self) -> None:
        ray = [sys.executable, "-m", "ray.scripts.scripts"]
        common = ["--num-cpus", "2", "--disable-usage-stats", "--object-store-memory", str(100 << 20)]
        for i, host in enumerate(self.net):
            where = (["--head", "--port", str(RAY_PORT), "--include-dashboard=false",
                      "--temp-dir", self.ray_tmp] if i == 0 else ["--address", self.address])
            done = host.run([*ray, "start", *where, "--node-ip-address", host.address, *common], timeout=120,
                            env=self.env, capture_output=True, text=True)
            assert done.returncode == 0, f"ray start on {host.address}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

    def close(self) -> None:
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def pdserve(self, *args: str, timeout: float = 300, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
        """`pdserve ARGS` in the head's namespace, as a user's shell runs it: the cluster's token in
        RAY_AUTH_TOKEN is all it needs (no RAY_AUTH_MODE, which only `ray start` reads)."""
        env = env if env is not None else {k: v for k, v in self.env.items() if k != "RAY_AUTH_MODE"}
        return self.head.run([sys.executable, "-m", "pdserve.services.cli", *args], timeout=timeout, env=env,
                             capture_output=True, text=True, cwd=REPO_ROOT)

    def up(self, name: str, model: str, *extra: str) -> dict:
        done = self.pdserve("ray", "up", "--address", self.address, "--namespace", NAMESPACE, "--name", name,
                            "--model", model, "--worker-host", "node-ip", "--placement-strategy", "STRICT_SPREAD",
                            "--worker-cpus", "1", "--router-cpus", "0.5", "--timeout", "240", "--json",
                            *ENGINE_FLAGS, *extra)
        assert done.returncode == 0, done.stderr[-4000:]
        self.last_stderr = done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def generate(self, router: str, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy tokens of each prompt through the router, from a client in the head's namespace."""
        script = ("import asyncio, json, sys\nfrom pdserve.services.client import AsyncClient\n"
                  "async def main(router, prompts):\n"
                  "    async with AsyncClient(router, timeout=120) as c:\n"
                  f"        outs = await asyncio.gather(*(c.generate(p, max_tokens={MAX_NEW}, temperature=0.0,"
                  " ignore_eos=True) for p in prompts))\n"
                  "    print(json.dumps([o.token_ids for o in outs]))\n"
                  "asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))\n")
        done = self.head.run([sys.executable, "-c", script, router, json.dumps(prompts)], timeout=180, env=self.env,
                             capture_output=True, text=True, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr[-4000:]
        self.last_stderr = done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def node_of(self, worker: dict) -> int:
        return next(i for i, h in enumerate(self.net) if h.address == worker["node_ip"])

    def kill_node(self, i: int) -> None:
        """The node dies: every process in its namespace, at once (SIGKILL)."""
        for pid in netns.namespace_pids(self.net[i].name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class NamespaceLoad:
    """tests/e2e/ns_load.py in the head's namespace: fresh greedy prompts until stopped."""

    def __init__(self, hosts: RayHosts, router: str, seed: int) -> None:
        self.hosts = hosts
        self.out = hosts.workdir / f"load-{seed}.json"
        self.stop_file = hosts.workdir / f"load-{seed}.stop"
        self.proc = hosts.head.popen([sys.executable, "-m", "tests.e2e.ns_load", router, str(self.out),
                                      str(self.stop_file), "--seed", str(seed)], env=hosts.env, cwd=REPO_ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def count(self) -> int:
        try:
            return int(Path(f"{self.out}.count").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def served(self, n: int, timeout: float = 120.0) -> None:
        target, deadline = self.count() + n, time.monotonic() + timeout
        while self.count() < target:
            assert self.proc.poll() is None, f"the load exited: {self.proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, f"the load stalled at {self.count()} requests"
            time.sleep(0.1)

    def finish(self) -> dict:
        self.stop_file.touch()
        _, err = self.proc.communicate(timeout=180)
        assert self.proc.returncode == 0, err[-4000:]
        return json.loads(self.out.read_text())


def check_exact(result: dict, model: str) -> None:
    """No request failed, and each one's tokens are the offline engine's."""
    assert not result["failures"], result["failures"]
    outputs = result["outputs"]
    assert outputs
    expected = LLM(model, **ENGINE).generate([p for p, _ in outputs], SamplingParams(**result["params"]))
    wrong = sum(toks != e.token_ids for (_, toks), e in zip(outputs, expected))
    assert not wrong, f"{wrong} of {len(outputs)} requests differ from the offline engine's tokens"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """A token-authenticated 3-node Ray cluster: the head and two worker nodes, one namespace each."""
    workdir = tmp_path_factory.mktemp("ray-hosts")
    with netns.HostNetwork(3) as net:
        cluster = RayHosts(net, workdir, token=secrets.token_hex(16))
        try:
            cluster.start()
            yield cluster
        finally:
            net.close()   # every Ray process of the hosts first, then their files
            cluster.close()


PROMPTS = [[(7 * i + 3 * j) % 1000 + 1 for j in range(12 + 5 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def reference(tiny_qwen3: str) -> list[list[int]]:
    outs = LLM(tiny_qwen3, **ENGINE).generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                       ignore_eos=True))
    return [o.token_ids for o in outs]


def test_prefill_and_decode_on_different_nodes_kv_through_the_object_store(hosts, tiny_qwen3, reference) -> None:
    info = hosts.up("obj", tiny_qwen3, "--kv-transport", "ray")
    workers = {w["role"]: w for w in info["workers"]}
    assert workers["prefill"]["node_ip"] != workers["decode"]["node_ip"]
    assert {workers["prefill"]["node_ip"], workers["decode"]["node_ip"]} <= {h.address for h in hosts.net}
    assert workers["decode"]["kv_address"].startswith("ray://")
    assert hosts.generate(info["router_address"], PROMPTS) == reference


def test_ray_scale_up_and_down_across_nodes_under_load(hosts, tiny_qwen3) -> None:
    """`ray scale` adds a decode worker (on whichever node has room) and removes it again while a
    load runs: no request lost, every one exact."""
    info = hosts.pdserve("ray", "status", "--address", hosts.address, "--namespace", NAMESPACE, "--name", "obj")
    assert info.returncode == 0, info.stderr[-2000:]
    router = next(line.split(" router at ")[1].split()[0] for line in info.stdout.splitlines() if " router at " in line)
    load = NamespaceLoad(hosts, router, seed=21)
    try:
        load.served(3)
        scale = ["ray", "scale", "--address", hosts.address, "--namespace", NAMESPACE, "--name", "obj",
                 "--insecure-internal-plane"]   # workers bind node-ip without TLS here
        up = hosts.pdserve(*scale, "--decode-workers", "2")
        assert up.returncode == 0 and "added: obj-decode-1" in up.stdout, up.stderr[-3000:]
        load.served(6)
        down = hosts.pdserve(*scale, "--decode-workers", "1")
        assert down.returncode == 0 and "removed: obj-decode-1" in down.stdout, down.stderr[-3000:]
        load.served(3)
    finally:
        result = load.finish()
    check_exact(result, tiny_qwen3)
    gone = hosts.pdserve("ray", "down", "--address", hosts.address, "--namespace", NAMESPACE, "--name", "obj")
    assert gone.returncode == 0, gone.stderr[-2000:]


def test_kv_over_grpc_across_nodes_and_a_lost_node(hosts, tiny_qwen3, reference) -> None:
    """KV over gRPC between nodes; then a worker node dies under load (the one of the decode worker,
    or of the prefill worker when the decode worker shares the head with the router): Ray restarts
    its actor on a node left, the router follows it, the requests on it migrate: none lost."""
    info = hosts.up("grpc", tiny_qwen3, "--kv-transport", "grpc")
    workers = {w["role"]: w for w in info["workers"]}
    assert workers["prefill"]["node_ip"] != workers["decode"]["node_ip"]
    assert not workers["decode"]["kv_address"].startswith("ray://")
    assert hosts.generate(info["router_address"], PROMPTS) == reference
    lost = next(hosts.node_of(w) for w in (workers["decode"], workers["prefill"]) if hosts.node_of(w) != 0)
    load = NamespaceLoad(hosts, info["router_address"], seed=22)
    try:
        load.served(3)
        hosts.kill_node(lost)
        load.served(6, timeout=180)
    finally:
        result = load.finish()
    check_exact(result, tiny_qwen3)
    status = hosts.pdserve("ray", "status", "--address", hosts.address, "--namespace", NAMESPACE, "--name", "grpc")
    assert status.returncode == 0, status.stderr[-2000:]
    assert hosts.net[lost].address not in status.stdout.split("router at")[1], status.stdout


def test_ray_up_without_the_clusters_token_says_what_to_set(hosts, tiny_qwen3) -> None:
    env = {k: v for k, v in hosts.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    res = hosts.pdserve("ray", "up", "--address", hosts.address, "--namespace", NAMESPACE, "--name", "no-token",
                        "--model", tiny_qwen3, timeout=120, env=env)
    assert res.returncode == 1, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"pdserve: error: the Ray cluster at {hosts.address} requires token authentication, but no token is "
        f"configured here: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token (`ray get-auth-token` "
        f"on one of its nodes prints it)")


def test_a_plain_cluster_without_ray_authentication_serves_exact_tokens(tiny_qwen3, reference, tmp_path) -> None:
    """`ray start` without authentication: `pdserve ray up` works, with a warning; run again as the
    KubeRay submitter runs it (--if-exists keep), it keeps the SERVING deployment."""
    with netns.HostNetwork(2) as net:
        cluster = RayHosts(net, tmp_path, token=None)
        try:
            cluster.start()
            info = cluster.up("plain", tiny_qwen3, "--kv-transport", "ray")
            assert f"pdserve: warning: the Ray cluster at {cluster.address} has no authentication" in \
                cluster.last_stderr, cluster.last_stderr[-2000:]
            assert cluster.generate(info["router_address"], PROMPTS) == reference
            again = cluster.pdserve("ray", "up", "--address", cluster.address, "--namespace", NAMESPACE, "--name",
                                    "plain", "--model", tiny_qwen3, "--if-exists", "keep", timeout=120)
            assert again.returncode == 0 and "deployment 'plain' is already up" in again.stderr, again.stderr[-2000:]
        finally:
            net.close()
            cluster.close()
