"""Connecting to a Ray cluster, and a loopback-only local one for `pdserve ray up --address local`.

Connecting asks the cluster's GCS first whether it wants a token (a call without one is
refused UNAUTHENTICATED, or answered): a token cluster is joined in token mode with the token
configured here (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``, or the
local cluster's own), and a cluster without authentication is joined without one, with a
warning. Whatever ``RAY_AUTH_MODE`` this process inherited does not decide it.

A local cluster is a `ray start --head` whose processes live in their own process
group (so it outlives the command and can be stopped by that group id alone), with:

* token authentication on (``RAY_AUTH_MODE=token``; unless a token is configured through
  ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``, a fresh one is written to
  ``$PDSERVE_HOME/ray/auth_token``, mode 0600, and the head reads it from there);
* every Ray server bound to 127.0.0.1: Ray resolves a loopback ``--node-ip-address``
  to the machine's outward IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` marks
  the node single-machine, which makes the node IP (and so the bind address of GCS,
  raylet, object manager and workers) 127.0.0.1;
* no dashboard, and a bounded object store.

Its state (address, process group, token path) is ``$PDSERVE_HOME/ray/local-cluster.json``.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine.settings import ENV, pdserve_home
from pdserve.services.common.ports import free_port
from pdserve.services.common.process_table import group_running

log = logging.getLogger(__name__)

AUTH_ENV = (ENV.RAY_AUTH_TOKEN.name, ENV.RAY_AUTH_TOKEN_PATH.name)
AUTH_MODE_ENV = ENV.RAY_AUTH_MODE.name
LOOPBACK_ENV = ENV.RAY_LOOPBACK.name


@dataclass(slots=True)
class LocalCluster:
    address: str        # GCS address, HOST:PORT
    pgid: int           # process group of every process of the head
    started: float
    token_path: str | None = None   # the token file the head reads (None: RAY_AUTH_TOKEN of its env)

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


def state_dir() -> Path:
    return pdserve_home() / "ray"


def state_file() -> Path:
    return state_dir() / "local-cluster.json"


def local_token_path() -> Path:
    return state_dir() / "auth_token"


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


def _write_local_token() -> str:
    """A fresh token for a local head, in a file only this user can read."""
    path = local_token_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return str(path)


def has_auth_token() -> bool:
    return (ENV.RAY_AUTH_TOKEN.is_set() or ENV.RAY_AUTH_TOKEN_PATH.is_set()) or (Path.home() / ".ray" / "auth_token").exists()


def _ray_cli() -> list[str]:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    return [exe] if exe else [sys.executable, "-m", "ray.scripts.scripts"]


def local_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a loopback-only, token-authenticated local head (and its workers)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("RAY_AUTH_MODE", "token")
    env[LOOPBACK_ENV] = "0"
    return env


def start_local_cluster(*, num_cpus: float | None = None, num_gpus: int | None = None,
                        object_store_bytes: int = 512 << 20, port: int | None = None,
                        timeout_s: float = 120.0, save: bool = True) -> LocalCluster:
    """`ray start --head` on 127.0.0.1 in a new process group; returns once the GCS answers."""
    env = local_env()
    env[AUTH_MODE_ENV] = "token"
    token_path = None
    if not any(env.get(v) for v in AUTH_ENV):   # the head's own token, under $PDSERVE_HOME
        token_path = env["RAY_AUTH_TOKEN_PATH"] = _write_local_token()
    elif env.get("RAY_AUTH_TOKEN_PATH") and not env.get("RAY_AUTH_TOKEN"):
        token_path = env["RAY_AUTH_TOKEN_PATH"]
    port = port or free_port()
    cmd = [*_ray_cli(), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--ray-client-server-port", str(free_port()),   # not the shared default 10001
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
    cluster = LocalCluster(address=f"127.0.0.1:{port}", pgid=proc.pid, started=time.time(), token_path=token_path)
    deadline = time.monotonic() + timeout_s
    while not cluster.alive():
        if time.monotonic() > deadline:
            _kill_group(proc.pid)
            raise TimeoutError(f"local Ray head at {cluster.address} is not reachable")
        time.sleep(0.2)
    if save:
        _save_local_cluster(cluster)
    return cluster


def _kill_group(pgid: int, timeout_s: float = 3.0) -> None:
    """SIGTERM the group, SIGKILL what is left after timeout_s (GCS and raylet take ~10 s to go
    gracefully; a local throwaway cluster need not wait for that)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_running(pgid):
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


def resolve_address(address: str, **local_kwargs) -> tuple[str, LocalCluster | None, bool]:
    """'local' -> a running pdserve local head (started if needed); anything else unchanged.
    Returns (address, the local cluster or None, whether this call started it)."""
    if address != "local":
        return address, None, False
    cluster = load_local_cluster()
    if cluster is not None and cluster.alive():
        return cluster.address, cluster, False
    cluster = start_local_cluster(**local_kwargs)
    return cluster.address, cluster, True


def use_loopback_node() -> None:
    """Make this process's Ray treat the machine as a single loopback node.

    Needed by a driver of a local cluster: otherwise ray.init rewrites a 127.0.0.1
    address to the machine's outward IP, where the loopback-only head is not listening.
    """
    ENV.RAY_LOOPBACK.set("0")
    if "ray" in sys.modules:   # the flag is read at import: set it on the loaded module too
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False


def gcs_address(address: str) -> str | None:
    """HOST:PORT of the GCS behind address (auto: RAY_ADDRESS or this node's cluster); None when it
    cannot be told (ray:// goes through Ray Client)."""
    if address.startswith("ray://"):
        return None
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address
            return canonicalize_bootstrap_address("auto")
        except Exception:  # noqa: BLE001 - no cluster found: ray.init will say so
            return None
    return address


def cluster_wants_token(gcs: str, timeout_s: float = 10.0) -> bool | None:
    """Whether the GCS refuses a call without a token (True), answers it (False), or cannot be
    asked (None: unreachable; ray.init then reports the error)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs) as ch:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(ch).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            return None
    return False


def _set_auth_mode(mode: str) -> None:
    """RAY_AUTH_MODE for this process; Ray caches it, so a loaded Ray is told to read it again."""
    ENV.RAY_AUTH_MODE.set(mode)
    if "ray" in sys.modules:
        try:
            from ray._raylet import AuthenticationTokenLoader, Config
            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()
        except Exception:  # noqa: BLE001 - older/newer Ray: the environment alone then decides
            log.debug("could not reset Ray's auth state", exc_info=True)


class AuthError(RuntimeError):
    """The cluster wants a token this process does not have."""


def prepare_auth(address: str, local: LocalCluster | None) -> str | None:
    """Set this process up to join the cluster at address as it is secured. Returns a warning to
    show, if any (a cluster without authentication). Raises AuthError when a token is needed
    and none is configured."""
    if local is not None and local.token_path and not ENV.RAY_AUTH_TOKEN.is_set():
        ENV.RAY_AUTH_TOKEN_PATH.set(local.token_path)
    gcs = gcs_address(address)
    wants = cluster_wants_token(gcs) if gcs else None
    if wants is True:
        if not has_auth_token():
            raise AuthError(f"the Ray cluster at {gcs} requires token authentication, but no token is configured "
                            f"here: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token (`ray get-auth-token` "
                            f"on one of its nodes prints it)")
        _set_auth_mode("token")
    elif wants is False:
        _set_auth_mode("disabled")
        return (f"the Ray cluster at {gcs} has no authentication: anyone who can reach its ports can run code "
                f"on it; start it with RAY_AUTH_MODE=token (see docs/ray.md)")
    return None


def connect(address: str, namespace: str, runtime_env: dict | None = None, on_local_start=None,
            **local_kwargs) -> LocalCluster | None:
    """ray.init against `address` (auto | HOST:PORT | ray://... | local) in `namespace`, with the
    cluster's own authentication. on_local_start(cluster): called when this call started a local
    head (so that the caller can stop it if what follows fails)."""
    address, local, started = resolve_address(address, **local_kwargs)
    if started and on_local_start is not None:
        on_local_start(local)
    if local is not None or address.split(":", 1)[0] in ("127.0.0.1", "localhost"):
        use_loopback_node()
    warning = prepare_auth(address, local)
    if warning:
        print(f"pdserve: warning: {warning}", file=sys.stderr, flush=True)
    import ray

    ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=False,
             logging_level="WARNING")
    return local
