#!/usr/bin/env python
"""The KV hand-off on loopback: how long a request's blocks take to reach a decode worker, against
what the memory and the socket alone would take for the same bytes, side by side in one run.

A real decode worker (`pdserve decode`, its own process, the `small` model unless --model) makes
a reservation for a prompt of N tokens; this process then does what a prefill worker does: opens
the request's KV stream (GrpcKVSender) when the request arrives, and once the last chunk is
computed sends every block (header + CRC-32 + raw bytes) and waits for the acknowledgement — which the decode worker gives only after checking
each block (token, index, chain hash, layout, CRC) and writing it into its paged pool. That wait
is the "exposed transfer" of a one-chunk prompt. Per size it prints the median, and for the same
bytes in the same run:

* memcpy: one copy of the bytes in this process (the floor: the KV must be copied once);
* socket: the bytes over a loopback TCP connection to a child process that reads them all and
  answers one byte (what any transport pays for moving them between processes).

    python bench/kv_handoff.py                         # 128, 256, 1024 tokens of the small model
    python bench/kv_handoff.py --tokens 256 --iters 50
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20

SINK = r"""
import socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 24)
while True:
    head = conn.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        break
    n = int.from_bytes(head, "little")
    view = memoryview(buf)
    while n:
        got = conn.recv_into(view[:min(n, len(buf))])
        n -= got
    conn.sendall(b"k")
"""


def socket_seconds(payload: bytes, iters: int) -> list[float]:
    child = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out = []
            for _ in range(iters + 3):
                t = time.perf_counter()
                s.sendall(len(payload).to_bytes(8, "little"))
                s.sendall(payload)
                s.recv(1)
                out.append(time.perf_counter() - t)
            return out[3:]
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


async def handoff_seconds(address: str, token: str, tokens: int, iters: int) -> tuple[list[float], int]:
    import torch

    from engine.block_manager import transfer_block_hashes
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from services.kv_transfer import GrpcKVSender, KVBlock
    from services.security import Credentials
    from services.server import options

    creds = Credentials(token)
    sender = GrpcKVSender(lambda a: creds.channel(a, options(), attach_token=False), metadata=creds.metadata)
    out, nbytes = [], 0
    async with creds.channel(address, options()) as ch:
        info, decode = worker_pb2_grpc.WorkerStub(ch), worker_pb2_grpc.DecodeWorkerStub(ch)
        status = await info.GetStatus(worker_pb2.StatusRequest())
        shape = (status.num_layers, 2, status.block_size, status.num_kv_heads, status.head_dim)
        dtype = getattr(torch, status.kv_dtype)
        for i in range(iters + 3):
            prompt = [2 + (i * 7919 + j * 31) % 8000 for j in range(tokens)]   # fresh: no prefix hits
            rid = f"bench-{tokens}-{i}"
            res = await decode.Reserve(worker_pb2.ReserveRequest(
                request_id=rid, prompt_token_ids=prompt, params=common_pb2.SamplingParams(max_tokens=1)))
            hashes = transfer_block_hashes(prompt, status.block_size)
            blocks = [KVBlock(rid, j, hashes[j], status.block_size, torch.randn(shape).to(dtype))
                      for j in res.needed_block_indices]
            # As a prefill worker does: the stream opens when the request arrives, while the prompt
            # computes; what is exposed starts when the last chunk's blocks are ready.
            stream = sender.open(address, rid, res.transfer_token)
            await stream.heartbeat()
            await asyncio.sleep(0.005)
            t = time.perf_counter()
            await stream.send(blocks)
            result = await stream.finish(timeout=60)
            out.append(time.perf_counter() - t)
            nbytes = result.bytes
            await info.Abort(common_pb2.AbortRequest(request_id=rid))
    await sender.close()
    return out[3:], nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the small model, made if missing)")
    ap.add_argument("--tokens", default="128,256,1024", help="prompt lengths (comma-separated)")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)

    from services.launcher import free_port, wait_serving
    from services.security import CLUSTER_TOKEN_ENV, Credentials, new_token
    if args.model is None:
        from engine.model_maker import ensure_model
        args.model = str(ensure_model("small"))
    token, port = new_token(), free_port()
    env = {**os.environ, CLUSTER_TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "services.cli", "decode", "--model", args.model,
                               "--port", str(port), "--num-threads", "1"], env=env, cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, worker, timeout=180, credentials=Credentials(token))
        print(f"decode worker {address} ({args.model}); load average {os.getloadavg()[0]:.2f}", flush=True)
        print("| prompt tokens | KV MiB | hand-off ms | memcpy ms | socket ms | hand-off / socket | hand-off MiB/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in [int(x) for x in args.tokens.split(",")]:
            hand, nbytes = asyncio.run(handoff_seconds(address, token, n, args.iters))
            mem = memcpy_seconds(nbytes, args.iters)
            sock = socket_seconds(os.urandom(nbytes), args.iters)
            h, m, s = (statistics.median(v) * 1e3 for v in (hand, mem, sock))
            print(f"| {n} | {nbytes / MiB:.2f} | {h:.2f} | {m:.3f} | {s:.2f} | {h / s:.1f}x | {nbytes / MiB / (h / 1e3):.0f} |",
                  flush=True)
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
