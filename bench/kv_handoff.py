#!/usr/bin/env python
"""The KV hand-off on loopback: how long a request's blocks take to reach a decode worker, against
what the memory and the socket alone would take for the same bytes, side by side in one run.

A real decode worker (`pdserve decode`, its own process, the `small` model unless --model) makes
a reservation for a prompt of N tokens; this process then does what a prefill worker does: opens
the request's KV stream (GrpcKVSender) when the request arrives, and once the last chunk is
computed sends every block (header + CRC-32 + raw bytes) and, as the router does on the first
token, asks the decode worker to continue. Two times per size (medians): until the decode
worker has every block checked (token, index, chain hash, layout, CRC), stored in its paged pool
and the request admitted — the "exposed transfer" a one-chunk prompt adds before its second
token — and until the sender holds the acknowledgement (when its pinned blocks are released).
For the same bytes in the same run:

* memcpy: one copy of the bytes in this process (the floor: the KV must be copied once);
* socket: the bytes over a loopback TCP connection to a child process that reads them all and
  answers one byte (what any transport pays for moving them between processes).

Each size runs both ways the gRPC transport can carry the bytes on one host: through a shared
memory segment (`--kv-shared-memory`, on by default for loopback targets, used for sends of at
least 1 MiB) and inside the stream's frames.

    python bench/kv_handoff.py                         # 128, 256, 1024 tokens of the small model
    python bench/kv_handoff.py --tokens 256 --iters 50
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import raw_socket  # noqa: E402

MiB = 1 << 20

def socket_seconds(nbytes: int, iters: int) -> list[float]:
    """Seconds of iters raw-socket sends of nbytes to a receiver process (after 3 warm ones)."""
    child = subprocess.Popen([sys.executable, str(REPO_ROOT / "bench" / "raw_socket.py"), "serve", "127.0.0.1", "0",
                              "120"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline().split()[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            return raw_socket.timed_sends(s, [nbytes], iters, warmup=3)[nbytes]
    finally:
        child.kill()
        child.wait()


def memcpy_seconds(nbytes: int, iters: int) -> list[float]:
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    out = []
    for _ in range(iters + 3):
        t = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t)
    return out[3:]


async def handoff_seconds(address: str, token: str, tokens: int, iters: int, shm: bool
                          ) -> tuple[list[float], list[float], int]:
    """(seconds until the decode worker could decode: every block verified and stored, and the
    request admitted; seconds until the sender had its acknowledgement; bytes) per iteration."""
    import torch

    from pdserve.engine.kv.block_manager import transfer_block_hashes
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from pdserve.services.kv_transfer import GrpcKVSender, KVBlock
    from pdserve.services.common.security import Credentials
    from pdserve.services.common.grpc_setup import options

    creds = Credentials(token)
    sender = GrpcKVSender(lambda a: creds.channel(a, options(), attach_token=False), proof=creds.call_proof,
                          shared_memory=shm, shared_memory_min_bytes=0,   # every size, to compare
                          cluster_token=token)
    ready, acked, nbytes = [], [], 0
    rng = random.Random(f"{tokens}-{shm}-{time.time_ns()}")
    async with creds.channel(address, options()) as ch:
        info, decode = worker_pb2_grpc.WorkerStub(ch), worker_pb2_grpc.DecodeWorkerStub(ch)
        status = await info.GetStatus(worker_pb2.StatusRequest())
        shape = (status.num_layers, 2, status.block_size, status.num_kv_heads, status.head_dim)
        dtype = getattr(torch, status.kv_dtype)
        for i in range(iters + 3):
            prompt = [rng.randrange(2, 8000) for _ in range(tokens)]   # fresh: no prefix-cache hits, ever
            rid = f"bench-{tokens}-{shm}-{i}"
            # max_tokens=1: the token the Decode call brings ends the request, so the call answers as
            # soon as the request is admitted (its KV complete), with no decode step in the way.
            res = await decode.Reserve(worker_pb2.ReserveRequest(
                request_id=rid, prompt_token_ids=prompt, params=common_pb2.SamplingParams(max_tokens=1)))
            assert len(res.needed_block_indices) == -(-tokens // status.block_size), "a prefix-cache hit"
            hashes = transfer_block_hashes(prompt, status.block_size)
            blocks = [KVBlock(rid, j, hashes[j], torch.randn(shape).to(dtype))
                      for j in res.needed_block_indices]
            # As a prefill worker does: the stream opens when the request arrives, while the prompt
            # computes; what is exposed starts when the last chunk's blocks are ready, and the router
            # asks the decode worker to continue at once.
            stream = sender.open(address, rid, res.transfer_token)
            await stream.heartbeat()
            await asyncio.sleep(0.005)
            t = time.perf_counter()
            await stream.send(blocks)
            events = [e async for e in decode.Decode(worker_pb2.DecodeRequest(request_id=rid, first_token_id=5))]
            assert events and events[-1].finished
            ready.append(time.perf_counter() - t)
            result = await stream.finish(timeout=60)
            acked.append(time.perf_counter() - t)
            nbytes = result.bytes
    await sender.close()
    return ready[3:], acked[3:], nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the small model, made if missing)")
    ap.add_argument("--tokens", default="128,256,1024", help="prompt lengths (comma-separated)")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)

    from pdserve.services.deployment.launcher import free_port, wait_serving
    from pdserve.services.common.security import CLUSTER_TOKEN_ENV, Credentials, new_token
    if args.model is None:
        from pdserve.engine.model_maker import ensure_model
        args.model = str(ensure_model("small"))
    token, port = new_token(), free_port()
    env = {**os.environ, CLUSTER_TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "decode", "--model", args.model,
                               "--port", str(port), "--num-threads", "1"], env=env, cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, worker, timeout=180, credentials=Credentials(token))
        print(f"decode worker {address} ({args.model}); load average {os.getloadavg()[0]:.2f}", flush=True)
        print("| prompt tokens | KV MiB | decodable after (ms), shared memory | acknowledged after, shared memory "
              "| decodable after, bytes in the stream | acknowledged after, bytes in the stream | memcpy ms "
              "| socket ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in [int(x) for x in args.tokens.split(",")]:
            shm_ready, shm_acked, nbytes = asyncio.run(handoff_seconds(address, token, n, args.iters, shm=True))
            ready, acked, _ = asyncio.run(handoff_seconds(address, token, n, args.iters, shm=False))
            mem = memcpy_seconds(nbytes, args.iters)
            sock = socket_seconds(nbytes, args.iters)
            cells = [statistics.median(v) * 1e3 for v in (shm_ready, shm_acked, ready, acked)]
            print(f"| {n} | {nbytes / MiB:.2f} | " + " | ".join(f"{c:.2f}" for c in cells)
                  + f" | {statistics.median(mem) * 1e3:.3f} | {statistics.median(sock) * 1e3:.2f} |", flush=True)
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
