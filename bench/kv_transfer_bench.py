#!/usr/bin/env python
"""KV block throughput: gRPC transport vs. raw loopback TCP (asyncio streams).

The same float32 blocks are pushed through
  * grpc:      GrpcKVSender -> KVTransferServicer (frames, CRC-32 verify), and
  * raw:       length-prefixed asyncio streams: [u32 len][KVBlockHeader][payload],
               receiver verifies the same CRC-32 (``raw-nocrc`` skips it on both
               sides, i.e. the bare socket baseline).
Each receiver runs in its own subprocess on 127.0.0.1 and discards the blocks
after verification. Besides MiB/s (median wall time per push), CPU time per
MiB is reported for each side (all threads; receiver read from /proc), which
is the more stable figure on a shared machine. Example::

    /work/venv/bin/python bench/kv_transfer_bench.py --total-mib 256 --iters 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import resource
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from pdserve.v1 import kv_pb2  # noqa: E402
from services.kv_transfer import (  # noqa: E402
    BlockHeader,
    GrpcKVSender,
    KVBlock,
    add_kv_transfer_servicer,
    encode_block,
    kv_grpc_options,
    verify_payload,
)
from services.kv_transfer.grpc_transport import header_from_proto, header_to_proto  # noqa: E402

MiB = 1 << 20
LEN = struct.Struct("!I")
ACK = struct.Struct("!Q")


# ---------------------------------------------------------------- receivers


class DiscardSink:
    def accept_block(self, header: BlockHeader, payload: bytearray) -> None:
        pass


async def serve_grpc(max_frame_bytes: int, extra: list[tuple[str, int | str]]) -> None:
    server = grpc.aio.server(options=kv_grpc_options(max_frame_bytes) + extra)
    add_kv_transfer_servicer(server, DiscardSink(), max_block_bytes=1 << 30)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


async def _raw_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, verify: bool) -> None:
    total = 0
    try:
        while True:
            (hlen,) = LEN.unpack(await reader.readexactly(LEN.size))
            if hlen == 0:  # end of one push: ack the byte count
                writer.write(ACK.pack(total))
                await writer.drain()
                total = 0
                continue
            header = header_from_proto(kv_pb2.KVBlockHeader.FromString(await reader.readexactly(hlen)))
            payload = await reader.readexactly(header.nbytes)
            if verify:
                verify_payload(header, payload)
            total += len(payload)
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


async def serve_raw(verify: bool) -> None:
    server = await asyncio.start_server(
        lambda r, w: _raw_conn(r, w, verify), "127.0.0.1", 0, limit=64 * MiB
    )
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


# ------------------------------------------------------------------ senders


async def push_grpc(
    addr: str, blocks: list[KVBlock], iters: int, max_frame_bytes: int, extra: list[tuple[str, int | str]]
) -> list[float]:
    times = []
    async with GrpcKVSender(max_frame_bytes=max_frame_bytes, channel_options=extra) as sender:
        for _ in range(iters):
            t0 = time.perf_counter()
            result = await sender.send_blocks(addr, blocks)
            times.append(time.perf_counter() - t0)
            assert result.ok and result.blocks == len(blocks), result
    return times


async def push_raw(addr: str, blocks: list[KVBlock], iters: int, checksum: bool) -> list[float]:
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    times = []
    expected = 0
    for _ in range(iters):
        t0 = time.perf_counter()
        expected = 0
        for block in blocks:
            header, payload = encode_block(block) if checksum else _encode_no_crc(block)
            hbytes = header_to_proto(header, 1).SerializeToString()
            writer.write(LEN.pack(len(hbytes)) + hbytes)
            writer.write(payload)
            await writer.drain()
            expected += header.nbytes
        writer.write(LEN.pack(0))
        await writer.drain()
        (got,) = ACK.unpack(await reader.readexactly(ACK.size))
        times.append(time.perf_counter() - t0)
        assert got == expected, (got, expected)
    writer.close()
    await writer.wait_closed()
    return times


def _encode_no_crc(block: KVBlock) -> tuple[BlockHeader, memoryview]:
    from services.kv_transfer.base import block_payload, dtype_name

    payload = block_payload(block)
    header = BlockHeader(
        block.request_id, block.block_index, block.block_hash, block.num_tokens,
        block.layer_start, block.layer_end, dtype_name(block.dtype), block.shape, payload.nbytes, 0,
    )
    return header, payload


# --------------------------------------------------------------------- main


def make_blocks(total_mib: float, shape: tuple[int, ...]) -> list[KVBlock]:
    block_bytes = math.prod(shape) * 4
    n = max(1, round(total_mib * MiB / block_bytes))
    gen = torch.Generator().manual_seed(0)
    return [
        KVBlock.from_tensor(
            torch.randn(shape, generator=gen),
            request_id="bench", block_index=i, block_hash=i, num_tokens=shape[2],
            layer_start=0, layer_end=shape[0],
        )
        for i in range(n)
    ]


def parse_grpc_args(items: list[str]) -> list[tuple[str, int | str]]:
    out: list[tuple[str, int | str]] = []
    for item in items:
        key, _, value = item.partition("=")
        out.append((key, int(value) if value.lstrip("-").isdigit() else value))
    return out


def proc_cpu_seconds(pid: int) -> float:
    """utime+stime of a child process (Linux /proc); NaN elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_receiver(kind: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, __file__, "--serve", kind, "--max-frame-bytes", str(args.max_frame_bytes)]
    for item in args.grpc_arg:
        cmd += ["--grpc-arg", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "PORT":
        proc.kill()
        raise RuntimeError(f"{kind} receiver failed to start")
    return proc, f"127.0.0.1:{line[1]}"


def run_mode(kind: str, blocks: list[KVBlock], args: argparse.Namespace) -> tuple[float, float, float]:
    """Return (median seconds per push, sender CPU s, receiver CPU s) over all pushes."""
    proc, addr = start_receiver(kind, args)
    try:
        n = args.warmup + args.iters
        tx0, rx0 = self_cpu_seconds(), proc_cpu_seconds(proc.pid)
        if kind == "grpc":
            extra = parse_grpc_args(args.grpc_arg)
            times = asyncio.run(push_grpc(addr, blocks, n, args.max_frame_bytes, extra))
        else:
            times = asyncio.run(push_raw(addr, blocks, n, checksum=(kind == "raw")))
        tx_cpu, rx_cpu = self_cpu_seconds() - tx0, proc_cpu_seconds(proc.pid) - rx0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return statistics.median(times[args.warmup:]), tx_cpu / n, rx_cpu / n


def main() -> None:
    parser = argparse.ArgumentParser(description="gRPC vs raw TCP KV block throughput")
    parser.add_argument("--total-mib", type=float, default=256.0, help="MiB pushed per iteration")
    parser.add_argument(
        "--block-shape", default="32,2,16,8,128",
        help="float32 block shape (layers,k/v,block_size,kv_heads,head_dim); default 4 MiB",
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-frame-bytes", type=int, default=1 << 20)
    parser.add_argument("--modes", default="grpc,raw,raw-nocrc")
    parser.add_argument(
        "--grpc-arg", action="append", default=[], metavar="KEY=VALUE",
        help="extra gRPC channel/server arg, e.g. grpc.http2.bdp_probe=0 (repeatable)",
    )
    parser.add_argument("--serve", choices=["grpc", "raw", "raw-nocrc"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve == "grpc":
        asyncio.run(serve_grpc(args.max_frame_bytes, parse_grpc_args(args.grpc_arg)))
        return
    if args.serve:
        asyncio.run(serve_raw(verify=(args.serve == "raw")))
        return

    shape = tuple(int(x) for x in args.block_shape.split(","))
    blocks = make_blocks(args.total_mib, shape)
    total_mib = sum(b.data.numel() * 4 for b in blocks) / MiB
    print(
        f"{len(blocks)} blocks x {shape} float32 = {total_mib:.1f} MiB/iter, "
        f"frame {args.max_frame_bytes} B, median of {args.iters} (+{args.warmup} warmup)"
    )
    print(f"  {'mode':10s} {'ms/push':>9s} {'MiB/s':>9s} {'tx CPU ms/MiB':>14s} {'rx CPU ms/MiB':>14s}")
    rates: dict[str, float] = {}
    for kind in args.modes.split(","):
        seconds, tx_cpu, rx_cpu = run_mode(kind, blocks, args)
        rates[kind] = total_mib / seconds
        print(
            f"  {kind:10s} {seconds * 1e3:9.1f} {rates[kind]:9.1f}"
            f" {tx_cpu * 1e3 / total_mib:14.2f} {rx_cpu * 1e3 / total_mib:14.2f}",
            flush=True,
        )
    if "grpc" in rates:
        for base in ("raw", "raw-nocrc"):
            if base in rates:
                print(f"  grpc/{base}: {rates['grpc'] / rates[base]:.2f}")


if __name__ == "__main__":
    main()
