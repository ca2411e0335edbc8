#!/usr/bin/env python
"""KV hand-off through Ray's object store against gRPC: the same blocks into the same decode engine.

A loopback-only local Ray cluster (token authentication with a throwaway token, no dashboard,
every server on 127.0.0.1) holds two actors:

* decode: a real decode-role ``LLMEngine`` (the ``small`` model unless --model). Its KV
  connector (engine/kv/connector.py) is the sink of both receivers it serves: a gRPC
  ``KVTransfer`` server on 127.0.0.1 (``KVTransferServicer`` behind the cluster-token
  interceptor, as a decode worker runs it) and ``RayKVReceiver`` (its ``push_blocks``,
  ``kv_heartbeat`` and ``kv_cancel`` methods, as ``services.ray_deploy.actors.WorkerActor``).
* prefill: for every push asks the decode actor for a reservation of a fresh random prompt
  (so no prefix-cache hit skips a block), opens the request's stream (as a prefill worker does
  when the request arrives) and times from ``send`` of every block to the acknowledgement of
  ``finish``: the blocks are checksummed, moved, checked by the connector (token, index, chain
  hash, layout, CRC-32) and written into the paged pool. Then the decode actor confirms the
  request is READY and aborts it, so its blocks go back to the pool.

The transports take turns on the same block bytes (random, made once per prompt length):

* ray:  ``RayKVSender`` (one ``ray.put`` of raw uint8 arrays per ~32 MiB chunk, the decode
  actor's ``push_blocks``) -> ``RayKVReceiver``;
* grpc: ``GrpcKVSender`` -> ``KVTransfer.PushBlocks``, payload inside the stream's frames;
* grpc-shm (only if asked with --transports): the same with payloads through /dev/shm
  segments for sends of at least 1 MiB, what a decode worker on the same host gets by default.

Printed: one row per prompt length (markdown): KV MiB per request, the median milliseconds and
MiB/s of each transport, and ray/grpc (MiB/s of Ray over MiB/s of gRPC: above 1, Ray is faster).
The decode pool's free blocks are checked back at their baseline after each length, and the
cluster is stopped at the end (its process group checked empty). Example::

    python bench/kv_transport_ray_vs_grpc.py                        # 128, 1024, 4000 tokens
    python bench/kv_transport_ray_vs_grpc.py --tokens 256 --iters 50 --transports ray,grpc,grpc-shm
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers  # noqa: E402

MiB = 1 << 20
NAMESPACE = "pdserve-bench"
DECODE_ACTOR = "bench-kv-decode"
TRANSPORTS = ("ray", "grpc", "grpc-shm")


class DecodeActor:
    """The decode side: one engine, its KV connector behind a gRPC KVTransfer server and the Ray receiver."""

    async def __init__(self, model: str, num_kv_blocks: int, cluster_token: str) -> None:
        import torch

        from pdserve.engine import EngineConfig, LLMEngine
        from pdserve.services.kv_transfer import KVTransferServicer, register_kv_servicer
        from pdserve.services.kv_transfer import shared_memory
        from pdserve.services.kv_transfer.ray_transport import RayKVReceiver
        from pdserve.services.common.security import Credentials
        from pdserve.services.common.grpc_setup import start_server

        torch.set_num_threads(1)
        self.engine = LLMEngine(EngineConfig(model=model, role="decode", num_kv_blocks=num_kv_blocks, num_threads=1))
        kv = self.engine.kv
        self.receiver = RayKVReceiver(kv, cluster_token=cluster_token)
        servicer = KVTransferServicer(kv, shared_memory=shared_memory.available(), cluster_token=cluster_token)
        self.server = await start_server(
            [(lambda s, server: register_kv_servicer(s, server), servicer, "pdserve.v1.KVTransfer")],
            "127.0.0.1", 0, interceptors=Credentials(cluster_token).server_interceptors())

    async def info(self) -> dict[str, Any]:
        import ray

        runner = self.engine.runner
        return {"grpc_address": f"127.0.0.1:{self.server.port}", "block_size": self.engine.config.block_size,
                "block_shape": list(runner.block_shape), "kv_dtype": runner.kv_dtype_name,
                "block_bytes": runner.kv_bytes_per_block, "vocab_size": self.engine.model_config.vocab_size,
                "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}

    async def stats(self) -> dict[str, int]:
        return self.engine.stats()

    async def reserve(self, request_id: str, prompt: list[int]) -> dict[str, Any]:
        from pdserve.engine import SamplingParams

        res = self.engine.reserve(request_id, prompt, SamplingParams(max_tokens=1))
        return {"needed": list(res.needed_block_indices), "token": res.transfer_token}

    async def release(self, request_id: str) -> str:
        """The request's hand-off state, then abort it (its blocks back to the pool)."""
        state = self.engine.kv.state(request_id)
        self.engine.abort(request_id)
        return "none" if state is None else state.value

    # the object-store transport's receiving end, as WorkerActor has it
    async def push_blocks(self, open_bytes: bytes, headers: list[bytes], refs: list[Any]) -> bytes:
        return await self.receiver.push_blocks(open_bytes, headers, refs)

    async def kv_heartbeat(self, open_bytes: bytes) -> None:
        self.receiver.heartbeat(open_bytes)

    async def kv_cancel(self, open_bytes: bytes) -> None:
        self.receiver.cancel(open_bytes)

    async def stop(self) -> None:
        await self.server.server.stop(None)


class PrefillActor:
    """The prefill side: reserves through the decode actor and pushes through each sender."""

    async def __init__(self, decode: Any, info: dict[str, Any], cluster_token: str, ray_chunk_bytes: int,
                       grpc_frame_bytes: int) -> None:
        import torch

        from pdserve.services.kv_transfer import GrpcKVSender
        from pdserve.services.kv_transfer.grpc_transport import grpc_message_limit
        from pdserve.services.kv_transfer.ray_transport import RayKVSender, ray_kv_address
        from pdserve.services.common.security import Credentials
        from pdserve.services.common.grpc_setup import options

        torch.set_num_threads(1)
        self.decode = decode
        self.info = info
        creds = Credentials(cluster_token)
        limit = [("grpc.max_send_message_length", grpc_message_limit(grpc_frame_bytes))]

        def channel(address: str):   # as serve_worker makes a prefill worker's KV channels
            return creds.channel(address, options(limit), attach_token=False)

        self.senders = {
            "ray": RayKVSender(default_namespace=NAMESPACE, chunk_bytes=ray_chunk_bytes, cluster_token=cluster_token),
            **{name: GrpcKVSender(channel, proof=creds.call_proof, frame_bytes=grpc_frame_bytes, shared_memory=shm,
                                  cluster_token=cluster_token)
               for name, shm in (("grpc", False), ("grpc-shm", True))},
        }
        self.targets = {"ray": ray_kv_address(DECODE_ACTOR, NAMESPACE), "grpc": info["grpc_address"],
                        "grpc-shm": info["grpc_address"]}
        self.rng = random.Random(time.time_ns())
        self.pushes = 0

    async def run(self, tokens: int, iters: int, warmup: int, transports: list[str]) -> dict[str, Any]:
        """iters timed pushes per transport (after warmup each), taking turns; seconds per push."""
        import torch

        from pdserve.services.kv_transfer.base import SUPPORTED_DTYPES

        info = self.info
        n_blocks = -(-tokens // info["block_size"])
        gen = torch.Generator().manual_seed(tokens)
        dtype = SUPPORTED_DTYPES[info["kv_dtype"]]
        data = [torch.randn(info["block_shape"], generator=gen).to(dtype) for _ in range(n_blocks)]
        times: dict[str, list[float]] = {t: [] for t in transports}
        nbytes = 0
        for i in range(warmup + iters):
            for t in (transports if i % 2 == 0 else transports[::-1]):   # neither always goes first
                seconds, nbytes = await self._push(t, tokens, data)
                if i >= warmup:
                    times[t].append(seconds)
        return {"seconds": times, "bytes": nbytes, "blocks": n_blocks}

    async def _push(self, transport: str, tokens: int, data: list[Any]) -> tuple[float, int]:
        from pdserve.engine.kv.block_manager import transfer_block_hashes
        from pdserve.services.kv_transfer import KVBlock

        bs = self.info["block_size"]
        prompt = [self.rng.randrange(2, self.info["vocab_size"]) for _ in range(tokens)]   # fresh: no cache hit
        self.pushes += 1
        rid = f"bench-{transport}-{tokens}-{self.pushes}"
        res = await self.decode.reserve.remote(rid, prompt)
        try:
            if res["needed"] != list(range(len(data))):
                raise RuntimeError(f"{rid}: reservation needs blocks {res['needed'][:8]}..., not all "
                                   f"{len(data)} (a prefix-cache hit?)")
            hashes = transfer_block_hashes(prompt, bs)
            blocks = [KVBlock(rid, j, hashes[j], data[j]) for j in res["needed"]]
            # The stream opens when the request arrives, while the prompt computes (as a prefill
            # worker does); the time runs from the moment the blocks are ready to the acknowledgement.
            stream = self.senders[transport].open(self.targets[transport], rid, res["token"])
            result, seconds = await drivers.timed_push(stream, blocks, settle_s=0.005, timeout=60)
        finally:
            state = await self.decode.release.remote(rid)   # READY -> aborted: the blocks go back
        if result.blocks != len(blocks) or state != "ready":
            raise RuntimeError(f"{transport} {rid}: {result.blocks}/{len(blocks)} blocks acknowledged, "
                               f"decode side {state}")
        return seconds, result.bytes

    async def pid(self) -> int:
        return os.getpid()

    async def close(self) -> None:
        for sender in self.senders.values():
            await sender.close()


def _ray_left(pgid: int, pids: list[int], wait_s: float = 15.0) -> list[str]:
    """What is still running of the stopped cluster: its head's process group, and the actors'
    worker processes (Ray starts each worker in a session of its own), after up to wait_s."""
    from pdserve.services.common.process_table import group_running, is_alive

    deadline = time.monotonic() + wait_s
    while True:
        left = ([f"process group {pgid}"] if group_running(pgid) else []) + [f"pid {p}" for p in pids if is_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _row(tokens: int, run: dict[str, Any], transports: list[str]) -> dict[str, Any]:
    mib = run["bytes"] / MiB
    row: dict[str, Any] = {"tokens": tokens, "blocks": run["blocks"], "kv_mib": mib}
    for t in transports:
        ms = statistics.median(run["seconds"][t]) * 1e3
        row[t] = {"median_ms": ms, "mib_per_s": mib / (ms / 1e3), "min_ms": min(run["seconds"][t]) * 1e3,
                  "max_ms": max(run["seconds"][t]) * 1e3}
    for t in transports[1:]:
        row[f"ray_over_{t}"] = row["ray"]["mib_per_s"] / row[t]["mib_per_s"] if "ray" in row else None
    return row


def _table_header(transports: list[str]) -> str:
    cols = ["prompt tokens", "KV MiB"]
    for t in transports:
        cols += [f"{t} median ms", f"{t} MiB/s"]
    cols += [f"ray/{t} (MiB/s)" for t in transports if t != "ray"] if "ray" in transports else []
    return "| " + " | ".join(cols) + " |\n|" + "---:|" * len(cols)


def _table_row(row: dict[str, Any], transports: list[str]) -> str:
    cells = [str(row["tokens"]), f"{row['kv_mib']:.2f}"]
    for t in transports:
        cells += [f"{row[t]['median_ms']:.2f}", f"{row[t]['mib_per_s']:.0f}"]
    if "ray" in transports:
        cells += [f"{row[f'ray_over_{t}']:.2f}" for t in transports if t != "ray"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the small model, made if missing)")
    ap.add_argument("--tokens", default="128,1024,4000", help="prompt lengths (comma-separated)")
    ap.add_argument("--iters", type=int, default=20, help="timed pushes per transport and prompt length")
    ap.add_argument("--warmup", type=int, default=3, help="untimed pushes per transport first")
    ap.add_argument("--transports", default="ray,grpc", help=f"comma-separated, of {', '.join(TRANSPORTS)}")
    ap.add_argument("--ray-chunk-mib", type=float, default=32.0, help="RayKVSender: one object and call per chunk")
    ap.add_argument("--grpc-frame-mib", type=float, default=4.0, help="GrpcKVSender: payload bytes per frame")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="decode pool (default: twice the longest prompt's blocks, and some)")
    ap.add_argument("--object-store-mb", type=int, default=512)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)

    transports = [t for t in args.transports.split(",") if t]
    if not transports or any(t not in TRANSPORTS for t in transports) or len(set(transports)) != len(transports):
        ap.error(f"--transports: a list of distinct names of {', '.join(TRANSPORTS)}")
    lengths = [int(x) for x in args.tokens.split(",")]
    if args.model is None:
        from pdserve.engine.model_maker import ensure_model
        args.model = str(ensure_model("small"))

    from pdserve.engine.config import EngineConfig
    from pdserve.services.ray_deploy.cluster import (
        LOOPBACK_ENV, prepare_auth, start_local_cluster, stop_local_cluster, use_loopback_node,
    )
    from pdserve.services.common.security import new_token

    # A throwaway cluster with a throwaway Ray token in the environment: nothing is written under
    # $PDSERVE_HOME, where the token of a `pdserve ray up --address local` cluster may live.
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), LOOPBACK_ENV: "0"}
    cluster_token = new_token()   # the gRPC KV server's cluster token (pdserve's own plane)
    rows: list[dict[str, Any]] = []
    pools: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    actor_pids: list[int] = []
    with patch.dict(os.environ, env):        # the whole environment comes back at the end
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        use_loopback_node()
        local = start_local_cluster(num_cpus=2, object_store_bytes=args.object_store_mb * MiB, save=False)
        import ray

        try:
            warning = prepare_auth(local.address, local)
            if warning:
                raise RuntimeError(warning)
            ray.init(address=local.address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
            # By module name (not __main__): Ray ships a reference to the classes, not pickled code.
            from bench import kv_transport_ray_vs_grpc as this

            block_size = EngineConfig.__dataclass_fields__["block_size"].default   # what the decode engine uses
            blocks = args.num_kv_blocks or 2 * -(-(max(lengths) + 1) // block_size) + 16
            decode = ray.remote(this.DecodeActor).options(name=DECODE_ACTOR, num_cpus=0).remote(
                args.model, blocks, cluster_token)
            info = ray.get(decode.info.remote(), timeout=300)
            actor_pids.append(info["pid"])
            prefill = ray.remote(this.PrefillActor).options(num_cpus=0).remote(
                decode, info, cluster_token, int(args.ray_chunk_mib * MiB), int(args.grpc_frame_mib * MiB))
            actor_pids.append(ray.get(prefill.pid.remote(), timeout=300))
            if not args.json:
                print(f"decode engine: {args.model}, KV {info['kv_dtype']}{info['block_shape']} = "
                      f"{info['block_bytes'] / MiB:.3f} MiB a block; gRPC KV server {info['grpc_address']}, "
                      f"Ray {ray.__version__} head {local.address}; {args.iters} pushes per transport and length "
                      f"(after {args.warmup}); load average {os.getloadavg()[0]:.2f}", flush=True)
                print(_table_header(transports), flush=True)
            for n in lengths:
                before = ray.get(decode.stats.remote())["num_free_blocks"]
                run = ray.get(prefill.run.remote(n, args.iters, args.warmup, transports))
                after = ray.get(decode.stats.remote())
                pools.append({"tokens": n, "total": after["num_total_blocks"], "free_before": before,
                              "free_after": after["num_free_blocks"], "reserved_after": after["num_reserved"]})
                if after["num_free_blocks"] != before or after["num_reserved"]:
                    raise RuntimeError(f"{n} tokens: {after['num_free_blocks']} free blocks after, {before} before "
                                       f"({after['num_reserved']} reservations left)")
                rows.append(_row(n, run, transports))
                if not args.json:
                    print(_table_row(rows[-1], transports), flush=True)
            ray.get(prefill.close.remote())
            ray.get(decode.stop.remote())
            for actor in (prefill, decode):
                ray.kill(actor)
        finally:
            try:
                if ray.is_initialized():
                    ray.shutdown()
            finally:
                stop_local_cluster(local)
    left = _ray_left(local.pgid, actor_pids)
    if args.json:
        print(json.dumps({"model": args.model, "transports": transports, "iters": args.iters, "warmup": args.warmup,
                          "decode": info, "rows": rows, "pools": pools, "ray_address": local.address,
                          "ray_pgid": local.pgid, "actor_pids": actor_pids, "ray_processes_left": left,
                          "load_average": os.getloadavg()[0]}))
    else:
        pool = ", ".join(f"{p['free_after']}/{p['total']}" for p in pools)
        ended = "still running: " + ", ".join(left) if left else "no process of it or of the actors left"
        print(f"free decode blocks back at their baseline after every length ({pool}); Ray head stopped, {ended}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
