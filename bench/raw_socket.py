#!/usr/bin/env python
"""The raw TCP socket the KV benchmarks measure the hand-off against: one connection, opened
beforehand; each send is an 8-byte little-endian length, that many bytes, and a one-byte answer
("k") once the receiver has them all. Timed from the first byte sent to the answer.

Run as a process (in a namespace host, or beside the benchmark):

    python bench/raw_socket.py serve HOST PORT TIMEOUT_S     # prints "ready PORT" (PORT 0: any)
    python bench/raw_socket.py send HOST PORT SIZES_JSON REPEATS TIMEOUT_S   # prints {size: [s, ...]}

or use serve_one / timed_sends from Python.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Sequence

BUFFER_BYTES = 16 << 20   # what the receiver reads into, reused


def serve_one(conn: socket.socket) -> None:
    """Answer sends on conn until its peer closes between two of them. A peer that closes in
    the middle of one raises ConnectionError (never a spin on recv_into's 0)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(BUFFER_BYTES))
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        left = int.from_bytes(head, "little")
        while left:
            got = conn.recv_into(view[:min(left, view.nbytes)])
            if not got:
                raise ConnectionError(f"raw socket: the peer closed with {left} bytes left")
            left -= got
        conn.sendall(b"k")


def timed_sends(conn: socket.socket, sizes: Sequence[int], repeats: int, warmup: int = 1) -> dict[int, list[float]]:
    """Seconds of each of repeats sends per size (after warmup unmeasured ones, which open the
    connection's window)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(os.urandom(min(max(sizes), 64 << 20)))
    out: dict[int, list[float]] = {}
    for n in sizes:
        times = []
        for _ in range(warmup + repeats):
            t = time.perf_counter()
            conn.sendall(n.to_bytes(8, "little"))
            left = n
            while left:
                chunk = min(left, payload.nbytes)
                conn.sendall(payload[:chunk])
                left -= chunk
            if conn.recv(1) != b"k":
                raise ConnectionError("raw socket: the receiver closed without answering")
            times.append(time.perf_counter() - t)
        out[n] = times[warmup:]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    serve = sub.add_parser("serve", help='answer one connection\'s sends (prints "ready PORT" when listening)')
    send = sub.add_parser("send", help="time sends to a serving receiver (prints {size: [seconds, ...]} as JSON)")
    for p in (serve, send):
        p.add_argument("host")
        p.add_argument("port", type=int, help="0 with serve: any free port")
    send.add_argument("sizes", type=json.loads, help="JSON list of byte counts")
    send.add_argument("repeats", type=int)
    for p in (serve, send):
        p.add_argument("timeout_s", type=float, help="deadline of every socket wait")
    args = ap.parse_args(argv)
    if args.role == "serve":
        with socket.create_server((args.host, args.port)) as server:
            server.settimeout(args.timeout_s)
            print(f"ready {server.getsockname()[1]}", flush=True)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(args.timeout_s)
                serve_one(conn)
        return 0
    with socket.create_connection((args.host, args.port), timeout=args.timeout_s) as conn:
        print(json.dumps({str(n): t for n, t in timed_sends(conn, args.sizes, args.repeats).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
