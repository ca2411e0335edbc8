#!/usr/bin/env python
"""The CPU an emulated link costs the machine: a raw TCP socket (bench/raw_socket.py) between two
namespace hosts (services/deployment/netns.py, egress limited by tc tbf to the rate, or not
limited: rate 0), sending the same bytes again and again over one connection. Printed per send
(measured over the sends alone, not the processes' start): its wall time (median), the sender
process's user and system CPU, and the whole machine's user, system, softirq and idle CPU
(/proc/stat, every core), so a reader sees how much of the machine the kernel's own path (veth,
bridge, tbf, TCP on both ends) takes before any pdserve process does work. Needs root.

    python bench/link_cpu.py --rates-gbit 10,0 --nbytes 9830400 --sends 30
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

RAW_SOCKET = str(REPO_ROOT / "bench" / "raw_socket.py")
PORT = 7402
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
_STAT_FIELDS = {"user": 0, "system": 2, "idle": 3, "softirq": 6}


def _machine_ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def send(host: str, nbytes: int, sends: int, timeout_s: float) -> dict[str, float]:
    """In the sender host: the sends, and the CPU they took (this process's, the machine's)."""
    from bench import raw_socket
    with socket.create_connection((host, PORT), timeout=timeout_s) as conn:
        raw_socket.timed_sends(conn, [nbytes], 1)   # the connection's window opened first
        before, own = _machine_ticks(), os.times()
        times = raw_socket.timed_sends(conn, [nbytes], sends, warmup=0)[nbytes]
        after, own_after = _machine_ticks(), os.times()
    row = {"wall_ms": statistics.median(times) * 1e3, "sender_user_ms": (own_after.user - own.user) * 1e3 / sends,
           "sender_system_ms": (own_after.system - own.system) * 1e3 / sends}
    for name, i in _STAT_FIELDS.items():
        row[f"machine_{name}_ms"] = (after[i] - before[i]) * TICK_MS / sends
    return row


def measure(rate_gbit: float, nbytes: int, sends: int, timeout_s: float = 120.0) -> dict[str, float]:
    """ms per send: wall (median), the sender's user and system CPU, the machine's per field."""
    from pdserve.services.deployment import netns
    with netns.HostNetwork(2, int(rate_gbit * 1e9) if rate_gbit > 0 else None) as net:
        sender, receiver = net.hosts
        rx = receiver.popen([sys.executable, RAW_SOCKET, "serve", receiver.address, str(PORT), str(timeout_s)],
                            stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([rx.stdout], [], [], timeout_s)
        if not ready or not rx.stdout.readline().startswith("ready"):
            raise RuntimeError(f"the raw-socket receiver did not start within {timeout_s:g}s")
        done = sender.run([sys.executable, __file__, "--sender", receiver.address, "--nbytes", str(nbytes),
                           "--sends", str(sends)], timeout=timeout_s, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the sender failed: {done.stderr[-2000:]}")
        rx.wait(timeout_s)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates-gbit", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 0.0],
                    help="tbf rates, Gbit/s (0: no limit)")
    ap.add_argument("--nbytes", type=int, default=9830400, help="bytes per send (default: the small model's "
                    "1200-token KV)")
    ap.add_argument("--sends", type=int, default=30)
    ap.add_argument("--sender", metavar="HOST", help=argparse.SUPPRESS)   # the sending side, run in its host
    args = ap.parse_args(argv)
    if args.nbytes < 1 or args.sends < 1 or min(args.rates_gbit) < 0:
        ap.error("nbytes and sends must be >= 1, rates >= 0")
    if args.sender:
        print(json.dumps(send(args.sender, args.nbytes, args.sends, 120.0)))
        return 0
    cols = ("wall_ms", "sender_user_ms", "sender_system_ms", "machine_user_ms", "machine_system_ms",
            "machine_softirq_ms", "machine_idle_ms")
    print(f"# {args.nbytes} bytes a send, {args.sends} sends (after one warm-up), ms per send; "
          f"{os.cpu_count()} CPUs, {TICK_MS:g} ms ticks")
    print("| Gbit/s | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for rate in args.rates_gbit:
        row = measure(rate, args.nbytes, args.sends)
        print(f"| {rate:g} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
