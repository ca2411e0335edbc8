"""The load generator's run loop: send a workload at its arrival schedule (optionally capped in
concurrency) through a backend, and report progress as requests end."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from typing import Sequence

from pdserve.services.loadtest.arrivals import arrival_offsets
from pdserve.services.loadtest.datasets import SampleRequest
from pdserve.services.loadtest.grpc_backend import GrpcBackend
from pdserve.services.loadtest.results import RequestResult, Sampling


class LoadProgress:
    """Requests done so far: a tqdm bar on a terminal; elsewhere (logs, pipes) a plain line at every
    10% and at the end, so that a file gets a few readable lines, not a stream of carriage returns."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None, stream=None, noun: str = "requests") -> None:
        self.total, self.desc, self.done, self.failed, self.noun = total, desc, 0, 0, noun
        self.stream = stream or sys.stderr
        tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False
        self.lines = enabled is not False and not tty      # plain lines instead of a bar
        self.bar = None
        self.t0 = time.perf_counter()
        self._next_line = 0.1
        if enabled is not False and tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="req" if noun == "requests" else noun, file=self.stream,
                            dynamic_ncols=True)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed, refresh=False)
        elif self.lines and (self.done >= self._next_line * self.total or self.done == self.total):
            while self._next_line * self.total <= self.done:
                self._next_line += 0.1
            print(f"{self.desc}: {self.done}/{self.total} {self.noun} done ({self.failed} failed, "
                  f"{time.perf_counter() - self.t0:.1f}s)", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.asynccontextmanager
async def not_closed(backend):
    """A backend its caller owns, as a context that leaves it open."""
    yield backend


async def run_load(address: str, requests: Sequence[SampleRequest], *, rate: float, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, sampling: Sampling | None = None,
                   timeout: float | None = 600.0, tag: str = "bench",
                   progress: LoadProgress | None = None, backend=None,
                   offsets: Sequence[float] | None = None) -> tuple[list[RequestResult], float]:
    """Send requests at the arrival schedule; returns (results in request order, duration s).
    progress: told as each request ends. backend: an OpenAIBackend (openai_backend.py);
    None: the router's gRPC API at address. offsets: the send times (s after the start; a
    trace's), instead of a schedule drawn at rate."""
    sampling = sampling or Sampling()
    offsets = list(offsets) if offsets is not None else arrival_offsets(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_id = uuid.uuid4().hex[:8]
    async with (GrpcBackend(address, timeout) if backend is None else not_closed(backend)) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rid = f"{tag}-{run_id}-{i}"
            if sem is None:
                res = await client.send(requests[i], rid, sampling, start)
            else:
                async with sem:
                    res = await client.send(requests[i], rid, sampling, start)
            if progress is not None:
                progress.update(res.success)
            return res

        try:
            results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        finally:
            if progress is not None:
                progress.close()
        duration = time.perf_counter() - start
    return list(results), duration

