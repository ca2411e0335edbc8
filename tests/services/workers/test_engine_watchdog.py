"""The engine-stall watchdog (services/workers/lifecycle.StallWatchdog) over AsyncEngine's heartbeat:
an idle engine is never declared stalled, a busy one that stops stepping is; a frozen or starved
process is not taken for a stalled engine; the setting is checked. (Replacement of a stalled
worker under a supervisor: tests/faults/test_engine_stall.py.)"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.settings import ENV
from pdserve.services.workers.async_engine import AsyncEngine, hang_file_for_tests
from pdserve.services.workers.config import WorkerConfig
from pdserve.services.workers.lifecycle import StallWatchdog
from tests.conftest import assert_no_leak

KW = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=256)
PROMPT = [3, 14, 15, 92, 65, 35]
TIMEOUT_S, INTERVAL_S = 1.0, 0.05


class Stalls:
    """on_stall's calls, as an event to wait on."""

    def __init__(self) -> None:
        self.seen = threading.Event()
        self.stalled_s: list[float] = []
        self.at = 0.0

    def __call__(self, stalled_s: float) -> None:
        self.stalled_s.append(stalled_s)
        self.at = time.monotonic()
        self.seen.set()


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _run(tiny_qwen3: str, body) -> None:
    async def main() -> None:
        aengine = AsyncEngine(EngineConfig(model=tiny_qwen3, **KW))
        aengine.start()
        stalls = Stalls()
        watchdog = StallWatchdog(lambda: aengine.heartbeat, TIMEOUT_S, stalls, interval_s=INTERVAL_S)
        watchdog.start()
        try:
            await body(aengine, watchdog, stalls)
        finally:
            watchdog.stop()
            aengine.stop()
        assert not aengine._thread.is_alive()
        assert_no_leak(aengine.engine)
    asyncio.run(main())


def test_an_idle_engine_is_never_declared_stalled(tiny_qwen3: str) -> None:
    async def body(aengine: AsyncEngine, watchdog: StallWatchdog, stalls: Stalls) -> None:
        # Idle from the start, then one request, then idle again: each idle spell watched for
        # several stall timeouts (counted in the watchdog's own checks, not in wall time).
        deadline = time.monotonic() + 120
        for _ in range(2):
            target = watchdog.checks + int(4 * TIMEOUT_S / INTERVAL_S)
            while watchdog.checks < target and not stalls.seen.is_set():
                assert time.monotonic() < deadline, "the watchdog stopped checking"
                await asyncio.sleep(0.05)
            assert not stalls.seen.is_set(), f"an idle engine was declared stalled: {stalls.stalled_s}"
            async with aengine.add(f"r{watchdog.checks}", PROMPT,
                                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) as stream:
                while not stream.finished:
                    await stream.get(timeout=30)
        assert not stalls.seen.is_set(), stalls.stalled_s
    _run(tiny_qwen3, body)


def test_a_busy_engine_that_stops_stepping_is_declared_stalled(tiny_qwen3: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV.TEST_ENGINE_HANG_DIR.name, str(tmp_path))
    hang = tmp_path / f"engine-hang-{os.getpid()}"
    assert hang_file_for_tests() == str(hang)

    async def body(aengine: AsyncEngine, watchdog: StallWatchdog, stalls: Stalls) -> None:
        async with aengine.add("long", PROMPT, SamplingParams(temperature=0.0, max_tokens=200,
                                                              ignore_eos=True)) as stream:
            await stream.get(timeout=30)
            assert not stalls.seen.is_set()      # stepping: no stall
            hang.write_text("")
            t_hang = time.monotonic()
            await asyncio.to_thread(stalls.seen.wait, 60)
            assert stalls.seen.is_set(), "a busy engine that stopped stepping was not declared stalled"
            assert stalls.stalled_s[0] >= TIMEOUT_S and stalls.at - t_hang >= TIMEOUT_S - 2 * INTERVAL_S
            hang.unlink()                        # the hook lets go: the request runs to its end
            while not stream.finished:
                res = await stream.get(timeout=30)
            assert res.output.finish_reason == "length"
    _run(tiny_qwen3, body)


def test_the_hang_hook_is_off_unless_a_test_sets_its_variable(monkeypatch) -> None:
    monkeypatch.delenv(ENV.TEST_ENGINE_HANG_DIR.name, raising=False)
    assert hang_file_for_tests() is None


def test_a_frozen_or_starved_process_is_not_taken_for_a_stall() -> None:
    beat = [0.0]
    dog = StallWatchdog(lambda: beat[0], 5.0, lambda s: None, interval_s=1.0)
    assert dog.check(0.0) == 0.0
    assert dog.check(60.0) == 2.0     # 60 s between two checks (SIGSTOP, no CPU) counts as two intervals
    beat[0] = 60.5                    # the engine thread, resumed, beats: the count starts again
    assert dog.check(61.0) == 0.0
    for t in range(62, 67):           # then really stuck: one interval per check
        stalled = dog.check(float(t))
    assert stalled == 5.0


@pytest.mark.parametrize("value", [0.5, 0.0, -1.0, float("nan"), float("inf"), 3601.0])
def test_the_stall_timeout_is_bounded(value: float) -> None:
    with pytest.raises(ValueError, match=r"engine_stall_timeout_s must be a number of seconds in \[1, 3600\]"):
        WorkerConfig(engine_stall_timeout_s=value)
    assert WorkerConfig().engine_stall_timeout_s == 90.0
