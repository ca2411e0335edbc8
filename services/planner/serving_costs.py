"""What serving costs around the engine: CPU time per token and per KV block, measured in a real
deployment.

An engine step is not the only thing that runs on a worker's core. The worker's event loop
streams each token to the router and writes each received KV block into the pool; the router
(pinned to the last decode worker's cores when no core is spare, see ``Launcher._cores``) handles
every token again. ``measure`` starts ``pdserve up`` colocated and then 1P1D with the profiled
engine settings, sends a short load through the router, and reads every process's
``process_cpu_seconds_total`` and the workers' ``pdserve:engine_step_cpu_seconds_total`` from
/metrics before and after: a process's CPU time outside engine steps, per token it served, per
request and per KV block it sent or received, is what the simulator charges to that process's core.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from pdserve.services.client import AsyncClient
from pdserve.services.common.metrics import scrape_by_name
from pdserve.services.deployment.launcher import wait_serving


# Disaggregated: every prompt prefilled on the prefill worker and its KV shipped (the hand-off's
# costs are what this setup measures; under conditional disaggregation the router may keep a
# prompt on the decode worker, and a loaded machine makes that likelier).
SETUPS = {"colocated": ["--colocated-workers", "1"],
          "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "always"]}
COUNTERS = ("process_cpu_seconds_total", "pdserve:engine_step_cpu_seconds_total", "pdserve:engine_step_seconds_count",
            "pdserve:generation_tokens_total", "pdserve:kv_transfer_bytes_total")   # what is read and kept


@dataclass(slots=True)
class ServingCosts:
    """CPU seconds spent outside engine steps while serving (0 everywhere: not measured)."""

    worker_s_per_token: float = 0.0            # a worker's event loop, per token it emits
    decode_s_per_block_received: float = 0.0   # a decode worker, per KV block it receives (beyond the tokens)
    decode_s_per_request: float = 0.0          # a decode worker, per request handed to it (RPCs, stream set-up)
    prefill_s_per_block_sent: float = 0.0      # a prefill worker, per KV block it sends
    prefill_s_per_request: float = 0.0         # a prefill worker, per prompt (RPCs, stream set-up)
    router_s_per_token: dict[str, float] = field(default_factory=dict)   # setup -> router, per token streamed
    measured: dict[str, Any] = field(default_factory=dict)              # the raw counts, per setup

    def router(self, colocated: bool) -> float:
        return self.router_s_per_token.get("colocated" if colocated else "disaggregated", 0.0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> "ServingCosts":
        return cls(**obj) if obj else cls()

    def describe(self) -> str:
        return (f"  serving (CPU outside engine steps): worker {self.worker_s_per_token * 1e3:.3f} ms/token; router "
                f"{', '.join(f'{k} {v * 1e3:.3f}' for k, v in self.router_s_per_token.items()) or '-'} ms/token; "
                f"prefill {self.prefill_s_per_request * 1e3:.2f} ms/request + {self.prefill_s_per_block_sent * 1e3:.3f} "
                f"ms/KV block sent; decode {self.decode_s_per_request * 1e3:.2f} ms/request + "
                f"{self.decode_s_per_block_received * 1e3:.3f} ms/KV block received")


def _free_port_base(n: int) -> int:
    """A port P with P..P+n-1 all free on 127.0.0.1, below Linux's ephemeral range (32768+), where
    the deployment's own outgoing connections cannot take one before its server binds it."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports for the metrics endpoints")


async def _load(address: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> int:
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout=300) as client:
        async def one(p: list[int]) -> int:
            async with gate:
                out = await client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                return len(out.token_ids)
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def _run_setup(setup: str, model: str, engine_args: list[str], loads: dict[str, list[list[int]]], max_tokens: int,
               concurrency: int, log_path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Start `pdserve up`, serve each load in turn; per load, each process's counter deltas."""
    names = ["router", *(["both-0"] if setup == "colocated" else ["prefill-0", "decode-0"])]
    port = _free_port_base(len(names) + 1)
    base = port + 1
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--http-port", "none", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port-base", str(base), *SETUPS[setup], *engine_args]
    with open(log_path, "w") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    runs: dict[str, dict[str, dict[str, float]]] = {}
    try:
        wait_serving(f"127.0.0.1:{port}", popen, timeout=300)
        ports = {name: base + i for i, name in enumerate(names)}
        first = next(iter(loads.values()))
        asyncio.run(_load(f"127.0.0.1:{port}", first[:2], 4, 2))   # warm-up: first steps initialise lazily
        for label, prompts in loads.items():
            time.sleep(0.5)   # KV acknowledgements and the last deliveries settle
            before = {name: scrape_by_name(f"127.0.0.1:{p}") for name, p in ports.items()}
            tokens = asyncio.run(_load(f"127.0.0.1:{port}", prompts, max_tokens, concurrency))
            time.sleep(0.5)
            after = {name: scrape_by_name(f"127.0.0.1:{p}") for name, p in ports.items()}
            runs[label] = {name: {k: after[name].get(k, 0.0) - before[name].get(k, 0.0) for k in COUNTERS
                                  if k in after[name]} for name in names}
            runs[label]["client"] = {"tokens": float(tokens), "requests": float(len(prompts))}
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)   # `pdserve up` stops its router and workers
            try:
                popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    return runs


def _outside_engine(d: dict[str, float]) -> float:
    return max(0.0, d.get("process_cpu_seconds_total", 0.0) - d.get("pdserve:engine_step_cpu_seconds_total", 0.0))


def _per_request_and_block(cpu: list[float], requests: list[float], blocks: list[float]) -> tuple[float, float]:
    """Solve cpu_i = a * requests_i + b * blocks_i over two loads (a, b >= 0)."""
    (c1, c2), (r1, r2), (b1, b2) = cpu, requests, blocks
    det = r1 * b2 - r2 * b1
    if abs(det) < 1e-9:
        return 0.0, max(0.0, (c1 + c2) / max(1.0, b1 + b2))
    a = (c1 * b2 - c2 * b1) / det
    b = (r1 * c2 - r2 * c1) / det
    if a < 0:
        return 0.0, max(0.0, (c1 + c2) / max(1.0, b1 + b2))
    if b < 0:
        return max(0.0, (c1 + c2) / max(1.0, r1 + r2)), 0.0
    return a, b


def measure(model: str, engine_args: list[str], kv_bytes_per_block: int, vocab_size: int, log_dir: Path,
            num_requests: int = 16, prompt_lens: tuple[int, int] = (64, 384), max_tokens: int = 64,
            concurrency: int = 8, say: Callable[[str], None] = print) -> ServingCosts:
    """Serve the same loads colocated and 1P1D (short prompts, then long ones: per request and per
    KV block costs apart) and derive the per-token, per-request and per-block costs."""
    rng = random.Random(0)
    loads = {f"prompt{n}": [[rng.randrange(2, vocab_size) for _ in range(n)] for _ in range(num_requests)]
             for n in prompt_lens}
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for setup in SETUPS:
        t0 = time.perf_counter()
        runs[setup] = _run_setup(setup, model, engine_args, loads, max_tokens, concurrency,
                                 log_dir / f"serving-{setup}.log")
        say(f"  serving costs, {setup}: {sum(r['client']['tokens'] for r in runs[setup].values()):.0f} tokens "
            f"({time.perf_counter() - t0:.0f}s)")
    col = list(runs["colocated"].values())
    dis = list(runs["disaggregated"].values())
    per_token = (sum(_outside_engine(r["both-0"]) for r in col)
                 / max(1.0, sum(r["both-0"].get("pdserve:generation_tokens_total", 0.0) for r in col)))
    bpb = max(1, kv_bytes_per_block)
    requests = [r["client"]["requests"] for r in dis]
    # a decode worker: its CPU outside steps less what its tokens cost (as a colocated worker's)
    dec_cpu = [_outside_engine(r["decode-0"]) - per_token * r["decode-0"].get("pdserve:generation_tokens_total", 0.0)
               for r in dis]
    dec_blocks = [r["decode-0"].get("pdserve:kv_transfer_bytes_total", 0.0) / bpb for r in dis]
    decode_req, decode_block = _per_request_and_block(dec_cpu, requests, dec_blocks)
    pre_cpu = [_outside_engine(r["prefill-0"]) for r in dis]
    pre_blocks = [r["prefill-0"].get("pdserve:kv_transfer_bytes_total", 0.0) / bpb for r in dis]
    prefill_req, prefill_block = _per_request_and_block(pre_cpu, requests, pre_blocks)
    router = {setup: sum(r["router"].get("process_cpu_seconds_total", 0.0) for r in run.values())
              / max(1.0, sum(r["router"].get("pdserve:generation_tokens_total", 0.0) for r in run.values()))
              for setup, run in runs.items()}
    return ServingCosts(worker_s_per_token=per_token, decode_s_per_block_received=decode_block,
                        decode_s_per_request=decode_req, prefill_s_per_block_sent=prefill_block,
                        prefill_s_per_request=prefill_req, router_s_per_token=router, measured=runs)
