"""Hosts for end-to-end tests: pdserve processes started through the public CLI, each in its own
emulated host (a network namespace, services/deployment/netns.py), with the cluster token in
their environment; a client driven inside the router's host (the test process's own namespace
cannot reach the hosts' addresses, by design)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.services.deployment import netns
from pdserve.services.common.security import CLUSTER_TOKEN_ENV, new_token
from tests.certs import make_ca_and_cert
from tests.serving import ALWAYS_DISAGGREGATE

MAX_NEW = 10
ENGINE = ["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32", "--num-threads", "1"]
WORKER_PORT, METRICS_PORT, ROUTER_PORT = 7100, 7200, 50051   # each host has its own port space
START_TIMEOUT_S = 120.0
INSECURE_FLAG = "--insecure-internal-plane"
NO_HOSTS = pytest.mark.skipif(not netns.available()[0], reason=f"no network namespaces: {netns.available()[1]}")


# ---- certificates for the hosts' addresses --------------------------------------------------------
def make_certs(out: Path, ips: list[str]) -> dict[str, Path]:
    """A throwaway CA and one certificate for every host address (SAN: the IPs), for mutual TLS."""
    paths = make_ca_and_cert(out, "pdserve-hosts", tuple(ips))
    return {name: paths[f"{name}.pem"] for name in ("ca", "cert", "key")}


# ---- a deployment over hosts ----------------------------------------------------------------------
@dataclass
class HostDeployment:
    """pdserve processes started on hosts through the CLI; the router's address and the workers'."""
    model: str
    net: netns.HostNetwork
    log_dir: Path
    security: dict[str, list[str]]           # per role: --tls-* flags, or the insecure flag, or nothing
    env: dict[str, str] = field(default_factory=lambda: {**os.environ, CLUSTER_TOKEN_ENV: new_token(),
                                                         "OMP_NUM_THREADS": "1"})
    workers: list[tuple[str, str]] = field(default_factory=list)    # (address, metrics address)
    router: str = ""
    client_host: netns.Host | None = None    # the router's host, where the client runs

    def _start(self, host: netns.Host, name: str, argv: list[str]) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            host.popen([sys.executable, "-m", "pdserve.services.cli", *argv, "--model", self.model, "--host", host.address,
                        *self.security[argv[0]]], env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def worker(self, host: netns.Host, role: str, *extra: str) -> str:
        port = WORKER_PORT + len(self.workers)
        mport = METRICS_PORT + len(self.workers)
        self._start(host, f"{role}-{len(self.workers)}", [role, "--port", str(port), "--metrics-port", str(mport),
                                                         "--worker-id", f"{role}-{len(self.workers)}", *ENGINE,
                                                         *extra])
        self.workers.append((f"{host.address}:{port}", f"{host.address}:{mport}"))
        return f"{host.address}:{port}"

    def start_router(self, host: netns.Host, prefill: list[str], decode: list[str]) -> None:
        self._start(host, "router", ["router", "--port", str(ROUTER_PORT), "--prefill", ",".join(prefill),
                                     "--decode", ",".join(decode), *ALWAYS_DISAGGREGATE])   # KV crosses hosts
        self.router = f"{host.address}:{ROUTER_PORT}"
        self.client_host = host

    def tls(self) -> dict[str, str] | None:
        flags = self.security["router"]
        if "--tls-ca" not in flags:
            return None
        return {k: flags[flags.index(f"--tls-{k}") + 1] for k in ("cert", "key", "ca")}

    def drive(self, prompts: list[list[int]], metrics: tuple[str, ...] = ()) -> dict:
        """Run the client inside the router's host: wait for every process, generate the prompts
        concurrently, wait for the workers' free blocks to return, read their metrics (the
        tokens each generated, and the series named in metrics, per worker in start order)."""
        spec = {"router": self.router, "workers": self.workers, "prompts": prompts, "max_tokens": MAX_NEW,
                "tls": self.tls(), "timeout": START_TIMEOUT_S, "metrics": list(metrics)}
        try:
            done = self.client_host.run([sys.executable, "-c", DRIVER, json.dumps(spec)], env=self.env,
                                        timeout=START_TIMEOUT_S + 60, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the client timed out; logs:\n{self.logs()}")
        if done.returncode != 0:
            pytest.fail(f"the client failed:\n{done.stderr[-3000:]}\nlogs:\n{self.logs()}")
        return json.loads(done.stdout.splitlines()[-1])

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-1500:] for p in self.log_dir.glob("*.log"))


DRIVER = r"""
import asyncio, json, os, sys, time, urllib.request
from pathlib import Path
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient
from pdserve.services.deployment.launcher import wait_serving
from pdserve.services.common.security import CLUSTER_TOKEN_ENV, Credentials, TLSFiles

spec = json.loads(sys.argv[1])
tls = TLSFiles(*(Path(spec["tls"][k]) for k in ("cert", "key", "ca"))) if spec["tls"] else None
creds = Credentials(os.environ[CLUSTER_TOKEN_ENV], tls)
for address, _ in spec["workers"]:
    wait_serving(address, None, spec["timeout"], creds)
wait_serving(spec["router"], None, spec["timeout"], creds)

async def generate():
    ca = tls.ca.read_bytes() if tls else None
    async with AsyncClient(spec["router"], timeout=60, root_certificates=ca) as client:
        return await asyncio.gather(*(client.generate(p, max_tokens=spec["max_tokens"], temperature=0.0,
                                                      ignore_eos=True) for p in spec["prompts"]))
outs = asyncio.run(generate())

def statuses():
    out = []
    for address, _ in spec["workers"]:
        with creds.sync_channel(address) as ch:
            s = worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)
        out.append([s.worker_id, s.num_free_blocks, s.num_total_blocks])
    return out
deadline = time.monotonic() + 10
blocks = statuses()
while not all(free == total for _, free, total in blocks) and time.monotonic() < deadline:
    time.sleep(0.05)
    blocks = statuses()

def scrape(metrics):   # each series' value, summed over its labels
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out = {}
    for l in text.splitlines():
        if l and not l.startswith("#"):
            name = l.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(l.rsplit(" ", 1)[1])
    return out
scraped = [scrape(m) for _, m in spec["workers"]]
print(json.dumps({"tokens": [list(o.token_ids) for o in outs], "blocks": blocks, "timings": [o.timings for o in outs],
                  "generated": [s.get("pdserve:generation_tokens_total", 0.0) for s in scraped],
                  "metrics": [{n: s.get(n, 0.0) for n in spec["metrics"]} for s in scraped]}))
"""
