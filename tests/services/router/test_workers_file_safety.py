"""The workers file (`pdserve router --workers-file`) under a hostile neighbour: a FIFO at the path
does not hang the router, a file others may write (or a link, another user's file, a huge one) is
refused with a log line saying why, and a router refuses to start on such a file."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.client import Client
from pdserve.services.common.security import Credentials, new_token
from pdserve.services.router.workers_file import MAX_FILE_BYTES, read_workers
from tests.e2e.test_membership import members
from tests.serving import start_cluster


def _replace(path: Path, make) -> None:
    """Put what make(tmp) creates at path in one rename, as a config tool (or an attacker) would."""
    tmp = path.with_name(path.name + ".new")
    make(tmp)
    os.replace(tmp, path)


def _file(text: str, mode: int):
    def make(tmp: Path) -> None:
        tmp.write_text(text)
        os.chmod(tmp, mode)
    return make


def test_read_workers_refuses_what_is_not_a_private_regular_file(tmp_path) -> None:
    ok = tmp_path / "ok.txt"
    ok.write_text("decode 127.0.0.1:7\n")
    os.chmod(ok, 0o644)
    assert read_workers(str(ok)) == {"127.0.0.1:7": "decode"}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="not a regular file"):
        read_workers(str(fifo))               # no writer: opening it must not wait for one
    assert time.monotonic() - t0 < 5
    loose = tmp_path / "loose.txt"
    loose.write_text("decode 127.0.0.1:7\n")
    for mode in (0o666, 0o664, 0o646):
        os.chmod(loose, mode)
        with pytest.raises(ValueError, match=f"writable by group or others \\(mode 0{mode:o}\\)"):
            read_workers(str(loose))
    link = tmp_path / "link.txt"
    link.symlink_to(ok)
    with pytest.raises(ValueError, match="symbolic link is refused"):
        read_workers(str(link))
    big = tmp_path / "big.txt"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(ValueError, match=f"larger than {MAX_FILE_BYTES} bytes"):
        read_workers(str(big))
    if os.getuid() == 0:   # only root can give a file away
        os.chown(ok, 4242, 4242)
        with pytest.raises(ValueError, match="owned by uid 4242"):
            read_workers(str(ok))


@pytest.fixture(scope="module")
def router_with_file(tiny_qwen3: str, tmp_path_factory):
    path = tmp_path_factory.mktemp("wf") / "workers.txt"
    path.write_text("# none yet\n")
    os.chmod(path, 0o600)
    cluster = start_cluster(tiny_qwen3, colocated_workers=1, log_dir=str(tmp_path_factory.mktemp("logs")),
                            router_args=["--workers-file", str(path)])
    yield cluster, path
    cluster.stop()


def _wait_log(cluster, needle: str, timeout: float = 30.0) -> None:
    router = next(p for p in cluster.processes if p.name == "router")
    deadline = time.monotonic() + timeout
    while needle not in Path(router.log_path).read_text(errors="replace"):
        assert time.monotonic() < deadline, Path(router.log_path).read_text(errors="replace")[-2000:]
        time.sleep(0.2)


def _serves(cluster) -> None:
    """The router answers a health check and a request, each within its deadline."""
    with grpc.insecure_channel(cluster.router_address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    with Client(cluster.router_address, timeout=60) as client:
        assert len(client.generate([5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True).token_ids) == 3


def test_a_fifo_at_the_path_does_not_hang_the_router(router_with_file) -> None:
    cluster, path = router_with_file
    _replace(path, os.mkfifo)
    _wait_log(cluster, "not a regular file")
    _serves(cluster)
    _replace(path, _file("# none yet\n", 0o600))


def test_a_file_others_may_write_is_refused_with_a_log_line(router_with_file) -> None:
    cluster, path = router_with_file
    before = set(members(cluster))
    _replace(path, _file("decode 127.0.0.1:9\n", 0o666))
    _wait_log(cluster, "writable by group or others (mode 0666): chmod go-w it")
    assert set(members(cluster)) == before
    _serves(cluster)
    _replace(path, _file("# none yet\n", 0o600))


def test_a_router_refuses_to_start_on_a_file_others_may_write(tiny_qwen3, tmp_path) -> None:
    loose = tmp_path / "workers.txt"
    loose.write_text("# nothing\n")
    os.chmod(loose, 0o666)
    env = {**os.environ, **Credentials(new_token()).child_env()}
    run = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "router", "--model", tiny_qwen3, "--port", "0",
                          "--workers-file", str(loose)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert f"workers file {loose}: writable by group or others (mode 0666)" in run.stderr, run.stderr[-2000:]
