"""Discovery from a watched file (`pdserve router --workers-file`, services/router/workers_file.py),
over real processes: a router with 1 prefill + 1 decode worker named by flag and a workers file;
workers started without --router become members when a line names them, switch role when the line
changes, and drain and leave when it is removed, under a steady load that loses nothing and whose
tokens stay exact (greedy, batch-invariant)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.v1 import membership_pb2 as m
from pdserve.v1 import worker_pb2
from pdserve.services.router.workers_file import parse_workers
from pdserve.services.common.security import Credentials, new_token
from tests.e2e.test_membership import members, wait_member
from tests.serving import SteadyLoad, start_cluster, worker_status


@pytest.fixture(scope="module")
def workers_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("discovery") / "workers.txt"
    path.write_text("# workers beyond the ones named at start\n")
    return path


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str, workers_file: Path, tmp_path_factory):
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, drain_timeout_s=5,
                            log_dir=str(tmp_path_factory.mktemp("logs")),
                            router_args=["--workers-file", str(workers_file)])
    yield cluster
    cluster.stop()


def _write(path: Path, text: str) -> None:
    """Replace the file at once (a reader never sees half of it), as a config tool would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _router_log(cluster) -> str:
    router = next(p for p in cluster.processes if p.name == "router")
    return Path(router.log_path).read_text(errors="replace")


def test_the_file_format_and_its_errors() -> None:
    assert parse_workers("# c\n\nprefill 127.0.0.1:1  # first\nDECODE 127.0.0.1:2\ncolocated [::1]:3\n") == {
        "127.0.0.1:1": "prefill", "127.0.0.1:2": "decode", "[::1]:3": "both"}
    for text, needle in (("prefill\n", "line 1"), ("decode 127.0.0.1:1\nleader 127.0.0.1:2\n", "line 2"),
                         ("decode 127.0.0.1:1\nprefill 127.0.0.1:1\n", "listed twice"),
                         ("".join(f"decode 127.0.0.1:{i}\n" for i in range(1, 1030)), "more than 1024")):
        with pytest.raises(ValueError, match=needle):
            parse_workers(text)


def test_a_line_adds_a_worker_a_changed_role_switches_it_a_removed_line_drains_it(cluster, workers_file,
                                                                                 served_reference) -> None:
    proc = cluster.add_worker("decode", "decode-listed")   # no --router: it joins only through the file
    assert proc.address not in members(cluster)
    with SteadyLoad(cluster.router_address, seed=3) as load:
        load.served(4)
        _write(workers_file, f"# discovery\ndecode {proc.address}\n")
        entry = wait_member(cluster, proc.address, lambda e: e is not None and e.placed_total > 0, timeout=30)
        assert entry.role == worker_pb2.WORKER_ROLE_DECODE and not entry.joined
        load.served(4)
        _write(workers_file, f"# discovery\nprefill {proc.address}\n")
        wait_member(cluster, proc.address, lambda e: e is not None and e.role == worker_pb2.WORKER_ROLE_PREFILL
                    and e.state == m.MEMBER_STATE_SERVING, timeout=60)
        assert worker_status(cluster, proc.address).role == worker_pb2.WORKER_ROLE_PREFILL   # in its process
        load.served(4)
        _write(workers_file, "# discovery\n")
        wait_member(cluster, proc.address, lambda e: e is None, timeout=60)
        load.served(4)
    load.check(served_reference)   # every request finished, with the offline engine's tokens
    status = worker_status(cluster, proc.address)
    assert status.num_free_blocks == status.num_total_blocks
    assert {p for p in members(cluster)} == {p.address for p in cluster.processes
                                             if p.name in ("prefill-0", "decode-0")}


def test_a_bad_file_changes_nothing_and_says_which_line(cluster, workers_file) -> None:
    before = set(members(cluster))
    _write(workers_file, "decode 127.0.0.1:9\nthis is not a worker\n")
    deadline = time.monotonic() + 20
    while "line 2" not in _router_log(cluster):
        assert time.monotonic() < deadline, _router_log(cluster)[-2000:]
        time.sleep(0.2)
    assert set(members(cluster)) == before   # not even the good first line
    _write(workers_file, "# discovery\n")


def test_a_router_refuses_to_start_on_a_file_naming_another_host_without_mutual_tls(tiny_qwen3, tmp_path) -> None:
    bad = tmp_path / "workers.txt"
    bad.write_text("decode 10.99.0.3:50062\n")
    env = {**os.environ, **Credentials(new_token()).child_env()}
    run = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "router", "--model", tiny_qwen3, "--port", "0",
                          "--workers-file", str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert "10.99.0.3:50062 is not a loopback address" in run.stderr, run.stderr[-2000:]
