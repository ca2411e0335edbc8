"""`pdserve up` as the supervisor a user runs: restarts, drains, and children that never outlive it,
whatever stops it and whenever."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.client import Client
from pdserve.services.common.process_table import is_alive
from pdserve.services.deployment.launcher import PARENT_PID_ENV, free_port
from tests.conftest import hf_greedy, random_prompts
from tests.faults.harness import observe, wait_for
from tests.serving import wait_up_line

pytestmark = pytest.mark.faults

PROMPT = random_prompts(1, 12, 12, seed=301)[0]
ENGINE = ["--dtype", "float32", "--block-size", "8", "--num-kv-blocks", "256"]


def _up(model: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--port", str(port), *ENGINE, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _children(pid: int) -> dict[int, str]:
    """pid -> role of each child of `pdserve up`."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        try:
            cmdline = open(f"/proc/{child}/cmdline").read().split("\0")
        except OSError:   # gone meanwhile (also while being read)
            continue
        role = cmdline[cmdline.index("--role") + 1] if "--role" in cmdline else "router"
        out[int(child)] = role
    return out


def _spawned_by(supervisor: int) -> list[int]:
    """Every live process `pdserve up` (pid supervisor) started, found by the parent pid it gave them."""
    marker = f"{PARENT_PID_ENV}={supervisor}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in open(f"/proc/{entry}/environ", "rb").read().split(b"\0") and is_alive(int(entry)):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _stop(up: subprocess.Popen, children: dict[int, str]) -> str:
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
    try:
        output = up.communicate(timeout=60)[0] or ""
    except (subprocess.TimeoutExpired, ValueError):   # ValueError: its output is being read elsewhere
        if up.poll() is None:
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        output = ""
    for pid in {*children, *_spawned_by(up.pid)}:   # never leave a child behind, even when a test failed
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)
    return output


def _health(address: str) -> int | None:
    """The router's health status, or None while nothing answers."""
    try:
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    except grpc.RpcError:
        return None


@pytest.fixture(scope="module")
def _shared_up(tiny_qwen3: str):
    """One `pdserve up` for the module's tests (each leaves it serving again: a child it killed is
    restarted by the supervisor); started anew only after a test took the supervisor down."""
    current: dict = {}

    def get() -> tuple[subprocess.Popen, str, list[str]]:
        if not current or current["proc"].poll() is not None:
            if current:
                _stop(current["proc"], _children(current["proc"].pid))
            port = free_port()
            proc = _up(tiny_qwen3, port, "--stall-timeout-s", "3")
            current.update(proc=proc, address=f"127.0.0.1:{port}", lines=wait_up_line(proc))
        return current["proc"], current["address"], current["lines"]

    yield get
    if current:
        _stop(current["proc"], _children(current["proc"].pid))


@pytest.fixture
def up(_shared_up):
    proc, address, lines = _shared_up()
    # what the previous test killed or drained is back: every role once, the router SERVING
    wait_for(lambda: sorted(_children(proc.pid).values()) == ["decode", "prefill", "router"]
             and _health(address) == health_pb2.HealthCheckResponse.SERVING, 120, "the deployment serving")
    children = _children(proc.pid)
    assert sorted(children.values()) == ["decode", "prefill", "router"]
    yield proc, address, children
    print("".join(lines[-80:]))   # the supervisor's log, shown when the test failed


def test_a_dead_worker_is_restarted_and_used_again_at_once(up, tiny_qwen3: str) -> None:
    proc, address, children = up
    decode = next(pid for pid, role in children.items() if role == "decode")
    os.kill(decode, signal.SIGKILL)
    wait_for(lambda: any(r == "decode" and p != decode for p, r in _children(proc.pid).items()), 30,
             "a new decode process")
    new = next(p for p, r in _children(proc.pid).items() if r == "decode")
    t0 = time.monotonic()
    wait_for(lambda: _health(address) == health_pb2.HealthCheckResponse.SERVING, 60, "the router SERVING again",
             interval=0.05)
    with Client(address, timeout=30) as client:
        out = client.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out.token_ids == hf_greedy(tiny_qwen3, [PROMPT], 6)[0]
    assert time.monotonic() - t0 < 30 and is_alive(new)


def test_router_health_follows_its_workers(up) -> None:
    proc, address, children = up
    prefill = next(pid for pid, role in children.items() if role == "prefill")
    os.kill(prefill, signal.SIGSTOP)   # a frozen prefill worker: the router has none left
    try:
        wait_for(lambda: _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, 15, "NOT_SERVING",
                 interval=0.1)
    finally:
        os.kill(prefill, signal.SIGCONT)
    wait_for(lambda: _health(address) == health_pb2.HealthCheckResponse.SERVING, 15, "SERVING", interval=0.1)


def test_a_killed_router_fails_its_streams_clearly_frees_the_workers_and_comes_back(up, tiny_qwen3: str) -> None:
    proc, address, children = up
    obs = observe(address, PROMPT, 1500)
    wait_for(lambda: len(obs.tokens) >= 5, 30, "tokens")
    router = next(pid for pid, role in children.items() if role == "router")
    os.kill(router, signal.SIGKILL)
    assert obs.done.wait(15)
    assert obs.code == "UNAVAILABLE"   # the client's connection was to the router: a clear, immediate error
    wait_for(lambda: _health(address) == health_pb2.HealthCheckResponse.SERVING, 60, "the restarted router",
             interval=0.1)
    with Client(address, timeout=30) as client:
        out = client.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out.token_ids == hf_greedy(tiny_qwen3, [PROMPT], 6)[0]


def test_sigterm_drains_a_decode_worker_without_losing_its_streams(up, tiny_qwen3: str) -> None:
    proc, address, children = up
    obs = observe(address, PROMPT, 300)
    wait_for(lambda: len(obs.tokens) >= 5, 30, "tokens")
    decode = next(pid for pid, role in children.items() if role == "decode")
    os.kill(decode, signal.SIGTERM)   # a rolling restart
    assert obs.done.wait(60)
    assert obs.code is None and obs.migrations == 0     # it finished where it ran
    assert obs.tokens == hf_greedy(tiny_qwen3, [PROMPT], 300)[0]
    wait_for(lambda: not is_alive(decode), 30, "the drained worker to exit")
    wait_for(lambda: _health(address) == health_pb2.HealthCheckResponse.SERVING, 60, "a new decode worker")


def test_sigterm_stops_the_router_after_its_streams_finish(tiny_qwen3: str) -> None:
    port = free_port()
    proc = _up(tiny_qwen3, port)
    address = f"127.0.0.1:{port}"
    wait_up_line(proc)
    children = _children(proc.pid)
    try:
        obs = observe(address, PROMPT, 200)
        wait_for(lambda: len(obs.tokens) >= 5, 30, "tokens")
        proc.send_signal(signal.SIGTERM)   # the whole deployment: router first, it drains
        assert obs.done.wait(60)
        assert obs.code is None and len(obs.tokens) == 200
    finally:
        _stop(proc, children)
    assert proc.returncode == 0
    assert not _spawned_by(proc.pid)


@pytest.mark.parametrize("phase", ["workers-loading", "router-starting"])
def test_sigterm_during_start_up_leaves_nothing_running(tiny_qwen3: str, phase: str) -> None:
    """SIGTERM while the first worker loads the model, or once the router (started after every worker
    serves: services/deployment/launcher.Cluster.start) is starting."""
    proc = _up(tiny_qwen3, free_port())
    seen: dict[int, str] = {}
    wait_for(lambda: bool(seen.update(_children(proc.pid)) or seen), 60, "the first child")
    if phase == "router-starting":
        wait_for(lambda: "router" in (seen.update(_children(proc.pid)) or seen).values(), 120, "the router child",
                 interval=0.05)
    assert proc.poll() is None, "still starting"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert seen, "the supervisor had started children"
    wait_for(lambda: not _spawned_by(proc.pid), 20, "children gone")
    assert proc.returncode == 0, output


def test_sigkill_of_the_supervisor_takes_its_children(up) -> None:
    proc, address, children = up
    proc.kill()   # no handler runs: the kernel's parent-death signal does the work
    proc.wait()
    wait_for(lambda: not _spawned_by(proc.pid), 20, "children gone with the supervisor")


def test_a_busy_port_is_an_error_before_anything_starts(tiny_qwen3: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _up(tiny_qwen3, port)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2   # a usage error, as from `pdserve router`
    assert f"127.0.0.1:{port} is already in use" in output
    assert "Traceback" not in output
    assert not _spawned_by(proc.pid)
