"""bench/vs_vllm.py's process handling and record: process groups started and stopped as a whole
(no process left behind), ports, HTTP readiness, SIGTERM, and the Record of a run (its commands,
logs and partial results). Standard library only at import (vLLM's venv loads it)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bench.vs_vllm_commands import REPO_ROOT, format_command, git_info, machine_info


def _proc_table() -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ppid, pgid, session id, start time) of every process (Linux /proc)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # fields[0] is the state; ppid, pgrp, session follow; starttime is field 22 of stat (index 19 here)
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    return table


class ProcessGroup:
    """A command in its own session / process group; stop() ends it and every process it started
    (also those that made their own session, as `pdserve up`'s workers do) and checks none is left."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = REPO_ROOT) -> None:
        self.name, self.cmd, self.log_path = name, list(cmd), log_path
        self.env_overrides = dict(env or {})
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen(self.cmd, cwd=cwd, env={**os.environ, **self.env_overrides},
                                      stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        self.known: dict[int, int] = {}    # pid -> start time, of the leader and everything seen under it
        self.refresh()

    def refresh(self) -> None:
        """Remember the leader's descendants and the members of every known process group / session."""
        try:
            table = _proc_table()
        except OSError:
            return
        if self.popen.pid in table:
            self.known.setdefault(self.popen.pid, table[self.popen.pid][3])
        live = [p for p, start in self.known.items() if p in table and table[p][3] == start]
        groups = {table[p][1] for p in live} | {self.popen.pid}
        sessions = {table[p][2] for p in live} | {self.popen.pid}
        changed = True
        while changed:
            changed = False
            for pid, (ppid, pgid, sid, start) in table.items():
                if pid in self.known:
                    continue
                if ppid in self.known or pgid in groups or sid in sessions:
                    self.known[pid] = start
                    groups.add(pgid)
                    sessions.add(sid)
                    changed = True

    def alive(self) -> list[int]:
        try:
            table = _proc_table()
        except OSError:
            return []
        return sorted(p for p, start in self.known.items()
                      if p in table and table[p][3] == start and not _is_zombie(p))

    def poll(self) -> int | None:
        self.refresh()
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            time.sleep(0.5)

    def stop(self, grace: float = 20.0, settle: float = 5.0) -> list[int]:
        """SIGTERM to the leader's group; after `grace` s for the leader and `settle` s more for the
        processes it stops itself, SIGKILL to whatever is left; returns the pids still alive after
        that (should be none)."""
        self.refresh()
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + settle
        while self.alive() and time.monotonic() < deadline:   # e.g. `pdserve up` stopping its workers
            time.sleep(0.2)
        for pid in self.alive():
            _signal_pid(pid, signal.SIGKILL)
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.3)
        left = self.alive()
        self._log.close()
        return left


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].split()[0] == "Z"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http(proc: ProcessGroup, urls: Sequence[str], timeout: float) -> str:
    """Until one of urls answers 2xx; raises if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        for url in urls:
            if http_ok(url):
                return url
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"{proc.name} exited with code {rc} before it was healthy; see {proc.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} not healthy after {timeout:.0f}s; see {proc.log_path}")
        time.sleep(1.0)


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminated()


@dataclass
class Record:
    mode: str
    out_dir: Path
    args: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=machine_info)
    git: dict[str, Any] = field(default_factory=git_info)
    commands: list[dict[str, Any]] = field(default_factory=list)
    leftovers: list[dict[str, Any]] = field(default_factory=list)
    partial: dict[str, Any] = field(default_factory=dict)     # what finished before an interruption

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None, log_name: str | None = None,
              load_before: float | None = None) -> ProcessGroup:
        log = self.out_dir / (log_name or f"{name}.log")
        entry = {"name": name, "command": format_command(cmd, env), "log": str(log), "started": time.strftime("%H:%M:%S"),
                 "loadavg_1m_before": load_before if load_before is not None else round(os.getloadavg()[0], 2)}
        self.commands.append(entry)
        print(f"[{name}] {entry['command']}", flush=True)
        return ProcessGroup(name, cmd, log, env)

    def stop(self, proc: ProcessGroup, port: int | None = None) -> None:
        left = proc.stop()
        busy = port is not None and port_in_use(port)
        if left or busy:
            msg = f"[{proc.name}] NOT CLEAN after stop: pids alive {left}" + (f", port {port} still in use" if busy else "")
            print("WARNING: " + msg, file=sys.stderr, flush=True)
            self.leftovers.append({"name": proc.name, "pids": left, "port_in_use": busy})
        else:
            print(f"[{proc.name}] stopped; no process of it left" + (f", port {port} free" if port else ""), flush=True)

    def run(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 3600,
            log_name: str | None = None) -> int:
        proc = self.start(name, cmd, env, log_name)
        try:
            rc = proc.wait(timeout)
        finally:
            self.stop(proc)
        return rc

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": self.git,
                "machine": self.machine, "args": self.args, "commands": self.commands,
                "leftover_processes": self.leftovers}


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
