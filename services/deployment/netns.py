"""Hosts emulated on one machine: Linux network namespaces joined by a bridge, for multi-host tests
and benchmarks.

Layout of one ``HostNetwork`` (prefix ``pdh-<pid>-<n>``):

- a namespace ``<prefix>-br`` holding only the bridge ``br0`` and one veth end per host (``v<i>``),
  so nothing is added to the machine's own namespace or its real networks;
- per host a namespace ``<prefix>-<i>`` with loopback up and the other veth end as ``eth0``,
  addressed ``10.<a>.<b>.<i + 2>/24``. The /24 is derived from the pid and a per-process counter
  (two pytest-xdist workers never share one) and skips any subnet this machine already uses;
- optionally a token-bucket (``tbf``) on each host's ``eth0``: its egress rate. This kernel has
  no ``netem``, so links get a rate, never added latency.

Exit (or ``close()``) kills every process in the namespaces and deletes them; ``sweep_stale``
removes what a dead process left. Needs root, ``ip`` and, for rates, ``tc``: ``available()`` says
whether namespaces can be made here and why not.
"""
from __future__ import annotations

import functools
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

PREFIX = "pdh"
BRIDGE = "br0"
HOST_IFACE = "eth0"
CMD_TIMEOUT_S = 10.0        # one `ip` / `tc` command
KILL_WAIT_S = 5.0           # processes left in a namespace are SIGKILLed and waited for this long
# tbf: the bucket holds this much time at the link's rate, and never less than two 64 KiB GSO
# super-packets (veth hands tbf packets up to 64 KiB; a bucket smaller than a packet would make
# tbf segment every one). 1 Gbit/s: 250 KB; 10 Gbit/s: 2.5 MB; below 512 Mbit/s: 128 KiB.
# The queue holds TBF_LATENCY of traffic before dropping, so one TCP stream is not starved by drops.
TBF_BURST_S = 0.002
TBF_MIN_BURST = 128 * 1024
TBF_LATENCY = "50ms"

_counter = itertools.count()


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """One command with a deadline; RuntimeError naming it and its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv)}: no answer after {CMD_TIMEOUT_S:g}s") from None
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@functools.cache
def available() -> tuple[bool, str]:
    """Whether network namespaces (with a bridge and veth pairs) can be made here, and if not why."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "network namespaces need root (this runs as uid %d)" % os.geteuid()
    probe = f"{PREFIX}-{os.getpid()}-{next(_counter)}-br"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
    except RuntimeError as exc:
        return False, f"cannot make a namespace with a bridge and a veth pair: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def namespaces() -> list[str]:
    """Names of the machine's named network namespaces."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", name], check=False).stdout.split()]


def delete_namespace(name: str) -> None:
    """SIGKILL every process in the namespace, wait until they are gone, delete it."""
    deadline = time.monotonic() + KILL_WAIT_S
    while pids := namespace_pids(name):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            break   # deleted anyway: the namespace goes when its last process does
        time.sleep(0.05)
    _run(["ip", "netns", "del", name], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-...`` whose creating pid is dead. Returns them."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-(?:br|\d+)$")
    swept = []
    for name in namespaces():
        m = pattern.match(name)
        if m and not _alive(int(m.group(1))):
            delete_namespace(name)
            swept.append(name)
    return swept


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of this (the root) namespace's interfaces."""
    out = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    return [ipaddress.ip_interface(m).network for m in re.findall(r"inet (\S+)", out)]


def pick_subnet(pid: int, counter: int, used: Sequence[ipaddress.IPv4Network] = ()) -> ipaddress.IPv4Network:
    """A 10.a.b.0/24 from (pid, counter), skipping any that overlaps used. Distinct for the same pid
    with counters under 16, and for pids that differ modulo 4096."""
    start = ((pid % 4096) * 16 + counter % 16) % 65536
    for step in range(65536):
        idx = (start + step * 16 + step // 4096) % 65536
        net = ipaddress.IPv4Network(f"10.{idx >> 8}.{idx & 255}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


def tbf_burst_bytes(rate_bps: int) -> int:
    """The token bucket's size for a rate in bit/s (see TBF_BURST_S)."""
    return max(TBF_MIN_BURST, int(rate_bps / 8 * TBF_BURST_S))


@dataclass(eq=False)
class Host:
    """One emulated host: a namespace with one address on the shared /24."""
    name: str
    address: str
    rate_bps: int | None = None
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start argv in this host, in its own session (its group is killed on close)."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv), **kw)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
        """Run argv in this host to completion (TimeoutExpired after timeout, the child killed)."""
        return subprocess.run(self.command(argv), timeout=timeout, **kw)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group of every process started here; SIGKILL what outlives grace_s."""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class HostNetwork:
    """N hosts joined by a bridge. rates: each host's egress rate in bit/s (None: unlimited), one
    for all or one per host."""

    def __init__(self, num_hosts: int, rate_bps: int | None | Sequence[int | None] = None) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts must be in 1..200, got {num_hosts}")
        rates = list(rate_bps) if isinstance(rate_bps, (list, tuple)) else [rate_bps] * num_hosts
        if len(rates) != num_hosts:
            raise ValueError(f"rate_bps gives {len(rates)} rates for {num_hosts} hosts")
        for r in rates:
            if r is not None and r < 8000:
                raise ValueError(f"rate_bps must be >= 8000 bit/s, got {r}")
        counter = next(_counter)
        self.prefix = f"{PREFIX}-{os.getpid()}-{counter}"
        self.subnet = pick_subnet(os.getpid(), counter, _used_networks())
        self.bridge_ns = f"{self.prefix}-br"
        base = self.subnet.network_address
        self.hosts = [Host(f"{self.prefix}-{i}", str(base + i + 2), rates[i]) for i in range(num_hosts)]
        self._made: list[str] = []

    def __enter__(self) -> "HostNetwork":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        br = self.bridge_ns
        self._ns(br)
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        for i, host in enumerate(self.hosts):
            self._ns(host.name)
            _run(["ip", "-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", HOST_IFACE,
                  "netns", host.name])
            _run(["ip", "-n", br, "link", "set", f"v{i}", "master", BRIDGE, "up"])
            _run(["ip", "-n", host.name, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", HOST_IFACE])
            _run(["ip", "-n", host.name, "link", "set", HOST_IFACE, "up"])
            if host.rate_bps is not None:
                self.set_rate(host, host.rate_bps)

    def set_rate(self, host: Host, rate_bps: int | None) -> None:
        """Limit (or, with None, unlimit) a host's egress."""
        _run(["ip", "netns", "exec", host.name, "tc", "qdisc", "del", "dev", HOST_IFACE, "root"], check=False)
        host.rate_bps = rate_bps
        if rate_bps is not None:
            if shutil.which("tc") is None:
                raise RuntimeError("link rates need the `tc` command (iproute2)")
            _run(["ip", "netns", "exec", host.name, "tc", "qdisc", "add", "dev", HOST_IFACE, "root", "tbf",
                  "rate", f"{rate_bps}bit", "burst", str(tbf_burst_bytes(rate_bps)), "latency", TBF_LATENCY])

    def close(self) -> None:
        """Stop what the hosts started, kill whatever else runs in them, delete every namespace."""
        for host in self.hosts:
            host.stop()
        for name in reversed(self._made):
            delete_namespace(name)
        self._made.clear()


# ---- link check -----------------------------------------------------------------------------------
_RECEIVER = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[3]))
buf = bytearray(1 << 20); n = 0; first = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    if first is None:
        first = time.perf_counter()
    n += k
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - (first or time.perf_counter())}), flush=True)
"""
_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(chunk)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def measure_throughput(sender: Host, receiver: Host, mib: int = 32, port: int = 5201,
                       timeout: float = 60.0) -> float:
    """Raw TCP throughput (bytes/s) of one stream from sender to receiver: mib MiB, timed by the
    receiver from its first byte to the end of the stream."""
    if mib < 1:
        raise ValueError(f"mib must be >= 1, got {mib}")
    rx = receiver.popen([sys.executable, "-c", _RECEIVER, receiver.address, str(port), str(timeout)],
                        stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([rx.stdout], [], [], timeout)
        if not ready or rx.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the receiver in {receiver.name} did not start within {timeout:g}s "
                               f"(exit code {rx.poll()})")
        sender.run([sys.executable, "-c", _SENDER, receiver.address, str(port), str(mib), str(timeout)],
                   timeout=timeout, check=True)
        out, _ = rx.communicate(timeout=timeout)
    finally:
        if rx.poll() is None:
            _signal_group(rx, signal.SIGKILL)
        rx.wait()
        receiver.procs.remove(rx)
    result = json.loads(out)
    if result["bytes"] != mib << 20:
        raise RuntimeError(f"the receiver got {result['bytes']} bytes of {mib << 20}")
    return result["bytes"] / max(result["seconds"], 1e-9)
