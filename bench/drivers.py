"""What the bench/ drivers share: their argument parsers (typed flags from defaults, the serving
workload's flags), a comma list checked against known names, and one `pdserve up` child process
started and stopped as a whole, after the machine quietened down; one timed push of KV blocks
over an opened KV stream; the best time of a few calls."""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A driver's parser, described by the first paragraph of its module docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def add_flags(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """--some-name for each some_name=default, of the default's type (None: a string)."""
    for name, default in defaults.items():
        kind = str if default is None else type(default)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default)


def add_load_flags(p: argparse.ArgumentParser, seed_help: str | None = None) -> None:
    """The serving workload of the comparison drivers: random prompts at a Poisson rate."""
    add_flags(p, num_prompts=100, request_rate=4.0, input_len=256, output_len=128, num_warmups=2)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--result-dir", default=None, help="default: a new folder under /tmp")


def names(text: str, known: Iterable[str], what: str) -> list[str]:
    """A comma list, each a known name (else SystemExit naming the choices)."""
    known = list(known)
    out = [n for n in text.split(",") if n]
    for n in out:
        if n not in known:
            raise SystemExit(f"unknown {what} {n!r}; choose from {', '.join(known)}")
    return out


def model_dir(given: str | None) -> str:
    """--model, else the deterministic ``small`` checkpoint (made once under $PDSERVE_HOME)."""
    if given:
        return str(given)
    from pdserve.engine.model_maker import ensure_model
    return str(ensure_model("small"))


def result_dir(given: str | None, name: str) -> Path:
    """--result-dir, else a new folder /tmp/pdserve-NAME-<time>; made if missing."""
    out = Path(given or f"/tmp/pdserve-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    return out


def model_and_results(args: argparse.Namespace, name: str) -> tuple[str, Path]:
    """A comparison run's model (--model, else the small one) and result folder (--result-dir, else
    a new /tmp/pdserve-NAME-<time>)."""
    return model_dir(args.model), result_dir(args.result_dir, name)


def start_up(cmd: list[str], log_path: Path, label: str) -> subprocess.Popen:
    """`pdserve up` (cmd) from this checkout in its own session, its output in log_path."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"{label} {shlex.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_up(popen: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (`pdserve up` stops its router and workers), then SIGKILL to the group after timeout."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> None:
    """On a shared machine: wait (bounded) until the 1-minute load average drops to max_load."""
    if max_load is None:
        return
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        print(f"waiting for the machine to quiet down: load {os.getloadavg()[0]:.2f} > {max_load}", flush=True)
        time.sleep(15)


async def timed_push(stream: Any, blocks: list, settle_s: float, timeout: float) -> tuple[Any, float]:
    """(SendResult, seconds) of one KV stream's send of blocks through finish's acknowledgement.
    The stream is opened and heard from first (a heartbeat, settle_s to connect), as a prefill
    worker's stream is while its prompt computes; on any failure it is cancelled (no call, nor
    shared-memory segment, left behind)."""
    import asyncio

    try:
        await stream.heartbeat()
        await asyncio.sleep(settle_s)
        t0 = time.perf_counter()
        await stream.send(blocks)
        result = await stream.finish(timeout=timeout)
        return result, time.perf_counter() - t0
    except BaseException:
        await stream.cancel()
        raise


def best_ms(fn, iters: int) -> float:
    """The fastest of iters calls of fn (after one untimed call), in ms."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3
