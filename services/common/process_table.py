"""What Linux's process table says about pids and process groups (``/proc``), for supervisors
and the tests that check nothing outlives them."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator


def _stat_fields(pid: str) -> list[str] | None:
    """The fields after "(comm)" in /proc/PID/stat: state, ppid, pgrp, ... (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _processes() -> Iterator[tuple[int, str, int]]:
    """(pid, state, process group) of every process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            yield int(entry), fields[0], int(fields[2])


def group_pids(pgid: int, include_zombies: bool = False) -> set[int]:
    return {pid for pid, state, group in _processes() if group == pgid and (include_zombies or state != "Z")}


def group_running(pgid: int) -> bool:
    """Any process of the group that is not a zombie (where there is no /proc: any process)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return not os.path.isdir("/proc/self") or bool(group_pids(pgid))


def is_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    fields = _stat_fields(str(pid))
    return fields is not None and fields[0] != "Z"
