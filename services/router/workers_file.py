"""Discovery from a watched file (`pdserve router --workers-file PATH`): the workers listed there
are members, and the file is read again whenever it changes, so an operator, a config-management
tool or a script changes a running deployment by editing one file.

The file has one worker per line, ``ROLE HOST:PORT`` (ROLE: prefill, decode, or colocated);
blank lines and ``#`` comments are ignored::

    # pdserve workers
    prefill 10.0.0.2:50061
    decode  10.0.0.3:50062

What changes between two readings becomes membership changes, made as the membership API makes
them (services/router/membership.py): a new line adds the worker; a line removed drains the
worker and then forgets it (no request lost); a line whose role changed switches the worker's
role in place. Only the workers this file added are ever removed or switched by it (others joined
with ``--router``, or were added through the API or named on the command line).

A file that cannot be read or parsed (too large, a bad line, an address twice) changes nothing:
the error, naming the line, is logged, and the next change of the file is read again.

The file decides who gets the deployment's traffic, so it is trusted only as a config file of
this user: it is opened without following a link and without blocking (O_NOFOLLOW, O_NONBLOCK),
and read only if it is a regular file owned by this user (or root) that group and others cannot
write, of at most MAX_FILE_BYTES; anything else (a FIFO, a device, a file others may edit) is
refused with a log line saying why. Every look at it (its identity each POLL_S, each reading)
runs on a thread, off the router's event loop, and is given up after READ_TIMEOUT_S (a hung
network mount): the router keeps serving whatever is at the path.
"""
from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.services.common.checked_files import read_checked
from pdserve.services.router.membership import MembershipServicer, Refused
from pdserve.services.router.worker_pool import WorkerHandle

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20     # read no more than this
MAX_ENTRIES = 1024
POLL_S = 1.0                 # how often the file's identity (inode, size, mtime) is checked
READ_TIMEOUT_S = 5.0         # a look at the file (stat, open and read) given up after this
ROLES = {"prefill": "prefill", "decode": "decode", "colocated": "both", "both": "both"}


def parse_workers(text: str) -> dict[str, str]:
    """address -> role (the pool's names) of every line; ValueError naming the line otherwise."""
    workers: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0].lower() not in ROLES:
            raise ValueError(f"line {number}: expected 'ROLE HOST:PORT' with ROLE one of prefill, decode, colocated; "
                             f"got {raw.strip()[:200]!r}")
        role, address = ROLES[parts[0].lower()], parts[1]
        if address in workers:
            raise ValueError(f"line {number}: {address} is listed twice")
        workers[address] = role
        if len(workers) > MAX_ENTRIES:
            raise ValueError(f"more than {MAX_ENTRIES} workers listed")
    return workers


def read_workers(path: str) -> dict[str, str]:
    """The file's workers, read after the checks of the module docstring (ValueError naming the
    file and what is wrong otherwise). Blocking: the watcher calls it on a thread."""
    data = read_checked(path, "workers file", MAX_FILE_BYTES)
    try:
        return parse_workers(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"workers file {path}: {exc}") from None


class _StillLooking(Exception):
    """The last look at the file, given up, has not returned yet."""


@dataclass(slots=True)
class WorkersFileWatcher:
    """Keeps the members the file lists in step with it (see the module docstring)."""

    path: str
    membership: MembershipServicer
    drain_timeout_s: float
    poll_s: float = POLL_S
    added: dict[str, WorkerHandle] = field(default_factory=dict)   # the members this file made
    changing: dict[str, asyncio.Task] = field(default_factory=dict)   # address -> its removal or switch
    read_timeout_s: float = READ_TIMEOUT_S
    _seen: tuple | None = None         # the file's identity when last read
    _task: asyncio.Task | None = None
    _looking: asyncio.Future | None = None   # the look at the file under way on its thread
    _thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "workers-file"))

    async def start(self) -> None:
        """Read the file now and apply it, then follow it. At start, a missing or bad file, or an
        address that may not be a member, is an error (ValueError naming it); later, only logged."""
        self._seen = await self._look(self._identity)   # before reading: a change made meanwhile is read again
        workers = await self._look(read_workers, self.path)
        for address in workers:
            problem = self.membership.address_problem(address)
            if problem is not None:
                raise ValueError(f"workers file {self.path}: {problem[1]}")
        self._apply(workers)
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self.changing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _look(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the watcher's own thread (a hung file system holds no thread the router
        needs), given up after read_timeout_s: ValueError. Until a look given up returns, the file
        is not looked at again."""
        if self._looking is not None and not self._looking.done():
            raise _StillLooking()
        self._looking = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(self._looking), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"workers file {self.path}: no answer from the file system in "
                             f"{self.read_timeout_s:g}s; not looked at again until it answers") from None

    async def _follow(self) -> None:
        """Read the file again whenever its identity changes (both looks on a thread, with a deadline)."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                identity = await self._look(self._identity)
                if identity == self._seen:
                    continue
                self._seen = identity
                workers = await self._look(read_workers, self.path)
            except _StillLooking:
                continue
            except ValueError as exc:
                log.error("%s; membership left as it was", exc)
                continue
            self._apply(workers)

    def _identity(self) -> tuple | None:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid)

    def _apply(self, workers: dict[str, str]) -> None:
        for address, role in workers.items():
            if address in self.changing:
                continue   # its last change is still under way; the next reading takes it up
            worker = self.added.get(address)
            if worker is not None and worker not in self.membership.pool.workers:
                del self.added[address]   # removed meanwhile (an operator): the file adds it again
                worker = None
            if worker is None:
                if self.membership.pool.find(address) is not None:
                    continue   # a member already (named at start, joined, added by an operator): not ours
                try:
                    self.added[address] = self.membership.add(address, role)
                    log.info("workers file %s: %s added as %s", self.path, address, role)
                except Refused as exc:
                    log.error("workers file %s: %s not added: %s", self.path, address, exc)
            elif worker.role != role:
                self._change(address, self.membership.switch_role(worker, role, self.drain_timeout_s),
                             f"switched to {role}")
        for address in [a for a in self.added if a not in workers and a not in self.changing]:
            worker = self.added.pop(address)
            if worker in self.membership.pool.workers:   # (an operator may have removed it already)
                self._change(address, self.membership.remove(worker, self.drain_timeout_s), "removed")

    def _change(self, address: str, change, done: str) -> None:
        async def run() -> None:
            try:
                await change
                log.info("workers file %s: %s %s", self.path, address, done)
            except Refused as exc:
                log.error("workers file %s: %s not %s: %s", self.path, address, done, exc)
            finally:
                self.changing.pop(address, None)
                self._seen = None   # read the file again: it may have changed meanwhile
        self.changing[address] = asyncio.create_task(run())
