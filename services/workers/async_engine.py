"""Runs an LLMEngine on its own thread and exposes it to asyncio services.

The engine thread does nothing but step. Everything else (add, abort, reserve, KV writes,
status) is a direct call from the event loop under the engine's lock, which a step holds
only while it schedules and applies results: no call waits for a forward pass, and new
work joins the next step. Step outputs are routed to one asyncio queue per request; the
``request`` context manager pairs opening a request with aborting it if the caller leaves
early, so no request outlives its RPC. Each turn of the loop (a step, or an idle wait) renews
``heartbeat``, which the worker's StallWatchdog (lifecycle.py) reads.
"""
from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.kv.connector import KVConnector
from pdserve.engine.kv.handoff import HandoffState, LeasePolicy, Reservation
from pdserve.engine.parallel import RankFailure
from pdserve.engine.settings import ENV
from pdserve.engine.structured.constraints import COMPILE_TIMEOUT_S
from pdserve.services.common.change_signal import ChangeSignal

log = logging.getLogger(__name__)

IDLE_WAKE_S = 0.05   # an idle engine thread still wakes this often to expire leases
EXPORT_RUN_BYTES = 32 << 20  # a finished prefill's KV beyond this is copied out after its first token, this much
                             # at a time (a 131 MiB copy held the first token 0.2-0.8 s); up to it, at once, before
                             # the token (~10 ms; deferring 9 MiB cost its hand-off 10-30 ms on 2 cores)
TEST_HANG_MAX_S = 600.0   # the test hook's hang ends after this at most


@dataclass(slots=True)
class StepTime:
    """One engine step as the engine thread lived it: wall seconds (what the batch waited) and the
    thread's CPU seconds (what it computed; less when other threads held its core)."""

    wall_s: float
    cpu_s: float


@dataclass(slots=True)
class StepResult:
    """One engine output, with exported KV blocks attached in the prefill role."""

    output: RequestOutput
    # The ready blocks as (head_start, head_end, [len(output.ready_blocks), *block_shape with those
    # KV heads]) per tensor-parallel slice (one piece, every head, without tensor parallelism); on CPU.
    # None on a finished prefill of more than AsyncEngine.export_run_bytes: export_blocks reads them.
    blocks: list[tuple[int, int, torch.Tensor]] | None = None


class RequestStream:
    """The outputs of one request, as they come. ``async with`` it: leaving the block before
    the request finished aborts it on the engine, so no request outlives its caller."""

    def __init__(self, aengine: "AsyncEngine", request_id: str) -> None:
        self.aengine = aengine
        self.request_id = request_id
        self.queue: asyncio.Queue[StepResult] = asyncio.Queue()
        self.finished = False

    async def get(self, timeout: float | None = None) -> StepResult:
        """The next output; raises asyncio.TimeoutError after timeout seconds without one."""
        res = await (asyncio.wait_for(self.queue.get(), timeout) if timeout else self.queue.get())
        if res.output.finished or res.output.prefill_done:
            self.finished = True
        return res

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.aengine._close(self)


class AsyncEngine:
    def __init__(self, config: EngineConfig, lease: LeasePolicy | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput], StepTime], None] | None = None) -> None:
        self.engine = LLMEngine(config, lease=lease)
        self.config = config
        self.on_step = on_step
        self.export_run_bytes = EXPORT_RUN_BYTES
        # Called on the event loop when the engine can never step again (a tensor-parallel rank died);
        # failure then holds why.
        self.on_fatal: Callable[[], None] | None = None
        self.failure: RankFailure | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        self._kv_waiters: dict[str, list[asyncio.Future[HandoffState]]] = {}
        self._status = ChangeSignal()
        self.connector.subscribe(on_change=self._on_kv_change)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # grammar compiles, one at a time: one that runs away holds only constrained requests back
        self._compiles = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        # Monotonic time of the engine loop's last progress: a step completed, or an idle wait
        # (IDLE_WAKE_S) ended with no work. A StallWatchdog (lifecycle.py) reads it.
        self.heartbeat = time.monotonic()
        self._hang_file = hang_file_for_tests()

    @property
    def connector(self) -> KVConnector:
        """The engine's KV connector, the hand-off's one owner: services call its public methods only."""
        return self.engine.kv

    # ---- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.heartbeat = time.monotonic()
        self._thread.start()

    @property
    def thread_ident(self) -> int | None:
        """The engine thread's id (to find its stack in sys._current_frames())."""
        return self._thread.ident

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.engine.close()   # the tensor-parallel ranks, if any
        self._compiles.shutdown(wait=False, cancel_futures=True)

    # ---- requests ---------------------------------------------------------------------
    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile params' structured-output constraint off the event loop (add and reserve then
        find it in the cache). Raises ValueError if it does not compile within COMPILE_TIMEOUT_S."""
        if params.structured_outputs is None:
            return
        future = asyncio.get_running_loop().run_in_executor(self._compiles, self.engine.compile_grammar, params)
        try:
            await asyncio.wait_for(future, COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ValueError(f"structured_outputs.{params.structured_outputs.kind()[0]} did not compile within "
                             f"{COMPILE_TIMEOUT_S:g} s") from None

    def add(self, request_id: str, prompt: Seq[int], params: SamplingParams,
            output_token_ids: Seq[int] = ()) -> RequestStream:
        """Queue a request (it joins the next step) and return its output stream.
        Raises ValueError (bad request, or id in use)."""
        stream = self._open(request_id)
        try:
            self.engine.add_request(request_id, prompt, params, output_token_ids)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wake.set()
        self.status_changed()
        return stream

    def admit(self, request_id: str, first_token: int) -> tuple[RequestStream, str | None]:
        """Decode role: admit a request whose KV is READY. Returns its stream and the finish
        reason if the first token already ended it. Raises HandoffError / ValueError."""
        stream = self._open(request_id)
        try:
            reason = self.engine.admit(request_id, first_token)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        stream.finished = reason is not None
        self._wake.set()
        self.status_changed()
        return stream, reason

    def reserve(self, request_id: str, prompt: Seq[int], params: SamplingParams, output_token_ids: Seq[int] = (),
                lease_s: float | None = None) -> Reservation:
        """Decode role: reserve blocks for a sequence whose KV will arrive (LLMEngine.reserve).
        Raises NoCapacity / ValueError."""
        reservation = self.engine.reserve(request_id, prompt, params, output_token_ids, lease_s=lease_s)
        self.status_changed()
        return reservation

    def release(self, request_id: str) -> bool:
        """Prefill role: the finished prefill's pinned blocks were delivered (or will not be): they
        fall back to the prefix cache."""
        return self.engine.release(request_id)

    def _open(self, request_id: str) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(self, request_id)
        return stream

    def _close(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        if not stream.finished:
            self.engine.abort(stream.request_id)
            self.status_changed()

    def abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(StepResult(RequestOutput(request_id, [], True, "abort")))
        self.status_changed()
        return found

    def busy_reasons(self) -> list[str]:
        """What keeps the engine from switching roles ([]: idle): its own, and request streams
        still open here (a caller not yet done with its outputs)."""
        streams = [f"{len(self._streams)} request stream(s) open"] if self._streams else []
        return [*self.engine.busy_reasons(), *streams]

    def set_role(self, role: str) -> None:
        """Switch the engine's role (LLMEngine.set_role) from the event loop: under the engine
        lock, which the engine thread holds whenever it schedules or applies a step, so the
        switch falls between two steps. Raises ValueError if anything is still here."""
        busy = self.busy_reasons()
        if busy:
            raise ValueError(f"cannot switch role {self.config.role!r} -> {role!r} while requests are here: "
                             f"{', '.join(busy)}")
        self.engine.set_role(role)
        self._wake.set()
        self.status_changed()

    # ---- KV hand-off ------------------------------------------------------------------
    async def wait_kv(self, request_id: str, timeout: float) -> HandoffState | None:
        """Wait until the request's KV is READY, or its hand-off ended (FAILED / EXPIRED / gone: None)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[HandoffState] = loop.create_future()
        with self.engine.lock:
            state = self.connector.state(request_id)
            if state not in (HandoffState.RESERVED, HandoffState.RECEIVING):
                return state
            self._kv_waiters.setdefault(request_id, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self.connector.state(request_id)
        finally:
            waiters = self._kv_waiters.get(request_id)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._kv_waiters[request_id]

    def _on_kv_change(self, request_id: str, state: HandoffState) -> None:
        """Called under the engine lock, from whichever thread changed the state."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._resolve_kv, request_id, state)

    def _resolve_kv(self, request_id: str, state: HandoffState) -> None:
        for fut in self._kv_waiters.pop(request_id, []):
            if not fut.done():
                fut.set_result(state)
        self.status_changed()

    # ---- status -----------------------------------------------------------------------
    def status_changed(self) -> None:
        """Wake WatchStatus streams (call on the event loop)."""
        self._status.notify()

    async def wait_status_change(self, timeout: float) -> None:
        await self._status.wait(timeout)

    # ---- the engine thread --------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self.heartbeat = time.monotonic()
            if not engine.has_unfinished_requests():
                self._wake.wait(IDLE_WAKE_S)
                self._wake.clear()
                with engine.lock:
                    if self.connector.expire():
                        self._call_soon(self.status_changed)
                if self.failure is None:
                    try:
                        engine.check_ranks()   # a rank that dies while idle fails the worker now
                    except RankFailure as exc:
                        self._fatal(exc)
                continue
            if self._hang_file is not None:
                self._hang_while_asked()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                outputs = engine.step()
            except RankFailure as exc:   # this worker cannot step again: fail everything, stop serving
                self._fatal(exc)
                continue
            except Exception:  # a failing step must not hang every caller
                log.exception("engine step failed")
                self._fail_all()
                continue
            results = self._collect(outputs)
            if self.on_step is not None:   # before delivery: a caller that got its tokens finds them counted
                self.on_step(engine, outputs, StepTime(time.perf_counter() - t0, time.thread_time() - c0))
            self._call_soon(self._deliver, results)

    def _hang_while_asked(self) -> None:
        """Tests only ($PDSERVE_TEST_ENGINE_HANG_DIR): while this process's hang file exists, block
        here holding the engine lock, as a step stuck in a blocking read would (TEST_HANG_MAX_S at most)."""
        deadline = time.monotonic() + TEST_HANG_MAX_S
        if not _owned_regular_file(self._hang_file):
            return
        log.warning("test hook: engine thread hanging while %s exists", self._hang_file)
        with self.engine.lock:
            while not self._stopping and time.monotonic() < deadline and _owned_regular_file(self._hang_file):
                time.sleep(0.05)

    def _fatal(self, exc: RankFailure) -> None:
        """The engine can never step again: fail every request; the first time, tell on_fatal."""
        self._fail_all()
        if self.failure is None:
            log.error("engine failed: %s", exc)
            self.failure = exc
            if self.on_fatal is not None:
                self._call_soon(self.on_fatal)

    def _call_soon(self, fn: Callable, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop closed while the thread was stepping
            self._stopping = True

    def _collect(self, outputs: list[RequestOutput]) -> list[StepResult]:
        """Copy each output's newly exportable blocks now, before a later step could free them (a
        prompt still running may be preempted). A finished prefill's blocks are pinned until
        release(): more than export_run_bytes of them the caller exports after sending the first
        token (export_blocks), which so never waits for a long copy."""
        results = []
        per_block = self.connector.bytes_per_block
        with self.engine.lock:
            for out in outputs:
                deferred = out.prefill_done and len(out.ready_blocks) * per_block > self.export_run_bytes
                read = out.ready_blocks and not deferred
                blocks = self.connector.read_block_pieces(out.request_id, out.ready_blocks) if read else None
                results.append(StepResult(out, blocks))
        return results

    @property
    def export_run_blocks(self) -> int:
        """How many blocks export_run_bytes holds (at least one): a deferred export's run."""
        return max(1, self.export_run_bytes // self.connector.bytes_per_block)

    async def export_blocks(self, request_id: str, block_indices: list[int], views: bool = False
                            ) -> list[tuple[int, int, torch.Tensor]] | None:
        """A finished prefill's pinned blocks, as StepResult.blocks. views: as views into the pool
        where it can give them (for a sender that copies each block as it frames it, and stops
        reading them before its cancel returns: KVStream.takes_views); else copied in a thread under
        the engine lock (never beside a step). None: the request was aborted meanwhile."""
        if views:
            with self.engine.lock:
                pinned = self.connector.pinned_views(request_id, block_indices)
            if pinned is not None:
                return pinned

        def read() -> list[tuple[int, int, torch.Tensor]] | None:
            with self.engine.lock:
                return self.connector.read_block_pieces(request_id, block_indices)
        return await asyncio.to_thread(read)

    def _deliver(self, results: list[StepResult]) -> None:
        for res in results:
            stream = self._streams.get(res.output.request_id)
            if stream is not None:
                stream.queue.put_nowait(res)
        self.status_changed()

    def _fail_all(self) -> None:
        with self.engine.lock:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        self._call_soon(self._fail_streams)

    def _fail_streams(self) -> None:
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(StepResult(RequestOutput(rid, [], True, "abort")))


def hang_file_for_tests() -> str | None:
    """The file whose existence hangs this process's engine thread ($PDSERVE_TEST_ENGINE_HANG_DIR/
    engine-hang-PID), or None: the hook is off (always, unless a test set the variable)."""
    directory = ENV.TEST_ENGINE_HANG_DIR.get()
    return None if directory is None else os.path.join(directory, f"engine-hang-{os.getpid()}")


def _owned_regular_file(path: str) -> bool:
    """path is a regular file (not a link) owned by this process's user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
