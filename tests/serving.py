"""Helpers for end-to-end tests against real processes."""
from __future__ import annotations

import urllib.request

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.launcher import Cluster, Deployment, free_port


def start_cluster(model: str, **kwargs) -> Cluster:
    engine_args = kwargs.pop("engine_args", ["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32"])
    spec = Deployment(model=model, port=free_port(), engine_args=engine_args, metrics=True, **kwargs)
    cluster = Cluster(spec)
    cluster.start(timeout=120)
    return cluster


def worker_status(address: str) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)


def workers(cluster: Cluster, role: str | None = None) -> list[str]:
    return [p.address for p in cluster.processes if p.name != "router" and (role is None or p.name.startswith(role))]


def scrape(metrics_address: str) -> dict[str, float]:
    """Prometheus text format -> {series (name + labels): value}."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def metric(samples: dict[str, float], name: str) -> float:
    """Sum of every series of one metric name, whatever its labels."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)
