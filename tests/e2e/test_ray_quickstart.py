"""`pdserve ray up` as a new user meets it (real Ray, loopback only): the README's quick start as
written on this machine, and a deployment the cluster cannot place (fails in seconds, naming the
flags, leaving nothing running). A plain `ray start` cluster (no authentication: it works, with a
warning) and a token-auth one (RAY_AUTH_TOKEN is all it takes; without it, one line saying what
to set) are tests/e2e/test_ray_multi_node.py's, on several hosts.

Each test runs the CLI in an environment like a user's shell: no RAY_AUTH_MODE (the suite's
conftest sets one for its own cluster), its own PDSERVE_HOME, and checks that no process of its
own outlives it (every process it started carries that PDSERVE_HOME in its environment).
"""
from __future__ import annotations

import importlib.util
import os
import re
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
