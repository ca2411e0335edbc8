"""The non-driver ranks of a tensor-parallel worker: what each rank process runs (the driver
starts and stops them with engine.parallel.RankProcesses).

The driver (rank 0, the engine's own process) starts ranks 1..N-1 as ``python -m engine.tp_rank``
with the engine config as JSON on argv (nothing pickled), meets them on a file store in a
private directory (0700, removed when the ranks stop: no other user can join or read it; no
port), and from then on drives them with broadcasts: a fixed int64 header says what comes
next (engine/step_plan.py), then int64 payloads and, for KV writes, the KV bytes. Each rank
builds the same model slice and KV pool slice as the driver's ModelRunner and joins the same
collectives in the same order.

Lifecycle: the driver stops its ranks (``engine.parallel.RankProcesses.stop``: a STOP header, then SIGKILL after
a timeout); a rank dies with its driver (PR_SET_PDEATHSIG when started from the driver's main
thread, and a parent-pid watchdog either way). A rank that dies or stalls makes the driver's next
collective fail (``RankFailure``) instead of hanging it: every wait has a timeout
(``EngineConfig.tp_collective_timeout_s``), and a failed group's ranks are killed at once.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.settings import ENV
from pdserve.engine.parallel import RankFailure, TPGroup, open_store
from pdserve.engine.step_plan import HEADER_LEN, OP_PING, OP_READ_KV, OP_STEP, OP_STOP, OP_WRITE_KV, StepPlan

log = logging.getLogger(__name__)

RANK_IDLE_TIMEOUT_S = 7 * 24 * 3600.0   # a rank waits this long for the driver's next step


# ---- the rank process ----------------------------------------------------------------------
def _die_with_driver(driver_pid: int, pdeathsig: bool) -> None:
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:   # the driver may have died before the prctl, or forked us from a thread
        while os.getppid() == driver_pid:
            time.sleep(0.5)
        os._exit(1)
    if os.getppid() != driver_pid:
        os._exit(1)
    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def serve(runner) -> None:
    """Follow the driver's headers until STOP."""
    group: TPGroup = runner.tp
    dev = group.device
    while True:
        header_t = group.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=dev))
        header = header_t.tolist()
        op = header[0]
        if op == OP_STOP:
            return
        if op == OP_PING:
            continue
        if op == OP_STEP:
            payload = group.broadcast(torch.empty(StepPlan.payload_len(header), dtype=torch.int64, device=dev))
            runner.execute(StepPlan.decode(header, payload.cpu()))
        elif op == OP_WRITE_KV:
            entries = group.broadcast(torch.empty(3 * header[1], dtype=torch.int64, device=dev)).tolist()
            data = group.broadcast(torch.empty(header[2], dtype=runner.dtype, device=dev))
            runner.apply_kv_writes(entries, data)
        elif op == OP_READ_KV:
            ids = group.broadcast(torch.empty(header[1], dtype=torch.int64, device=dev))
            runner.gather_blocks(ids)
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.tp_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-path", required=True, help="the driver's file store (in a 0700 directory)")
    p.add_argument("--driver-pid", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--config", required=True, help="the driver's EngineConfig as JSON")
    p.add_argument("--pdeathsig", action="store_true")
    p.add_argument("--cpus", default="")
    args = p.parse_args(argv)
    _die_with_driver(args.driver_pid, args.pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C reaches the driver; it stops us
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    logging.basicConfig(level=ENV.LOG_LEVEL.get(),
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    torch.set_num_threads(config.num_threads or 1)

    store = open_store(args.store_path, args.size)
    store.set(f"up/{args.rank}", "1")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup(dist.PrefixStore("tp", store), args.rank, args.size, device, timeout_s=RANK_IDLE_TIMEOUT_S)
    runner = ModelRunner(config, ModelConfig.from_dir(config.model), group=group)
    try:
        serve(runner)
    except RankFailure as exc:   # the driver went away mid-collective
        log.warning("%s", exc)
        os._exit(1)
    group.shutdown()


if __name__ == "__main__":
    main()
