"""Benchmark scripts' main paths at a tiny size, so that an API change cannot leave them broken."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.services.common.process_table import group_running

REPO_ROOT = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="checks processes through /proc")
def test_kv_transport_ray_vs_grpc_runs_and_stops_its_cluster(tiny_qwen3: str) -> None:
    """Both transports (and gRPC through shared memory) into a real decode engine on a throwaway
    local Ray cluster: every push acknowledged and READY, the pool back at its baseline, and
    nothing of the cluster left running."""
    proc = subprocess.run(
        [sys.executable, "bench/kv_transport_ray_vs_grpc.py", "--model", tiny_qwen3, "--tokens", "20,40",
         "--iters", "2", "--warmup", "1", "--transports", "ray,grpc,grpc-shm", "--object-store-mb", "100", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["tokens"] for r in out["rows"]] == [20, 40]
    block_bytes = out["decode"]["block_bytes"]
    for row, blocks in zip(out["rows"], (2, 3)):
        assert row["blocks"] == blocks and row["kv_mib"] * (1 << 20) == blocks * block_bytes
        for t in ("ray", "grpc", "grpc-shm"):
            assert row[t]["median_ms"] > 0 and row[t]["mib_per_s"] > 0
        assert row["ray_over_grpc"] == pytest.approx(row["ray"]["mib_per_s"] / row["grpc"]["mib_per_s"])
    for pool in out["pools"]:
        assert pool["free_before"] == pool["free_after"] == pool["total"] and pool["reserved_after"] == 0, pool
    assert out["decode"]["grpc_address"].startswith("127.0.0.1:") and out["ray_address"].startswith("127.0.0.1:")
    assert out["ray_processes_left"] == []
    assert not group_running(out["ray_pgid"])
    assert len(out["actor_pids"]) == 2 and not any(_running(p) for p in out["actor_pids"])


DRIVERS = sorted(p.name for p in (REPO_ROOT / "bench").glob("*.py")
                 if p.name != "__init__.py" and p.name != "drivers.py" and not p.name.startswith("vs_vllm_"))


@pytest.mark.parametrize("script", DRIVERS)
def test_every_bench_driver_parses_its_flags_from_a_checkout(script: str) -> None:
    """`python bench/X.py --help` from the checkout: the driver finds what it imports (services/loadtest,
    bench's shared modules) without bench being installed."""
    proc = subprocess.run([sys.executable, f"bench/{script}", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout
