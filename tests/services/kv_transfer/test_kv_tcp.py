"""The raw TCP KV data plane's own guarantees, over real sockets on loopback into a real decode
engine's connector: a peer without the cluster token is refused before any work, an oversized
length prefix is refused before any allocation, a byte flipped on the path fails closed with
nothing cached, mutual TLS, the connection bound, connection reuse, and the receiver's reads
(a frame's body and the next header in one receive). The cases it shares
with the gRPC stream (exact blocks, bad blocks, wrong token, cancel) run in test_kv_transport."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
import tracemalloc
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import HandoffState
from pdserve.services.kv_transfer import KVBlock, KVTransferError, tcp_wire
from pdserve.services.kv_transfer.tcp_receiver import DataPlaneLimits, KVDataListener
from pdserve.services.kv_transfer.tcp_transport import TcpKVSender
from tests.certs import make_ca_and_cert
from tests.conftest import assert_no_leak, random_prompts

PROMPT = random_prompts(1, 60, 60, seed=78)[0]          # 8 blocks of 8 (the last one partial)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CLUSTER = "the-cluster-token"


@contextmanager
def listening(engine: LLMEngine, **kwargs) -> Iterator[KVDataListener]:
    listener = KVDataListener(engine.kv, "127.0.0.1", cluster_token=kwargs.pop("cluster_token", CLUSTER),
                              **kwargs).start()
    try:
        yield listener
    finally:
        listener.close()


def _blocks(rid: str, engine: LLMEngine) -> list[KVBlock]:
    hashes = transfer_block_hashes(PROMPT, 8)
    g = torch.Generator().manual_seed(3)
    return [KVBlock(rid, i, hashes[i], torch.randn(engine.runner.block_shape, generator=g)) for i in range(8)]


def _push(sender: TcpKVSender, target: str, rid: str, token: bytes, blocks: list[KVBlock]):
    async def run():
        stream = sender.open(target, rid, token)
        await stream.send(blocks)
        try:
            return await stream.finish(timeout=10)
        finally:
            await sender.close()
    return asyncio.run(run())


def _connect(listener: KVDataListener) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
    return sock


def test_a_peer_without_the_cluster_token_is_refused_before_any_work(engine: LLMEngine) -> None:
    rid = "tcp-stranger"
    res = engine.reserve(rid, PROMPT, GREEDY)
    with listening(engine) as listener:
        with pytest.raises(KVTransferError) as err:
            _push(TcpKVSender(cluster_token="another-deployment"), listener.address(), rid, res.transfer_token,
                  _blocks(rid, engine))
        assert err.value.code == "UNAUTHENTICATED" and "cluster token" in str(err.value)
        # by hand: a wrong proof, then a frame header declaring 60 MiB: refused, nothing allocated
        with _connect(listener) as sock:
            tcp_wire.recv_exact(sock, memoryview(bytearray(len(tcp_wire.MAGIC) + tcp_wire.NONCE_BYTES)))
            tracemalloc.start()
            sock.sendall(tcp_wire.MAGIC + bytes(tcp_wire.NONCE_BYTES + tcp_wire.PROOF_BYTES)
                         + tcp_wire.HEADER.pack(tcp_wire.FRAME, 60 << 20))
            kind, body = tcp_wire.read_small(sock)
            assert sock.recv(1) == b""   # then closed
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert kind == tcp_wire.ERROR and body.startswith(b"UNAUTHENTICATED\n")
        assert peak < 1 << 20, peak
    assert engine.kv.state(rid) is HandoffState.RESERVED   # a stranger cannot touch it
    engine.abort(rid)
    assert_no_leak(engine)


def test_without_a_cluster_token_the_listener_stays_on_loopback(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="not loopback.*cluster token"):
        KVDataListener(engine.kv, "10.255.0.1", cluster_token=None)
    rid = "tcp-open-loopback"   # --insecure-no-auth on loopback: both ends without a token
    res = engine.reserve(rid, PROMPT, GREEDY)
    with listening(engine, cluster_token=None) as listener:
        result = _push(TcpKVSender(), listener.address(), rid, res.transfer_token, _blocks(rid, engine))
    assert result.blocks == 8 and engine.kv.state(rid) is HandoffState.READY
    engine.abort(rid)
    assert_no_leak(engine)


def test_an_oversized_length_prefix_is_refused_before_allocation(engine: LLMEngine) -> None:
    with listening(engine) as listener, _connect(listener) as sock:
        tcp_wire.client_handshake(sock, tcp_wire.auth_key(CLUSTER), listener.address())
        tracemalloc.start()
        sock.sendall(tcp_wire.HEADER.pack(tcp_wire.FRAME, tcp_wire.MAX_RECORD_BYTES + 1))
        kind, body = tcp_wire.read_small(sock)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert kind == tcp_wire.ERROR and body.startswith(b"INVALID_ARGUMENT\n") and b"over its limit" in body
    assert peak < 1 << 20, peak


class FlippingRelay:
    """A TCP relay on loopback that flips the byte at offset `at` of what the sender writes."""

    def __init__(self, upstream: int, at: int) -> None:
        self.upstream, self.at = upstream, at
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(("127.0.0.1", self.upstream))
        threading.Thread(target=self._pump, args=(client, upstream, lambda n, d: self._flip(n, d)), daemon=True).start()
        self._pump(upstream, client, lambda n, d: d)

    def _flip(self, offset: int, data: bytes) -> bytes:
        if offset <= self.at < offset + len(data):
            data = bytearray(data)
            data[self.at - offset] ^= 0x01
        return bytes(data)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, rewrite: Callable[[int, bytes], bytes]) -> None:
        offset = 0
        try:
            while data := src.recv(1 << 16):
                dst.sendall(rewrite(offset, data))
                offset += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def test_a_byte_flipped_on_the_path_fails_closed_and_nothing_is_cached(engine: LLMEngine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rid = "tcp-flipped"
    res = engine.reserve(rid, PROMPT, GREEDY)
    with listening(engine) as listener:
        relay = FlippingRelay(listener.port, at=40_000)   # past the handshake and the open frame: a payload byte
        # An on-path attacker leaves the address dialed as it is: the handshake names the listener.
        handshake = tcp_wire.client_handshake
        monkeypatch.setattr(tcp_wire, "client_handshake", lambda sock, key, target="": handshake(
            sock, key, listener.address()))
        try:
            with pytest.raises(KVTransferError) as err:
                _push(TcpKVSender(cluster_token=CLUSTER), f"127.0.0.1:{relay.port}", rid, res.transfer_token,
                      _blocks(rid, engine))
        finally:
            relay.close()
    assert err.value.code == "DATA_LOSS" and "fails its MAC" in str(err.value)
    assert engine.kv.state(rid) is HandoffState.FAILED
    again = engine.reserve(rid + "-again", PROMPT, GREEDY)   # no block of the refused transfer cached
    assert again.held_block_hashes == [] and again.needed_block_indices == list(range(8)), again
    engine.abort(rid + "-again")
    assert_no_leak(engine)


class _ConnectorCalls:
    """Counts the connector's claimed runs (read straight from the socket into the pool) and its
    stored runs (accept_many: from a received buffer)."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.claimed = self.stored = 0
        claim, store = engine.kv.claim_run, engine.kv.accept_many

        def claim_run(*args):
            run = claim(*args)
            self.claimed += run is not None
            return run

        def accept_many(*args):
            self.stored += 1
            return store(*args)
        monkeypatch.setattr(engine.kv, "claim_run", claim_run)
        monkeypatch.setattr(engine.kv, "accept_many", accept_many)


def test_a_frame_of_whole_blocks_goes_from_the_socket_straight_into_the_pool(engine: LLMEngine,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On a plain socket every data frame's payload is received into its blocks' place in the pool
    (no buffer, no pool copy), and lands bit-exact."""
    rid = "tcp-direct"
    res = engine.reserve(rid, PROMPT, GREEDY)
    calls = _ConnectorCalls(engine, monkeypatch)
    blocks = _blocks(rid, engine)
    with listening(engine) as listener:
        result = _push(TcpKVSender(cluster_token=CLUSTER, frame_target=3 * blocks[0].encode()[1].nbytes),
                       listener.address(), rid, res.transfer_token, blocks)
    assert result.blocks == 8 and engine.kv.state(rid) is HandoffState.READY
    assert (calls.claimed, calls.stored) == (3, 0)   # frames of 3, 3 and 2 blocks
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    for j, block in enumerate(blocks):
        assert torch.equal(stored[j], block.data.to(stored.dtype))
    engine.abort(rid)
    assert_no_leak(engine)


def test_a_frame_whose_headers_outgrow_the_first_read_still_goes_straight_into_the_pool(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """60 blocks in one frame, announced by headers longer than the receiver's first read
    (HEAD_READ_BYTES): it reads on until the payload begins, then the payload goes to the pool."""
    from pdserve.services.kv_transfer.tcp_receiver import HEAD_READ_BYTES
    rid = "tcp-many-headers-" + "x" * 64
    prompt = random_prompts(1, 480, 480, seed=79)[0]
    res = engine.reserve(rid, prompt, GREEDY)
    hashes = transfer_block_hashes(prompt, 8)
    g = torch.Generator().manual_seed(4)
    blocks = [KVBlock(rid, i, hashes[i], torch.randn(engine.runner.block_shape, generator=g)) for i in range(60)]
    assert sum(len(b.encode()[0].SerializeToString()) for b in blocks) > HEAD_READ_BYTES
    calls = _ConnectorCalls(engine, monkeypatch)
    with listening(engine) as listener:
        result = _push(TcpKVSender(cluster_token=CLUSTER, frame_target=1 << 22), listener.address(), rid,
                       res.transfer_token, blocks)
    assert result.blocks == 60 and engine.kv.state(rid) is HandoffState.READY
    assert (calls.claimed, calls.stored) == (1, 0)
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    assert all(torch.equal(stored[j], block.data) for j, block in enumerate(blocks))
    engine.abort(rid)
    assert_no_leak(engine)


def test_mutual_tls_carries_a_transfer_and_refuses_a_stranger_certificate(engine: LLMEngine, tmp_path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    files = make_ca_and_cert(tmp_path)
    ours = tuple(str(files[n]) for n in ("cert.pem", "key.pem", "ca.pem"))
    stranger = (str(files["other-cert.pem"]), str(files["other-key.pem"]), str(files["ca.pem"]))
    rid = "tcp-tls"
    res = engine.reserve(rid, PROMPT, GREEDY)
    with listening(engine, tls=tcp_wire.server_context(*ours)) as listener:
        with pytest.raises(KVTransferError) as err:
            _push(TcpKVSender(cluster_token=CLUSTER, tls=tcp_wire.client_context(*stranger)), listener.address(),
                  rid, res.transfer_token, _blocks(rid, engine))
        assert err.value.code == "UNAVAILABLE"   # the TLS handshake fails: no byte of KV left
        assert engine.kv.state(rid) is HandoffState.RESERVED
        sender = TcpKVSender(cluster_token=CLUSTER, tls=tcp_wire.client_context(*ours))
        calls = _ConnectorCalls(engine, monkeypatch)
        result = _push(sender, listener.address(), rid, res.transfer_token, _blocks(rid, engine))
    assert (result.blocks, result.streams) == (8, 1)
    assert calls.claimed == 0 and calls.stored >= 1   # TLS decrypts into a buffer: stored from there
    assert engine.kv.state(rid) is HandoffState.READY
    engine.abort(rid)
    assert_no_leak(engine)


def test_connections_are_bounded(engine: LLMEngine) -> None:
    with listening(engine, limits=DataPlaneLimits(max_connections=1)) as listener:
        with _connect(listener) as held:
            tcp_wire.client_handshake(held, tcp_wire.auth_key(CLUSTER), listener.address())
            with _connect(listener) as second, pytest.raises(tcp_wire.Refused) as err:
                tcp_wire.client_handshake(second, tcp_wire.auth_key(CLUSTER), listener.address())
    assert err.value.code == "RESOURCE_EXHAUSTED"


def test_a_beat_goes_over_an_idle_pooled_connection_when_the_receiver_is_at_its_bound(engine: LLMEngine) -> None:
    """The receiver serves 2 connections and both are the sender's idle pooled ones (left by two
    transfers that overlapped): the lost beat connection is remade from one of them, not refused,
    so a queued request's lease is still kept."""
    from pdserve.services.kv_transfer import frames
    from pdserve.services.kv_transfer.frames import encode_open
    rid = "tcp-beat-pooled"
    res = engine.reserve(rid, PROMPT, GREEDY)
    mac = frames.StreamMac(frames.mac_key(res.transfer_token, CLUSTER), frames.PREFERRED)
    opened = encode_open(rid, res.transfer_token, mac)
    sender = TcpKVSender(cluster_token=CLUSTER)
    with listening(engine, limits=DataPlaneLimits(max_connections=2)) as listener:
        target = listener.address()
        held = [sender.pool.acquire(target), sender.pool.acquire(target)]
        for sock in held:
            sender.pool.release(target, sock)          # two idle connections: the receiver's bound
        before = engine.kv.receiving[rid].expires_at
        time.sleep(0.05)   # kept: the clock moves, so an extended lease is told from the old one
        sender.pool.beat(target, opened)
        deadline = time.monotonic() + 5
        while engine.kv.receiving[rid].expires_at == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.kv.receiving[rid].expires_at > before, "the beat was dropped"
        assert sender.pool.connects == 2                  # made from a pooled connection: none refused
        asyncio.run(sender.close())
    engine.abort(rid)
    assert_no_leak(engine)


def test_a_connection_carries_transfer_after_transfer(engine: LLMEngine) -> None:
    sender = TcpKVSender(cluster_token=CLUSTER)

    async def two_transfers(target: str) -> None:
        for rid in ("tcp-reuse-1", "tcp-reuse-2"):
            res = engine.reserve(rid, PROMPT, GREEDY)
            stream = sender.open(target, rid, res.transfer_token)
            sent_at = time.perf_counter()
            await stream.send(_blocks(rid, engine))
            result = await stream.finish(timeout=10)
            # when the acknowledgement arrived (the exposed hand-off ends there), not when the loop woke
            assert sent_at < result.acked_at <= time.perf_counter() and result.blocks == 8
            assert engine.kv.state(rid) is HandoffState.READY
            engine.abort(rid)
        await sender.close()
    with listening(engine) as listener:
        asyncio.run(two_transfers(listener.address()))
    assert sender.pool.connects == 1
    assert_no_leak(engine)


def test_a_stalled_transfer_waits_as_long_as_its_reservation_lives(engine: LLMEngine) -> None:
    """A sender silent past frame_timeout_s (a frozen prefill worker) is waited for while its
    reservation lives; once the reservation ends, the connection ends with it."""
    limits = DataPlaneLimits(frame_timeout_s=0.1, poll_s=0.05)

    async def stall_then_send(target: str, rid: str, token: bytes, before_send=None):
        sender = TcpKVSender(cluster_token=CLUSTER)
        stream = sender.open(target, rid, token)
        blocks = _blocks(rid, engine)
        await stream.send(blocks[:2])   # the transfer is under way, then the sender goes quiet
        await asyncio.sleep(0.4)        # kept (both): the quiet sender is what is tested
        if before_send is not None:
            before_send()
            await asyncio.sleep(0.4)
        await stream.send(blocks[2:])
        try:
            return await stream.finish(timeout=10)
        finally:
            await sender.close()
    with listening(engine, limits=limits) as listener:
        res = engine.reserve("tcp-stall", PROMPT, GREEDY)
        assert asyncio.run(stall_then_send(listener.address(), "tcp-stall", res.transfer_token)).blocks == 8
        engine.abort("tcp-stall")
        res = engine.reserve("tcp-stall-aborted", PROMPT, GREEDY)
        with pytest.raises(KVTransferError) as err:
            asyncio.run(stall_then_send(listener.address(), "tcp-stall-aborted", res.transfer_token,
                                        lambda: engine.abort("tcp-stall-aborted")))
        assert err.value.code == "DEADLINE_EXCEEDED" and "reservation ended" in str(err.value), err.value
    assert_no_leak(engine)


def test_a_backlog_of_queued_streams_keeps_its_reservations_without_holding_connections(engine: LLMEngine) -> None:
    """More requests queued on a prefill worker than the decode worker serves connections: their
    streams' heartbeats (beats over one shared connection) keep every reservation alive, and each
    transfer, when its blocks come, takes a pooled connection."""
    rids = [f"tcp-queued-{i}" for i in range(5)]
    sender = TcpKVSender(cluster_token=CLUSTER)

    async def queued_then_sent(target: str) -> None:
        tokens = {rid: engine.reserve(rid, PROMPT, GREEDY, lease_s=0.3).transfer_token for rid in rids}
        streams = {rid: sender.open(target, rid, tokens[rid]) for rid in rids}
        for _ in range(4):   # queued for 0.8 s, past the 0.3 s lease, saying so every 0.2 s
            for stream in streams.values():
                await stream.heartbeat()
            await asyncio.sleep(0.2)
        assert engine.kv.expire() == []
        assert all(engine.kv.state(rid) is HandoffState.RESERVED for rid in rids)
        for rid, stream in streams.items():   # prefilled one after another
            await stream.send(_blocks(rid, engine))
            assert (await stream.finish(timeout=10)).blocks == 8
            assert engine.kv.state(rid) is HandoffState.READY
        await sender.close()
    with listening(engine, limits=DataPlaneLimits(max_connections=2)) as listener:
        asyncio.run(queued_then_sent(listener.address()))
    assert sender.pool.connects == 2   # the beat connection and one reused for every transfer
    for rid in rids:
        engine.abort(rid)
    assert_no_leak(engine)


class _HeldBlock(KVBlock):
    """A block whose bytes are being read (encoded) until the test lets go."""
    reading = threading.Event()
    release = threading.Event()

    def encode(self, with_checksum: bool = False):
        _HeldBlock.reading.set()
        assert _HeldBlock.release.wait(10)
        return super().encode(with_checksum)


def test_cancel_returns_only_once_no_block_is_being_read(engine: LLMEngine) -> None:
    """The prefill hands this sender views of pinned pool blocks and releases them once cancel()
    returns (KVStream.takes_views): a block being encoded meanwhile must be done first."""
    rid = "tcp-cancel-while-reading"
    res = engine.reserve(rid, PROMPT, GREEDY)
    sender = TcpKVSender(cluster_token=CLUSTER)
    b = _blocks(rid, engine)[0]
    held = _HeldBlock(b.request_id, b.block_index, b.block_hash, b.data)

    async def cancel_mid_read(target: str) -> None:
        stream = sender.open(target, rid, res.transfer_token)
        assert stream.takes_views
        await stream.send([held])
        assert await asyncio.to_thread(_HeldBlock.reading.wait, 10)
        cancel = asyncio.ensure_future(stream.cancel())
        await asyncio.sleep(0.3)                  # kept: a window in which the cancel must not complete
        assert not cancel.done()                  # the block is still being read
        _HeldBlock.release.set()
        await asyncio.wait_for(cancel, 5)
        await sender.close()
    with listening(engine) as listener:
        asyncio.run(cancel_mid_read(listener.address()))
    engine.abort(rid)
    assert_no_leak(engine)

class _CountingSocket:
    """A real socket whose receives are counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.receives = sock, 0

    def recv_into(self, view, nbytes: int = 0) -> int:
        self.receives += 1
        return self.sock.recv_into(view, nbytes)


def test_the_end_record_comes_with_the_last_frame_and_lengths_are_bounded_first() -> None:
    a, b = socket.socketpair()
    with a, b:
        counted = _CountingSocket(b)
        reader = tcp_wire.RecordReader(counted)
        a.sendall(tcp_wire.record(tcp_wire.FRAME, b"hello") + tcp_wire.record(tcp_wire.END))
        assert reader.header(at_start=True) == (tcp_wire.FRAME, 5)
        assert bytes(reader.body(5)) == b"hello"
        receives = counted.receives
        assert reader.header() == (tcp_wire.END, 0)
        assert counted.receives == receives              # read along with the body: no wait on the socket
        a.sendall(tcp_wire.record(tcp_wire.FRAME, b"abc") + tcp_wire.record(tcp_wire.FRAME, b"xy")[:3])
        assert reader.header() == (tcp_wire.FRAME, 3)
        assert bytes(reader.body(3)) == b"abc"
        a.sendall(tcp_wire.record(tcp_wire.FRAME, b"xy")[3:])   # the rest of a header read in part
        assert reader.header() == (tcp_wire.FRAME, 2)
        assert bytes(reader.body(2)) == b"xy"
        a.sendall(tcp_wire.HEADER.pack(tcp_wire.FRAME, tcp_wire.MAX_RECORD_BYTES + 1))
        with pytest.raises(tcp_wire.WireError, match="over its limit"):
            reader.header()
        a.close()
        assert reader.header(at_start=True) is None          # a clean close between transfers


def test_a_body_read_in_steps_puts_its_payload_into_the_callers_buffers() -> None:
    """body_head, then body_rest_into: the payload bytes already read are copied into the buffers,
    the rest received straight into them (across buffer bounds), the trailer returned, and the next
    record's header read along with it."""
    a, b = socket.socketpair()
    with a, b:
        reader = tcp_wire.RecordReader(b)
        assert reader.scatters
        prefix, payload, trailer = b"P" * 10, bytes(range(100)), b"MAC!!"
        a.sendall(tcp_wire.record(tcp_wire.FRAME, prefix + payload + trailer) + tcp_wire.record(tcp_wire.END))
        kind, length = reader.header(at_start=True)
        assert bytes(reader.body_head(length, 20)) == prefix + payload[:10]
        first, second = bytearray(30), bytearray(70)
        assert bytes(reader.body_rest_into(10, [memoryview(first), memoryview(second)])) == trailer
        assert bytes(first + second) == payload
        assert reader.header() == (tcp_wire.END, 0)
        a.sendall(tcp_wire.record(tcp_wire.FRAME, b"xyz"))   # and a plain body after it
        assert bytes(reader.body(reader.header()[1])) == b"xyz"
