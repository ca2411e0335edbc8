"""Builds a shared library from C++ sources once per machine, safely across processes.

The library lands in ``$PDSERVE_HOME/kernels`` (default ``~/.cache/pdserve/kernels``) under a name
keyed by the sources, the headers beside them, the compiler and its version, the flags and the
CPU's feature flags, so a change of any of them builds anew and an unchanged machine never
rebuilds. Concurrent processes (two workers starting at once) take an ``fcntl`` lock on the
key: one compiles, the others wait and then load its result. The compiler writes into a
temporary directory and the file is renamed into place atomically.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pdserve.engine.cpu_features import cpu_identity
from pdserve.engine.settings import ENV, pdserve_home

log = logging.getLogger(__name__)




def find_compiler() -> str | None:
    """$CXX if it names a runnable compiler, else g++, c++ or clang++ from PATH; None if none."""
    env = ENV.CXX.raw()
    if env:
        return shutil.which(env)
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _compiler_version(compiler: str) -> str:
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return proc.stdout.splitlines()[0] if proc.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def build_key(sources: list[Path], compiler: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    files = sorted(set(sources) | {p for s in sources for p in s.parent.glob("*.h")})
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (compiler, _compiler_version(compiler), *flags, cpu_identity()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _compile(compiler: str, flags: list[str], sources: list[Path], tmp: Path, so: Path) -> str | None:
    """Compile the sources in parallel (one process per CPU), then link; the error text or None."""
    compile_flags = [f for f in flags if f != "-shared"]
    objects = [tmp / f"{i}.o" for i in range(len(sources))]
    pending = list(zip(sources, objects))
    running: list[subprocess.Popen] = []
    error = None
    while pending or running:
        while pending and len(running) < max(1, os.cpu_count() or 1):
            src, obj = pending.pop(0)
            running.append(subprocess.Popen([compiler, *compile_flags, "-c", str(src), "-o", str(obj)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        proc = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode != 0 and error is None:
            error = err
    if error is not None:
        return error
    proc = subprocess.run([compiler, *flags, *map(str, objects), "-o", str(so)], capture_output=True, text=True)
    return proc.stderr if proc.returncode != 0 else None


def build_library(name: str, sources: list[Path], flags: list[str], what: str = "CPU kernels") -> Path | None:
    """The built library's path (compiled now if this machine has none yet); None if there is
    no compiler or the build fails (logged)."""
    compiler = find_compiler()
    if compiler is None:
        log.info("no C++ compiler found: the %s are off, torch paths run instead", what)
        return None
    out_dir = pdserve_home() / "kernels"
    key = build_key(sources, compiler, flags)
    target = out_dir / f"{name}-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # others wait here while one process builds
        try:
            if target.is_file():
                return target
            log.info("building %s (once per machine) into %s ...", what, target)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                so = Path(tmp) / "lib.so"
                error = _compile(compiler, flags, sources, Path(tmp), so)
                if error is not None:
                    log.warning("building the %s failed; torch paths run instead:\n%s", what, error[-3000:])
                    return None
                os.replace(so, target)
            log.info("built %s in %.1f s", what, time.perf_counter() - t0)
            return target
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
