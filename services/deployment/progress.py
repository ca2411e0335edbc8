"""Start-up progress for people: what is happening now, and that it still is.

On a terminal a step is one line rewritten in place (a spinner and the seconds so far); when the
output is a file or a pipe (CI logs, `docker logs`), a step prints its line once, a "still ..."
line every ``every_s`` seconds, and its outcome: no carriage returns, nothing repeated per tick.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator

SPINNER = "|/-\\"


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress lines of one command, prefixed (``pdserve: ...``), on ``stream`` (stderr)."""

    def __init__(self, prefix: str = "pdserve", stream: IO[str] | None = None, every_s: float = 5.0,
                 tty: bool | None = None) -> None:
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.tty = is_tty(self.stream) if tty is None else tty
        self._lock = threading.Lock()
        self._live: str | None = None      # the line being rewritten (tty only)

    def say(self, text: str) -> None:
        """A line of its own (above the live line, on a terminal)."""
        with self._lock:
            if self._live is not None and self.tty:
                self.stream.write("\r\033[K")
            self.stream.write(f"{self.prefix}: {text}\n")
            if self._live is not None and self.tty:
                self.stream.write(self._live)
            self.stream.flush()

    @contextmanager
    def step(self, text: str, done: str = "done") -> Iterator["Step"]:
        """`with progress.step("loading weights"):` shows it until the block ends, then the outcome."""
        s = Step(self, text)
        s.start()
        try:
            yield s
        except BaseException:
            s.finish("failed")
            raise
        s.finish(s.outcome or done)


class Step:
    def __init__(self, progress: Progress, text: str) -> None:
        self.p = progress
        self.text = text
        self.detail = ""
        self.outcome: str | None = None
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def update(self, detail: str) -> None:
        """What the step is at now (shown on the live line, or in the next "still" line)."""
        self.detail = detail

    def start(self) -> None:
        if not self.p.tty:
            self.p.say(f"{self.text} ...")
        self._thread.start()

    def _line(self, mark: str) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.p.prefix}: {mark} {self.text}{detail} ({self.elapsed:.0f}s)"

    def _tick(self) -> None:
        spin = itertools.cycle(SPINNER)
        last = time.monotonic()
        while not self._stop.wait(0.2 if self.p.tty else 0.5):
            if self.p.tty:
                with self.p._lock:
                    self.p._live = "\r\033[K" + self._line(next(spin))
                    self.p.stream.write(self.p._live)
                    self.p.stream.flush()
            elif time.monotonic() - last >= self.p.every_s:
                last = time.monotonic()
                detail = f": {self.detail}" if self.detail else ""
                self.p.say(f"still {self.text}{detail} ({self.elapsed:.0f}s)")

    def finish(self, outcome: str) -> None:
        self._stop.set()
        self._thread.join()
        with self.p._lock:
            if self.p.tty:
                self.p.stream.write("\r\033[K")
            self.p._live = None
            self.p.stream.write(f"{self.p.prefix}: {self.text}: {outcome} ({self.elapsed:.1f}s)\n")
            self.p.stream.flush()
