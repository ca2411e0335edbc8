"""A directory of the model cache built once: under a lock, in a private temporary sibling,
renamed into place when complete. A directory at the target is therefore always whole; a build
that fails leaves nothing behind."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

LOCK_WAIT_S = 1800.0   # another process building the same directory: wait at most this long


def build_once(target: Path, build: Callable[[Path], None], lock_wait_s: float = LOCK_WAIT_S) -> Path:
    """``target``, made by ``build(tmp)`` into an empty private directory unless it exists."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(target.parent / f".{target.name}.lock", lock_wait_s):
        if target.is_dir():   # built by the process that held the lock
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            for path in tmp.iterdir():
                path.chmod(0o644)
            tmp.chmod(0o755)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


class _locked:
    """An exclusive flock on ``path``, polled until ``wait_s`` has passed (then TimeoutError)."""

    def __init__(self, path: Path, wait_s: float) -> None:
        self.path, self.wait_s, self.fd = path, wait_s, -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"another process has been building {self.path.name[1:-5]} for "
                                       f"over {self.wait_s:.0f} s (lock {self.path})") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
