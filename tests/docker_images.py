"""Images for the compose test on a machine with no registry: a minimal Debian base made by
debootstrap and `docker import`ed (built once, tagged by its recipe's content hash), the pdserve
image from deploy/docker/Dockerfile on that base (pip installs from a host wheelhouse served on
loopback, since pip inside a build does not trust this network's egress certificate), and
Prometheus from Debian's package (deploy/prometheus/Dockerfile). A Docker daemon is started when
none answers, and stopped by whoever started it.

`python -m tests.docker_images` builds them all (CI runs it early, beside the install) and prints
the compose variables that select them."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"                      # the README's CPU build, taken from local disk by pip
DAEMON_START_S = 60.0
BUILD_TIMEOUT_S = 900.0
WHEELS_PORT = 39917                          # below the ephemeral range


def cache_dir() -> Path:
    """Private to this user: the wheelhouse and the build lock."""
    path = Path(os.environ.get("PDSERVE_DOCKER_CACHE", Path.home() / ".cache" / "pdserve-docker"))
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _run(argv: list[str], timeout: float, log: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """argv, its output to log (when given); a failure raises with the output's tail."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{res.stdout}{res.stderr}\n")
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}")
    return res


def daemon_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=30).returncode == 0


def docker_available() -> tuple[bool, str]:
    """(whether a daemon answers or can be started here, why not)."""
    if daemon_answers():
        return True, ""
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        return False, "no docker client or daemon (Debian: apt-get install docker.io debootstrap)"
    if os.geteuid() != 0:
        return False, "no Docker daemon answers, and starting one needs root"
    return True, ""


@contextlib.contextmanager
def docker_daemon() -> Iterator[None]:
    """A daemon that answers for the block: the running one, else one started here and stopped after."""
    if daemon_answers():
        yield
        return
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-dockerd-"))
    with open(log_dir / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(["dockerd", "--storage-driver", "overlay2"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + DAEMON_START_S
        while not daemon_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start: {(log_dir / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One builder at a time (CI's early build and the test may overlap)."""
    with open(cache_dir() / "build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=30).returncode == 0


@dataclass(frozen=True)
class BaseRecipe:
    """What the local base image is made of; its content hash is the image's tag."""
    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    packages: tuple[str, ...] = ("python3", "python3-pip", "python-is-python3", "g++", "wget", "ca-certificates")
    revision: int = 1        # bump when base_image's steps change

    @property
    def tag(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"pdserve-local-base:{digest}"


def base_image(recipe: BaseRecipe = BaseRecipe(), log: Path | None = None) -> str:
    """The minimal Debian base (python3 as `python` and `pip`, g++), made once per recipe."""
    if image_exists(recipe.tag):
        return recipe.tag
    work = Path(tempfile.mkdtemp(prefix="pdserve-base-", dir="/var/tmp"))
    try:
        root = work / "root"
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(recipe.packages)}", recipe.suite, str(root),
              recipe.mirror], timeout=BUILD_TIMEOUT_S, log=log)
        for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):   # the image's pip installs system-wide
            marker.unlink()
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            _run(["docker", "import", "--change", 'CMD ["/bin/bash"]', "-", recipe.tag], timeout=BUILD_TIMEOUT_S,
                 log=log, stdin=tar.stdout)
        finally:
            tar.stdout.close()
            tar.wait(timeout=60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return recipe.tag


def wheelhouse(log: Path | None = None) -> Path:
    """Every wheel the pdserve image installs (CPU torch, the dependencies, the build backend),
    downloaded on the host once per pyproject.toml."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()[:12]
    dest = cache_dir() / f"wheels-{key}"
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix="wheels-", dir=cache_dir()))
    _run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(tmp), TORCH, "setuptools>=77", "wheel",
          str(ROOT)], timeout=BUILD_TIMEOUT_S, log=log)
    tmp.rename(dest)
    return dest


@contextlib.contextmanager
def serve_directory(path: Path) -> Iterator[str]:
    """path over HTTP on loopback (read only) for the block: pip's --find-links inside a build. On a
    fixed port where it is free: the URL is a build argument, and a build argument that changes
    between builds invalidates Docker's cache of every step after it."""
    handler = functools.partial(_QuietHandler, directory=str(path))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def build(tag: str, dockerfile: str, build_args: dict[str, str], log: Path | None = None) -> str:
    """docker build of the repository with dockerfile; host networking so that it reaches loopback."""
    argv = ["docker", "build", "--network", "host", "-f", str(ROOT / dockerfile), "-t", tag]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
    _run([*argv, str(ROOT)], timeout=BUILD_TIMEOUT_S, log=log)
    return tag


def images(log: Path | None = None) -> dict[str, str]:
    """Every image the compose test runs, built or reused; the compose variables that select them."""
    with _build_lock():
        base = base_image(log=log)
        wheels = wheelhouse(log=log)
        with serve_directory(wheels) as url:
            pip = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": url}
            pdserve = build("pdserve:compose-test", "deploy/docker/Dockerfile", {"BASE_IMAGE": base, **pip}, log=log)
        prometheus = build("pdserve-prometheus:compose-test", "deploy/prometheus/Dockerfile", {"BASE_IMAGE": base},
                           log=log)
    return {"PDSERVE_IMAGE": pdserve, "PROMETHEUS_IMAGE": prometheus}


def main() -> int:
    ok, why = docker_available()
    if not ok:
        print(f"tests.docker_images: {why}", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    with docker_daemon():
        env = images()
    for name, value in env.items():
        print(f"{name}={value}")
    print(f"built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
