"""Hostile neighbours against the raw TCP KV data plane and the /metrics endpoints: connections
that never prove anything and drip a byte now and then, from one loopback address and from
several (all of 127.0.0.0/8 is loopback). They are closed within the handshake's absolute
deadline, they never take a slot of the data plane's connection bound, and while they hold the
unproved pool the deployment's requests go on at their usual pace: a transfer that cannot have
the data plane goes over the gRPC stream instead of failing. The listener's bounds and the
sender's fallback are also checked on their own, without processes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.client import AsyncClient
from pdserve.services.kv_transfer import KVBlock, KVTransferError, tcp_wire
from pdserve.services.kv_transfer.base import KVStream, SendResult
from pdserve.services.kv_transfer.tcp_receiver import DataPlaneLimits, KVDataListener
from pdserve.services.kv_transfer.tcp_transport import TcpKVSender, split_address
from tests.certs import make_ca_and_cert
from tests.conftest import random_prompts
from tests.serving import assert_blocks_at_baseline, channel, start_cluster, workers

CLUSTER = "the-cluster-token"
HANDSHAKE_S = 5.0        # the deployment's handshake deadline (DataPlaneLimits' default)
METRICS_READ_S = 5.0     # services.common.metrics.READ_TIMEOUT_S
SLACK_S = 4.0            # a shared 2-core machine's scheduling noise, on top of a deadline
SOURCES = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
LANES_PER_SOURCE = 6     # 30 drippers: past the unproved pool (16) and past each address's share (4)
PROMPTS = random_prompts(4, 20, 60, seed=41)
MAX_NEW = 8


# ---- a dripping neighbour ---------------------------------------------------------------------

@dataclass
class Drip:
    opened_at: float
    closed_at: float | None = None
    turned_away: bool = False          # closed at accept: its first bytes were an ERROR record


@dataclass
class DripLanes:
    """Connections from sources to target that never prove anything: each sends one byte of
    payload every drip_s; when the server closes one, its lane opens another (reopen)."""
    target: tuple[str, int]
    sources: list[str]
    payload: bytes = b"P"
    drip_s: float = 1.0
    reopen: bool = True
    wrap: Callable[[socket.socket], socket.socket] | None = None   # a TLS client's session, say
    drips: list[Drip] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> "DripLanes":
        for i, source in enumerate(self.sources):
            thread = threading.Thread(target=self._lane, args=(source,), name=f"drip-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped_at = time.monotonic()
        self._stop.set()
        deadline = time.monotonic() + 10
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a drip lane did not stop"

    def snapshot(self) -> list[Drip]:
        with self._lock:
            return list(self.drips)

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.snapshot()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not seen within {timeout}s: {self.snapshot()}")
            time.sleep(0.05)

    def _lane(self, source: str) -> None:
        while not self._stop.is_set():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((source, 0))
                sock.settimeout(5)
                sock.connect(self.target)
                if self.wrap is not None:
                    sock = self.wrap(sock)
            except OSError:
                sock.close()
                self._stop.wait(0.2)
                continue
            drip = Drip(time.monotonic())
            with self._lock:
                self.drips.append(drip)
            self._drip(sock, drip)
            sock.close()
            if not self.reopen:
                return
            if drip.turned_away:
                self._stop.wait(0.2)   # not a busy loop on a 2-core machine

    def _drip(self, sock: socket.socket, drip: Drip) -> None:
        sock.settimeout(self.drip_s)
        first, sent = True, 0
        while not self._stop.is_set():
            try:
                data = sock.recv(4096)
            except socket.timeout:
                try:
                    sock.send(self.payload[sent % len(self.payload):][:1])
                    sent += 1
                except OSError:
                    break
                continue
            except OSError:
                break
            if not data:
                break
            if first:
                drip.turned_away = data[0] == tcp_wire.ERROR
                first = False
        else:
            return   # stopped by us: still open
        drip.closed_at = time.monotonic()


def _lifetimes(drips: list[Drip], until: float) -> list[float]:
    return [(d.closed_at if d.closed_at is not None else until) - d.opened_at for d in drips]


# ---- against a deployment ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str):
    # a small connection bound: the old plane, whose drippers took its slots, ran out with 8
    cluster = start_cluster(tiny_qwen3, worker_args=["--kv-data-plane", "tcp", "--kv-data-max-connections", "8"])
    try:
        yield cluster
    finally:
        cluster.stop()


def _data_address(cluster) -> tuple[str, int]:
    decode = workers(cluster, "decode")[0]
    with channel(cluster, decode) as ch:
        res = worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(worker_pb2.ReserveRequest(
            request_id="probe", prompt_token_ids=PROMPTS[0], params=common_pb2.SamplingParams(max_tokens=2)),
            timeout=10)
        worker_pb2_grpc.WorkerStub(ch).Abort(common_pb2.AbortRequest(request_id="probe"), timeout=10)
    assert res.data_address, "the decode worker names no TCP data plane"
    return split_address(res.data_address)


async def _generate(address: str) -> list[tuple[float, object]]:
    async with AsyncClient(address, timeout=60) as client:
        async def one(prompt: list[int]):
            began = time.monotonic()
            out = await client.generate(prompt, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            return time.monotonic() - began, out
        return await asyncio.gather(*(one(p) for p in PROMPTS))


def test_dripping_strangers_neither_hold_the_kv_data_plane_nor_slow_requests(cluster) -> None:
    target = _data_address(cluster)
    with DripLanes(target, SOURCES * LANES_PER_SOURCE) as lanes:
        began = time.monotonic()
        lanes.wait(lambda ds: any(d.turned_away for d in ds), 20, "a dripper turned away (the unproved pool full)")
        attacked = asyncio.run(_generate(cluster.router_address))
        # hold on past a deadline, so that the first drippers' ends are measured
        lanes.wait(lambda ds: time.monotonic() - began > HANDSHAKE_S + SLACK_S + 1, 60, "the attack's length")
    drips = lanes.snapshot()
    after = asyncio.run(_generate(cluster.router_address))
    lives = _lifetimes([d for d in drips if not d.turned_away], lanes.stopped_at)
    print(f"{len(drips)} drip connections, {sum(d.turned_away for d in drips)} turned away at accept; admitted ones "
          f"lived at most {max(lives):.2f}s; request latency under attack "
          f"{max(t for t, _ in attacked):.2f}s, after {max(t for t, _ in after):.2f}s")
    assert max(lives) <= HANDSHAKE_S + SLACK_S, sorted(lives)[-5:]
    assert any(d.closed_at is not None and d.closed_at - d.opened_at >= HANDSHAKE_S - 0.5 for d in drips), \
        "no dripper lived to the deadline: nothing was measured"
    # one turned away just before the lanes stopped may not have seen its close yet: count it open till then
    turned = _lifetimes([d for d in drips if d.turned_away], lanes.stopped_at)
    assert turned and max(turned) < SLACK_S, turned   # closed at accept, not at a deadline
    for (seconds, out), (_, reference) in zip(attacked, after):
        assert out.finish_reason == "length" and list(out.token_ids) == list(reference.token_ids)
        assert out.timings["migrations"] == 0 and out.timings["kv_bytes"] > 0, out.timings
        assert seconds < 10.0, seconds   # the old plane: 10 s of refusals, then a migration or a 503
    assert_blocks_at_baseline(cluster)


def test_a_metrics_endpoint_closes_a_dripping_request_and_bounds_each_address(cluster) -> None:
    decode = next(p for p in cluster.processes if p.name.startswith("decode"))
    host, port = split_address(decode.metrics_address)
    headers = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 4096
    with DripLanes((host, port), ["127.0.0.6"], payload=headers, reopen=False) as one:
        one.wait(lambda ds: bool(ds) and ds[0].closed_at is not None, METRICS_READ_S + SLACK_S + 2,
                 "the dripping request closed")
    life = one.snapshot()[0].closed_at - one.snapshot()[0].opened_at
    print(f"a dripping /metrics request lived {life:.2f}s")
    assert METRICS_READ_S - 0.5 <= life <= METRICS_READ_S + SLACK_S, life
    # nine from one address: the ninth is closed at once, the other eight wait for their deadline
    with DripLanes((host, port), ["127.0.0.7"] * 9, payload=headers, drip_s=0.5, reopen=False) as nine:
        nine.wait(lambda ds: len(ds) == 9 and any(d.closed_at is not None for d in ds), 10, "one of nine closed")
        early = [d for d in nine.snapshot() if d.closed_at is not None and d.closed_at - d.opened_at < 2]
        assert len(early) == 1, nine.snapshot()
    # and the endpoint still answers
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert sock.recv(12).startswith(b"HTTP/1.0 200")


# ---- the listener and the sender on their own ------------------------------------------------

class _NoSink:
    """A sink no test here reaches: only handshakes happen."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the sink was reached ({name})")


def _raw(listener: KVDataListener, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", listener.port))
    return sock


def _greeting(sock: socket.socket) -> bytes:
    """The first bytes the listener sends: MAGIC (a handshake began) or an ERROR record then EOF."""
    data = sock.recv(1)
    if data and data[0] == tcp_wire.ERROR:
        rest = bytearray(tcp_wire.HEADER.size - 1)
        tcp_wire.recv_exact(sock, memoryview(rest))
        _, length = tcp_wire.HEADER.unpack(data + rest)
        body = bytearray(length)
        tcp_wire.recv_exact(sock, memoryview(body))
        assert sock.recv(1) == b""   # then closed
        return bytes(body)
    tcp_wire.recv_exact(sock, memoryview(bytearray(len(tcp_wire.MAGIC) + tcp_wire.NONCE_BYTES - 1)))
    return tcp_wire.MAGIC


def _wait(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.01)


def test_unproved_connections_are_bounded_per_address_and_in_all_and_hold_no_slot() -> None:
    limits = DataPlaneLimits(max_connections=1, max_unauthenticated=3, max_unauthenticated_per_peer=2,
                             handshake_timeout_s=30)
    listener = KVDataListener(_NoSink(), "127.0.0.1", cluster_token=CLUSTER, limits=limits).start()
    held: list[socket.socket] = []
    try:
        held += [_raw(listener, "127.0.0.2"), _raw(listener, "127.0.0.2")]
        assert [_greeting(s) for s in held] == [tcp_wire.MAGIC] * 2
        with _raw(listener, "127.0.0.2") as third:   # a third from that address: closed at once
            assert _greeting(third).startswith(b"RESOURCE_EXHAUSTED\n")
        held.append(_raw(listener, "127.0.0.3"))      # another address is let in ...
        assert _greeting(held[-1]) == tcp_wire.MAGIC
        with _raw(listener, "127.0.0.4") as fourth:   # ... up to the pool's bound
            assert _greeting(fourth).startswith(b"RESOURCE_EXHAUSTED\n")
        assert listener.turned_away == 2
        held.pop(0).close()   # one leaves: its address may come again
        _wait(lambda: listener._unproved.get("127.0.0.2") == 1)
        with _raw(listener, "127.0.0.2") as again:
            assert _greeting(again) == tcp_wire.MAGIC
        # the unproved hold no slot of the data plane (max_connections=1): a member proves and is served
        _wait(lambda: sum(listener._unproved.values()) < 3)
        pool = TcpKVSender(cluster_token=CLUSTER).pool
        held.append(pool.acquire(listener.address()))   # proved: the one slot is the member's
        with pytest.raises(tcp_wire.Refused) as err:
            pool.acquire(listener.address())           # proved, but no slot is left
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert sum(listener._unproved.values()) == 2   # neither counts as unproved any more
    finally:
        for sock in held:
            sock.close()
        listener.close()


def test_a_burst_of_transfers_waits_its_turn_to_prove_and_is_never_turned_away() -> None:
    """A prefill worker starting 16 transfers to one decode worker at once handshakes at most
    UNPROVED_PER_PEER at a time (the listener's bound per address): every connection is proved,
    none is turned away to the gRPC fallback."""
    listener = KVDataListener(_NoSink(), "127.0.0.1", cluster_token=CLUSTER, limits=DataPlaneLimits()).start()
    pool = TcpKVSender(cluster_token=CLUSTER).pool
    socks: list[socket.socket] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            socks += ex.map(lambda _: pool.acquire(listener.address()), range(16))
        assert len(socks) == 16 and listener.turned_away == 0 and pool.connects == 16
    finally:
        for sock in socks:
            sock.close()
        listener.close()


@pytest.mark.parametrize("tls", [False, True])
def test_the_handshake_deadline_is_absolute_however_the_bytes_drip(tmp_path, tls: bool) -> None:
    """A byte every 0.3 s of the token proof (in the clear, or in TLS records after a prompt TLS
    handshake with the deployment's own certificate) never lets a 1 s per-read timeout fire: the
    deadline from the accept does."""
    server = wrap = None
    if tls:
        files = make_ca_and_cert(tmp_path)
        ours = tuple(str(files[n]) for n in ("cert.pem", "key.pem", "ca.pem"))
        server, client = tcp_wire.server_context(*ours), tcp_wire.client_context(*ours)
        wrap = lambda sock: client.wrap_socket(sock, server_hostname="127.0.0.1")   # noqa: E731
    limits = DataPlaneLimits(handshake_timeout_s=1.0)
    listener = KVDataListener(_NoSink(), "127.0.0.1", cluster_token=CLUSTER, tls=server, limits=limits).start()
    try:
        with DripLanes(("127.0.0.1", listener.port), ["127.0.0.1"], drip_s=0.3, reopen=False, wrap=wrap) as lane:
            lane.wait(lambda ds: bool(ds) and ds[0].closed_at is not None, 1.0 + SLACK_S + 2, "the dripper closed")
        life = lane.snapshot()[0].closed_at - lane.snapshot()[0].opened_at
        assert 0.9 <= life <= 1.0 + SLACK_S, life
        _wait(lambda: not listener._unproved)   # and it left the unproved pool
    finally:
        listener.close()


class _Recording(KVStream):
    """A fallback stream that keeps what it is given."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.beats = 0
        self.cancelled = False

    async def send(self, blocks) -> None:
        self.sent += [b.block_index for b in blocks]

    async def heartbeat(self) -> None:
        self.beats += 1

    async def finish(self, timeout: float | None = None) -> SendResult:
        return SendResult(len(self.sent), 7 * len(self.sent), 0.0, codec="grpc-fallback")

    async def cancel(self) -> None:
        self.cancelled = True


def _block(i: int) -> KVBlock:
    return KVBlock("rid", i, 1000 + i, torch.zeros(2, 2, 8, 1, 4))


@pytest.mark.parametrize("refusal", ["turned-away", "nobody-listening"])
def test_a_transfer_the_data_plane_refuses_goes_over_its_fallback(refusal: str) -> None:
    limits = DataPlaneLimits(max_unauthenticated_per_peer=1, handshake_timeout_s=30)
    listener = KVDataListener(_NoSink(), "127.0.0.1", cluster_token=CLUSTER, limits=limits).start()
    dripper = _raw(listener)   # holds 127.0.0.1's one unproved place
    assert _greeting(dripper) == tcp_wire.MAGIC
    target = listener.address()
    if refusal == "nobody-listening":
        dripper.close()
        listener.close()

    async def run(fallback: bool):
        sender = TcpKVSender(cluster_token=CLUSTER)
        recording = _Recording()
        stream = sender.open(target, "rid", b"t" * 16, fallback=(lambda: recording) if fallback else None)
        try:
            await stream.heartbeat()
            await stream.send([_block(0), _block(1)])
            await stream.send([_block(2)])
            return await stream.finish(timeout=20), recording, sender.fallbacks
        finally:
            await sender.close()
    try:
        result, recording, fallbacks = asyncio.run(run(fallback=True))
        assert recording.sent == [0, 1, 2] and (result.blocks, result.codec) == (3, "grpc-fallback")
        assert fallbacks == 1 and not recording.cancelled
        if refusal == "turned-away":
            assert listener.turned_away >= 1
        else:   # without a fallback the transfer fails, as before
            with pytest.raises(KVTransferError) as err:
                asyncio.run(run(fallback=False))
            assert err.value.code == "UNAVAILABLE"
    finally:
        dripper.close()
        listener.close()
