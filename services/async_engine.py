"""Runs an LLMEngine on its own thread and exposes it to asyncio services.

The engine is not thread-safe, so every call into it (add, abort, reserve, write, admit,
stats) is queued and executed on the engine thread between steps. Step outputs are routed
to one asyncio queue per request. Model work never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class StepResult:
    """One engine output, with exported KV blocks attached in the prefill role."""

    output: RequestOutput
    blocks: torch.Tensor | None = None   # [len(output.ready_blocks), *block_shape], on CPU


class AsyncEngine:
    def __init__(self, config: EngineConfig, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None) -> None:
        self.engine = LLMEngine(config)
        self.config = config
        self.on_step = on_step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[StepResult]] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Published by the engine thread after every step and command batch, so status
        # queries never wait behind a long prefill step.
        self.snapshot: dict[str, int] = self.engine.stats()

    # ---- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # ---- calls into the engine thread ------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; exceptions propagate."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def job() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(job)
        return await fut

    def open_stream(self, request_id: str) -> asyncio.Queue[StepResult]:
        """Register for a request's outputs before it can produce any."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue[StepResult] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue[StepResult]:
        stream = self.open_stream(request_id)
        try:
            await self.call(lambda e: e.add_request(request_id, prompt, params))
        except BaseException:
            self.close_stream(request_id)
            raise
        return stream

    async def abort(self, request_id: str) -> bool:
        found = await self.call(lambda e: e.abort(request_id))
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(StepResult(RequestOutput(request_id, [], True, "abort")))
        return found

    # ---- the engine thread --------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            try:   # idle: wait for work (waking now and then to expire reservations)
                job = self._commands.get_nowait() if engine.has_unfinished_requests() else self._commands.get(timeout=0.05)
            except queue.Empty:
                job = _idle
            if job is None or not self._run_jobs(job):
                return
            if job is not _idle:
                self.snapshot = engine.stats()
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception:  # a failing step must not hang every caller
                    log.exception("engine step failed")
                    self._fail_all()
                    continue
                self._dispatch(outputs)
                self.snapshot = engine.stats()
            if engine.reservations and engine.expire_reservations():
                self.snapshot = engine.stats()

    def _run_jobs(self, job: Callable[[], None]) -> bool:
        """Run job and every queued one after it. False when asked to stop."""
        while True:
            job()
            try:
                job = self._commands.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(self.engine, outputs)
        results = []
        for out in outputs:
            blocks = None
            if out.ready_blocks:   # copy now, ship while the next chunk computes
                blocks = self.engine.read_kv_blocks(out.request_id, out.ready_blocks)
            results.append(StepResult(out, blocks))
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, results)

    def _deliver(self, results: list[StepResult]) -> None:
        for res in results:
            stream = self._streams.get(res.output.request_id)
            if stream is not None:
                stream.put_nowait(res)

    def _fail_all(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fail_streams)

    def _fail_streams(self) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put_nowait(StepResult(RequestOutput(rid, [], True, "abort")))


def _idle() -> None:
    pass


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
