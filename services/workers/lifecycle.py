"""A worker's own lifecycle: serving or draining, in which role, the requests it is working on, and
the watchdog that ends it when its engine loop stops making progress."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Callable, Iterator

import grpc


class WorkerState:
    """Draining refuses new requests (UNAVAILABLE, so the router picks another worker) and
    lets the in-flight ones finish; ``wait_idle`` says when they have. ``role``: the role the
    worker serves now (a prefill or decode worker may switch, Worker.SetRole); a call of another
    role's service is refused UNAVAILABLE too, as a worker fault, so the router retries elsewhere."""

    def __init__(self, role: str = "both") -> None:
        self.role = role
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down)")

    async def refuse_unless_role(self, context: grpc.aio.ServicerContext, role: str) -> None:
        if self.role != role:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this worker is a {self.role} worker now: it takes no {role} calls")

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight, False if timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class StallWatchdog:
    """Watches the engine loop's heartbeat (a monotonic time it renews on every step, and every
    IDLE_WAKE_S while idle: an idle engine is never stalled) from a daemon thread, and calls
    on_stall(seconds) once, from that thread, when it has not changed for timeout_s.

    The stall is counted on the watchdog's own clock, each check adding at most two intervals: a
    process that was frozen (SIGSTOP) or starved of CPU, the engine thread with it, is not taken
    for a stalled engine when it resumes. A real stall is seen within timeout_s plus two intervals."""

    def __init__(self, beat: Callable[[], float], timeout_s: float, on_stall: Callable[[float], None],
                 interval_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.beat = beat
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.interval_s = interval_s if interval_s is not None else min(1.0, timeout_s / 4)
        self.checks = 0                        # checks done (tests wait on it)
        self._seen: float | None = None        # the beat the last check saw
        self._stalled_s = 0.0                  # how long it has been seen unchanged
        self._last_check: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def check(self, now: float) -> float:
        """One look at the heartbeat at monotonic time now: the seconds it has been seen stalled."""
        beat = self.beat()
        gap = 0.0 if self._last_check is None else max(0.0, now - self._last_check)
        self._last_check = now
        self.checks += 1
        if beat != self._seen:
            self._seen, self._stalled_s = beat, 0.0
        else:
            self._stalled_s += min(gap, 2 * self.interval_s)
        return self._stalled_s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            stalled = self.check(time.monotonic())
            if stalled >= self.timeout_s and not self._stop.is_set():
                self.on_stall(stalled)
                return
