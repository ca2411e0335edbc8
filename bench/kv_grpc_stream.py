#!/usr/bin/env python
"""The KV stream alone, between two processes: a prefill-side GrpcKVSender (or TcpKVSender:
``--plane tcp``, or both back to back: ``--plane grpc,tcp``) in this process and a real
decode-role LLMEngine's KV connector behind KVTransferServicer (and the raw TCP data plane's
KVDataListener) in a child process (the deployment's cluster token keys the MACs, the
interceptors and the TCP handshake, as serve_worker runs them).

For each prompt length the child reserves a fresh random prompt (no prefix-cache hit), this
process opens its stream (as a prefill worker does when a request arrives), and the time runs
from ``send`` of every block to ``finish``'s acknowledgement: frames built and MACed, carried,
verified, checked by the connector and written into the paged pool. Then the child checks the
request is READY and aborts it (its blocks back to the pool; the free count is checked at its
baseline at the end). Printed: median ms and MiB/s per length, the decode process's CPU time
from the reservation to the release (the receiving side's whole cost: socket reads, MAC checks,
the connector, the pool writes, its event loop), and a raw TCP socket's time for
the same bytes between the same two processes (one connection, opened beforehand, timed from
the first byte to a one-byte answer after the last).

The child may run in another network namespace (``--decode-netns NAME --decode-host ADDR``,
e.g. one of bench/kv_handoff_hosts.py's hosts); by default both are on 127.0.0.1 with shared
memory off (the stream path). Control messages are JSON lines on the child's stdin/stdout.

    python bench/kv_grpc_stream.py --model small --tokens 1200,4096 --iters 5 --plane grpc,tcp
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import drivers, raw_socket  # noqa: E402

MiB = 1 << 20
RAW_PORT = 7311


# ---- the decode side (child) -----------------------------------------------------------------
async def _serve(args: argparse.Namespace) -> None:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pdserve.engine.model_maker import ensure_model
    from pdserve.engine.presets import PRESETS
    from pdserve.services.common.grpc_setup import start_server
    from pdserve.services.kv_transfer import KVTransferServicer, register_kv_servicer
    from pdserve.services.kv_transfer.tcp_receiver import KVDataListener
    from pdserve.services.common.security import Credentials

    torch.set_num_threads(1)
    model = str(ensure_model(args.model)) if args.model in PRESETS else args.model
    engine = LLMEngine(EngineConfig(model=model, role="decode", block_size=args.block_size,
                                    num_kv_blocks=args.num_kv_blocks, num_threads=1))
    kv = engine.kv
    servicer = KVTransferServicer(kv, cluster_token=args.cluster_token)
    server = await start_server([(lambda s, srv: register_kv_servicer(s, srv), servicer, "pdserve.v1.KVTransfer")],
                                args.decode_host, 0, interceptors=Credentials(args.cluster_token).server_interceptors())
    listener = KVDataListener(kv, args.decode_host, cluster_token=args.cluster_token).start()
    raw = socket.create_server((args.decode_host, RAW_PORT))
    threading.Thread(target=_raw_receiver, args=(raw,), daemon=True).start()
    runner = engine.runner
    free0 = engine.stats()["num_free_blocks"]
    _say({"address": f"{args.decode_host}:{server.port}", "data": listener.address(), "raw": f"{args.decode_host}:{RAW_PORT}",
          "block_size": engine.config.block_size, "block_shape": list(runner.block_shape),
          "kv_dtype": runner.kv_dtype_name, "vocab_size": engine.model_config.vocab_size, "free_blocks": free0})
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        msg = json.loads(line)
        if msg["op"] == "reserve":
            res = engine.reserve(msg["rid"], msg["prompt"], SamplingParams(max_tokens=1))
            _say({"needed": list(res.needed_block_indices), "token": res.transfer_token.hex(),
                  "cpu_s": time.process_time()})
        elif msg["op"] == "release":
            state = kv.state(msg["rid"])
            engine.abort(msg["rid"])
            _say({"state": "none" if state is None else state.value, "cpu_s": time.process_time()})
        elif msg["op"] == "stats":
            _say({"free_blocks": engine.stats()["num_free_blocks"]})
        else:
            break
    listener.close()
    await server.server.stop(None)


def _raw_receiver(server: socket.socket) -> None:
    """The raw-socket reference (bench/raw_socket.py), one connection after another."""
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                raw_socket.serve_one(conn)
            except ConnectionError:
                return


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---- the prefill side ------------------------------------------------------------------------
class Decode:
    def __init__(self, args: argparse.Namespace, cluster_token: str) -> None:
        cmd = [sys.executable, __file__, "--serve", "--model", args.model, "--block-size", str(args.block_size),
               "--num-kv-blocks", str(args.num_kv_blocks), "--decode-host", args.decode_host,
               "--cluster-token", cluster_token]
        if args.decode_netns:
            cmd = ["ip", "netns", "exec", args.decode_netns, *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        self.info = self._read(600)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the decode process exited ({self.proc.wait(5)})")
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise TimeoutError("the decode process did not answer")

    def ask(self, **msg: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read(120)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


def _raw_seconds(address: str, nbytes: int, iters: int) -> float:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        return statistics.median(raw_socket.timed_sends(conn, [nbytes], iters)[nbytes])


async def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import random

    import grpc
    import torch

    from pdserve.engine.kv.block_manager import transfer_block_hashes
    from pdserve.services.common.grpc_setup import options as channel_options
    from pdserve.services.kv_transfer import GrpcKVSender, KVBlock
    from pdserve.services.kv_transfer.grpc_transport import grpc_message_limit
    from pdserve.services.kv_transfer.tcp_transport import TcpKVSender
    from pdserve.services.common.security import Credentials

    token = secrets.token_urlsafe(24)
    decode = Decode(args, token)
    rows = []
    try:
        info = decode.info
        creds = Credentials(token)
        extra: dict[str, Any] = {"kv_streams": args.kv_streams} if args.kv_streams else {}
        if args.frame_target:
            extra["frame_target"] = args.frame_target
        sender = GrpcKVSender(
            lambda a: creds.channel(a, channel_options([("grpc.max_send_message_length", grpc_message_limit())]),
                                    attach_token=False),
            proof=creds.call_proof if creds.key is not None else None, cluster_token=creds.cluster_token, **extra)
        senders = {"grpc": (sender, info["address"]),
                   "tcp": (TcpKVSender(cluster_token=creds.cluster_token), info["data"])}
        rng = random.Random(0)
        bs = info["block_size"]
        dtype = getattr(torch, info["kv_dtype"])
        for tokens in args.tokens:
            n = -(-tokens // bs)
            data = torch.randint(-8, 8, (n, *info["block_shape"]), dtype=torch.int8).to(dtype)   # as read_blocks: contiguous
            times: dict[str, list[float]] = {plane: [] for plane in args.plane}
            cpu: dict[str, list[float]] = {plane: [] for plane in args.plane}   # the decode process's CPU seconds
            nbytes = 0
            for i in range(args.warmup + args.iters):
                for plane in args.plane:   # the planes alternate: the same load on each
                    kv_sender, target = senders[plane]
                    prompt = [rng.randrange(2, info["vocab_size"]) for _ in range(tokens)]
                    rid = f"kvs-{plane}-{tokens}-{i}"
                    res = decode.ask(op="reserve", rid=rid, prompt=prompt)
                    hashes = transfer_block_hashes(prompt, bs)
                    blocks = [KVBlock(rid, j, hashes[j], data[j]) for j in res["needed"]]
                    stream = kv_sender.open(target, rid, bytes.fromhex(res["token"]))
                    try:
                        result, seconds = await drivers.timed_push(stream, blocks, settle_s=0.05, timeout=120)
                    finally:
                        released = decode.ask(op="release", rid=rid)
                        state = released["state"]
                    if result.blocks != len(blocks) or state != "ready":
                        raise RuntimeError(f"{rid}: {result.blocks}/{len(blocks)} acknowledged, decode side {state}")
                    nbytes = result.bytes
                    if i >= args.warmup:
                        times[plane].append(seconds)
                        cpu[plane].append(released["cpu_s"] - res["cpu_s"])
            raw = _raw_seconds(info["raw"], nbytes, max(2, args.iters))
            for plane in args.plane:
                ms = statistics.median(times[plane]) * 1e3
                cpu_ms = statistics.median(cpu[plane]) * 1e3
                rows.append({"plane": plane, "tokens": tokens, "MiB": nbytes / MiB, "ms": ms, "raw_ms": raw * 1e3,
                             "ratio": ms / (raw * 1e3), "MiB_s": nbytes / MiB / (ms / 1e3), "decode_cpu_ms": cpu_ms,
                             "all_ms": [round(t * 1e3, 2) for t in times[plane]]})
                print(f"| {plane} | {tokens} | {nbytes / MiB:.2f} | {ms:.1f} | {raw * 1e3:.1f} | "
                      f"{ms / (raw * 1e3):.2f} | {nbytes / MiB / (ms / 1e3):.0f} | {cpu_ms:.1f} | "
                      f"{' '.join(f'{t * 1e3:.1f}' for t in times[plane])} |", flush=True)
        await senders["tcp"][0].close()
        await sender.close()
        free = decode.ask(op="stats")["free_blocks"]
        if free != info["free_blocks"]:
            raise RuntimeError(f"decode pool free blocks {free} != baseline {info['free_blocks']}")
    finally:
        decode.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="a model_maker preset or a checkpoint dir")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1200, 4096])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=600)
    ap.add_argument("--kv-streams", default="", help="GrpcKVSender's kv_streams (default: its own)")
    ap.add_argument("--frame-target", type=int, default=0, help="GrpcKVSender's frame_target bytes (default: its own)")
    ap.add_argument("--plane", type=lambda s: s.split(","), default=["grpc"],
                    help="grpc, tcp, or both (grpc,tcp): which data planes, alternating")
    ap.add_argument("--decode-host", default="127.0.0.1")
    ap.add_argument("--decode-netns", default="", help="run the decode process in this network namespace")
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cluster-token", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args))
        return 0
    print("| plane | tokens | KV MiB | ms | raw socket ms | / socket | MiB/s | decode CPU ms | samples ms |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
    rows = asyncio.run(_measure(args))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
