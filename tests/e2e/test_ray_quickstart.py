"""`pdserve ray up` as a new user meets it (real Ray, loopback only): the README's quick start as
written on this machine, a plain `ray start` cluster (no authentication: it works, with a
warning), a token-auth one (the token is used; without it, one line saying what to set), and a
deployment the cluster cannot place (fails in seconds, naming the flags, leaving nothing running).

Each test runs the CLI in an environment like a user's shell: no RAY_AUTH_MODE (the suite's
conftest sets one for its own cluster), its own PDSERVE_HOME, and checks that no process of its
own outlives it (every process it started carries that PDSERVE_HOME in its environment).
"""
from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.services.deployment.launcher import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

ROOT = Path(__file__).resolve().parents[2]
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "PDSERVE_CLUSTER_TOKEN")


def _user_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    path = env.get("PYTHONPATH", "")
    env.update(PDSERVE_HOME=str(home), PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), path) if p), **extra)
    return env


def _pdserve(argv: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _processes_with(home: Path) -> list[int]:
    """Pids of processes whose environment has PDSERVE_HOME=home (everything a test started)."""
    needle = f"PDSERVE_HOME={home}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            data = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in data + b"\0" and state != "Z":
            pids.append(int(entry))
    return pids


def _assert_nothing_left(home: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := _processes_with(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:   # do not leak them into the next test, then fail
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left running: {left}"


def _generate(router: str, env: dict[str, str]) -> None:
    res = _pdserve(["generate", "--router", router, "Once upon a time", "--max-tokens", "4", "--ignore-eos"], env,
                   timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "completion_tokens=4" in res.stderr


def _ray_start(home: Path, port: int, auth_token: str | None) -> subprocess.Popen:
    """A plain `ray start --head` on 127.0.0.1 (token auth if auth_token), in its own process group."""
    from pdserve.services.ray_deploy.cluster import LOOPBACK_ENV, _ray_cli

    env = _user_env(home, **{LOOPBACK_ENV: "0"})   # keeps every Ray server on 127.0.0.1
    if auth_token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=auth_token)
    proc = subprocess.Popen([*_ray_cli(), "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
                             "--ray-client-server-port", str(free_port()),
                             # a free port for the agent too: Ray's default (52365) was once the free GCS port
                             "--dashboard-agent-listen-port", str(free_port()), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                             "--object-store-memory", str(200 << 20)],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    return proc


def _stop_group(pgid: int) -> None:
    from pdserve.services.ray_deploy.cluster import _kill_group
    _kill_group(pgid)


def readme_ray_commands() -> list[list[str]]:
    """The README's `pdserve ray ...` commands, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Ray", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line.split(" #")[0])[1:] for line in block.splitlines() if line.startswith("pdserve ray ")]


def test_readme_ray_quick_start_as_written(default_model: str, user_home: Path) -> None:
    """On this machine (2 cores): the head's CPUs are shared out, the deployment serves, `ray down`
    removes it and the local head it started. Only --port is added (50051 may be taken here). The
    README names no --model: the default model serves (converted once per run, into the suite's
    home; user_home links it)."""
    home = user_home
    assert (home / "models" / Path(default_model).name).is_dir()
    env = _user_env(home)
    up, down = readme_ray_commands()
    assert up[:2] == ["ray", "up"] and down[:2] == ["ray", "down"] and "--address" in up
    port = free_port()
    try:
        res = _pdserve([*up, "--port", str(port)], env)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert f"router at 127.0.0.1:{port}" in res.stdout
        assert (home / "ray" / "local-cluster.json").exists() and (home / "ray" / "auth_token").exists()
        _generate(f"127.0.0.1:{port}", env)
    finally:
        res = _pdserve(down, env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "stopped the local cluster" in res.stdout
    assert not (home / "ray" / "local-cluster.json").exists()
    _assert_nothing_left(home)


@pytest.mark.parametrize("auth", ["none", "token"])
def test_ray_up_against_a_ray_start_cluster(user_home: Path, auth: str, tiny_qwen3: str) -> None:
    """`ray start --head` without auth: works, with a warning. With token auth: the configured token
    is used (RAY_AUTH_TOKEN, no RAY_AUTH_MODE needed); without a token: one line, exit 1."""
    home = user_home
    model = ["--model", tiny_qwen3]   # the tiny model: this test is about the cluster, not the model
    gcs_port, router_port = free_port(), free_port()
    token = secrets.token_hex(16) if auth == "token" else None
    head = _ray_start(home, gcs_port, token)
    address = f"127.0.0.1:{gcs_port}"
    env = _user_env(home, **({"RAY_AUTH_TOKEN": token} if token else {}))
    try:
        if not token:   # first, a deployment no node can hold: it fails in seconds, naming the flags
            t0 = time.monotonic()
            res = _pdserve(["ray", "up", "--address", address, *model, "--worker-host", "node-ip", "--worker-cpus",
                            "64", "--port", str(router_port)], env)
            elapsed = time.monotonic() - t0
            assert res.returncode == 1, res.stdout + res.stderr
            assert res.stderr.strip().splitlines()[-1] == (
                f"pdserve: error: ray up: the cluster can never place the deployment: it needs 2 worker(s) of "
                f"{{CPU: 64}} and a router of {{CPU: 1}}, but its nodes have {{CPU: 2}}; lower --worker-cpus / "
                f"--router-cpus (fractions are fine, e.g. 0.5), deploy fewer --prefill-workers / --decode-workers, "
                f"or give the cluster more CPUs (--address local: --local-num-cpus) (an autoscaling cluster: give "
                f"--placement-timeout-s to wait for new nodes)")
            assert elapsed < 30, elapsed
            status = _pdserve(["ray", "status", "--address", address], env)   # nothing of it is left
            assert status.returncode == 1 and "no deployment 'pdserve'" in status.stderr, status.stderr
        if token:
            res = _pdserve(["ray", "up", "--address", address, *model, "--port", str(router_port)], _user_env(home))
            assert res.returncode == 1, res.stderr[-2000:]
            assert res.stderr.strip().splitlines()[-1] == (
                f"pdserve: error: the Ray cluster at {address} requires token authentication, but no token is "
                f"configured here: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token (`ray get-auth-token` "
                f"on one of its nodes prints it)")
        res = _pdserve(["ray", "up", "--address", address, *model, "--prefill-workers", "1", "--decode-workers", "1",
                        "--port", str(router_port), "--kv-cache-memory-bytes", str(64 << 20)], env)   # not 1 GiB
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        warning = f"pdserve: warning: the Ray cluster at {address} has no authentication"
        assert (warning in res.stderr) == (auth == "none"), res.stderr
        _generate(f"127.0.0.1:{router_port}", env)
        if not token:   # idempotent, as the KubeRay submitter runs it: a SERVING deployment is kept
            res = _pdserve(["ray", "up", "--address", address, *model, "--if-exists", "keep", "--port",
                            str(router_port)], env)
            assert res.returncode == 0 and "deployment 'pdserve' is already up" in res.stderr, res.stderr[-2000:]
        res = _pdserve(["ray", "down", "--address", address], env, timeout=120)
        assert res.returncode == 0 and "removed:" in res.stdout, res.stderr[-2000:]
    finally:
        _stop_group(head.pid)
    _assert_nothing_left(home)


def test_failed_local_ray_up_stops_the_head_it_started(user_home: Path, tiny_qwen3: str) -> None:
    """Workers bigger than any node: `ray up --address local` fails (at once, once the head is up),
    names the flags that fix it, and stops the local head it had started."""
    home = user_home
    env = _user_env(home)
    t0 = time.monotonic()
    res = _pdserve(["ray", "up", "--address", "local", "--model", tiny_qwen3, "--worker-host", "node-ip",
                    "--worker-cpus", "64", "--port", str(free_port()), "--local-num-cpus", "2"], env, timeout=120)
    elapsed = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("pdserve: error:")]
    assert len(error) == 1 and "can never place the deployment" in error[0], res.stderr
    for flag in ("--worker-cpus", "--router-cpus", "--local-num-cpus", "--placement-timeout-s"):
        assert flag in error[0]
    assert "stopped the local Ray cluster it had started" in res.stderr
    assert elapsed < 120, elapsed   # mostly the head's start-up: the failure itself is immediate
    assert not (home / "ray" / "local-cluster.json").exists()
    _assert_nothing_left(home)
