"""Connecting to a Ray cluster, and a loopback-only local one for `pdserve ray up --address local`.

A local cluster is a `ray start --head` whose processes live in their own process
group (so it outlives the command and can be stopped by that group id alone), with:

* token authentication on (``RAY_AUTH_MODE=token``; a token is generated with
  ``ray get-auth-token --generate`` into ``~/.ray/auth_token`` when none is
  configured through ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` / that file);
* every Ray server bound to 127.0.0.1: Ray resolves a loopback ``--node-ip-address``
  to the machine's outward IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` marks
  the node single-machine, which makes the node IP (and so the bind address of GCS,
  raylet, object manager and workers) 127.0.0.1;
* no dashboard, and a bounded object store.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

AUTH_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])   # the directory holding services/, engine/, pdserve/


@dataclass(slots=True)
class LocalCluster:
    address: str        # GCS address, HOST:PORT
    pgid: int           # process group of every process of the head
    started: float

    def alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        host, port = self.address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return True
        except OSError:
            return False


def state_file() -> Path:
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return base / f"pdserve-ray-{os.getuid()}" / "local-cluster.json"


def load_local_cluster() -> LocalCluster | None:
    try:
        data = json.loads(state_file().read_text())
        return LocalCluster(**data)
    except (OSError, ValueError, TypeError):
        return None


def _save_local_cluster(cluster: LocalCluster | None) -> None:
    path = state_file()
    if cluster is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cluster)))


def has_auth_token() -> bool:
    return any(os.environ.get(v) for v in AUTH_ENV) or (Path.home() / ".ray" / "auth_token").exists()


def _ray_cli() -> list[str]:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    return [exe] if exe else [sys.executable, "-m", "ray.scripts.scripts"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a loopback-only, token-authenticated local head (and its workers)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("RAY_AUTH_MODE", "token")
    env[LOOPBACK_ENV] = "0"
    # Workers import pdserve from here when it is not installed (a source checkout).
    path = env.get("PYTHONPATH", "")
    if SOURCE_ROOT not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCE_ROOT, path) if p)
    return env


def start_local_cluster(*, num_cpus: float | None = None, num_gpus: int | None = None,
                        object_store_bytes: int = 512 << 20, port: int | None = None,
                        timeout_s: float = 120.0, save: bool = True) -> LocalCluster:
    """`ray start --head` on 127.0.0.1 in a new process group; returns once the GCS answers."""
    env = local_env()
    if env["RAY_AUTH_MODE"] == "token" and not has_auth_token():
        subprocess.run([*_ray_cli(), "get-auth-token", "--generate"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    port = port or free_port()
    cmd = [*_ray_cli(), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--include-dashboard", "false", "--disable-usage-stats",
           "--object-store-memory", str(int(object_store_bytes))]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(int(num_cpus))]
    if num_gpus is not None:
        cmd += ["--num-gpus", str(int(num_gpus))]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        raise TimeoutError(f"`ray start --head` did not finish within {timeout_s}s") from None
    if proc.returncode != 0:
        _kill_group(proc.pid)
        raise RuntimeError(f"`ray start --head` failed ({proc.returncode}):\n{out[-4000:]}")
    cluster = LocalCluster(address=f"127.0.0.1:{port}", pgid=proc.pid, started=time.time())
    deadline = time.monotonic() + timeout_s
    while not cluster.alive():
        if time.monotonic() > deadline:
            _kill_group(proc.pid)
            raise TimeoutError(f"local Ray head at {cluster.address} is not reachable")
        time.sleep(0.2)
    if save:
        _save_local_cluster(cluster)
    return cluster


def _group_running(pgid: int) -> bool:
    """Any process of the group that is not a zombie (Linux /proc; elsewhere: any process)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    if not os.path.isdir("/proc/self"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _kill_group(pgid: int, timeout_s: float = 3.0) -> None:
    """SIGTERM the group, SIGKILL what is left after timeout_s (GCS and raylet take ~10 s to go
    gracefully; a local throwaway cluster need not wait for that)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _group_running(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_local_cluster(cluster: LocalCluster | None = None) -> bool:
    """Stop a local head started by start_local_cluster (its process group only)."""
    saved = load_local_cluster()
    cluster = cluster or saved
    if cluster is None:
        return False
    _kill_group(cluster.pgid)
    if saved is not None and saved.pgid == cluster.pgid:
        _save_local_cluster(None)
    return True


def resolve_address(address: str, **local_kwargs) -> tuple[str, LocalCluster | None]:
    """'local' -> a running pdserve local head (started if needed); anything else unchanged."""
    if address != "local":
        return address, None
    cluster = load_local_cluster()
    if cluster is None or not cluster.alive():
        cluster = start_local_cluster(**local_kwargs)
    return cluster.address, cluster


def use_loopback_node() -> None:
    """Make this process's Ray treat the machine as a single loopback node.

    Needed by a driver of a local cluster: otherwise ray.init rewrites a 127.0.0.1
    address to the machine's outward IP, where the loopback-only head is not listening.
    """
    os.environ[LOOPBACK_ENV] = "0"
    if "ray" in sys.modules:   # the flag is read at import: set it on the loaded module too
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False


def connect(address: str, namespace: str, runtime_env: dict | None = None, **local_kwargs) -> LocalCluster | None:
    """ray.init against `address` (auto | HOST:PORT | ray://... | local) in `namespace`."""
    address, local = resolve_address(address, **local_kwargs)
    if local is not None or address.split(":", 1)[0] in ("127.0.0.1", "localhost"):
        use_loopback_node()
        if "ray" not in sys.modules:   # read at import; once imported, Ray turns token mode on by itself
            os.environ.setdefault("RAY_AUTH_MODE", "token")   # when it finds a token (see has_auth_token)
    import ray

    ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=False,
             logging_level="WARNING")
    return local
