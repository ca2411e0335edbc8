"""A worker stays up and hands KV off whatever its neighbours do: idle connections flooding its
metrics port, a full or unshared shared-memory directory, a prefill worker killed while its KV
sits in a segment (the supervisor removes what it left).

One supervised deployment (1 prefill, 1 decode) whose KV segments live in a small tmpfs of the
test's own, plus in-process receivers on real sockets for the peer that cannot see our segments.
"""
from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv.block_manager import transfer_block_hashes
from pdserve.engine.kv.handoff import HandoffState
from pdserve.services.client import Client
from pdserve.services.kv_transfer import GrpcKVSender, KVBlock, KVTransferError, KVTransferServicer, register_kv_servicer
from pdserve.services.kv_transfer import shared_memory
from pdserve.services.kv_transfer.grpc_transport import SharedMemoryRoute
from pdserve.services.common.metrics import scrape_by_name
from pdserve.services.common.grpc_setup import options as channel_options
from tests.conftest import assert_no_leak, random_prompts
from tests.faults.harness import FAULT_ROUTER, FaultCluster, wait_for
from tests.serving import worker_status

ENGINE_ARGS = ["--block-size", "8", "--num-kv-blocks", "1024", "--dtype", "float32", "--max-num-batched-tokens", "1024"]
PROMPT_TOKENS = 1100   # tiny qwen3 in float32: 1 KiB of KV per token, so the first chunk's 1 MiB goes to a segment
MAX_TOKENS = 6
TMPFS_BYTES = 8 << 20
IDLE_CONNECTIONS = 2000
METRICS_TOKEN = "m" * 40


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def _segments(directory: str | Path, pid: int | None = None) -> list[str]:
    prefix = shared_memory.owner_prefix(pid) if pid is not None else shared_memory.PREFIX
    return [n for n in os.listdir(directory) if shared_memory.NAME.fullmatch(n) and n.startswith(prefix)]


class Deployment(FaultCluster):
    """One prefill and one decode worker sharing a tmpfs for KV, restarted when they die. Their KV
    goes over the gRPC stream, whose large sends on loopback use the shared memory under test (the
    raw TCP data plane does not)."""

    def __init__(self, model: str, shm_dir: Path, token_file: Path) -> None:
        self.shm_dir = shm_dir
        super().__init__(model, prefill=1, decode=1, engine_args=ENGINE_ARGS, router_args=FAULT_ROUTER,
                         worker_args=["--kv-lease-idle-s", "3", "--kv-shared-memory-dir", str(shm_dir),
                                      "--kv-data-plane", "grpc"],
                         metrics_token_file=str(token_file))

    def process(self, role: str):
        return next(p for p in self.cluster.processes if p.name.startswith(role))

    def generate(self, prompt: list[int]) -> list[int]:
        with Client(self.cluster.router_address, timeout=120) as client:
            return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("shm") / "tmpfs"
    if not _mount_tmpfs(path):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def deployment(tiny_qwen3: str, shm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    token_file = tmp_path_factory.mktemp("metrics") / "token"
    token_file.write_text(METRICS_TOKEN)
    token_file.chmod(0o600)
    d = Deployment(tiny_qwen3, shm_dir, token_file)
    try:
        yield d
    finally:
        d.close()
    assert _segments(shm_dir) == [], "a segment outlived the deployment"


@pytest.fixture(scope="module")
def reference(tiny_qwen3: str):
    """Greedy tokens of a prompt from the offline engine (what any hand-off must reproduce)."""
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return lambda prompt: llm.generate([prompt], params)[0].token_ids


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _scrape(address: str, token: str | None = METRICS_TOKEN) -> dict[str, float]:
    return scrape_by_name(address, timeout=5, token=token)


def test_idle_connections_to_a_metrics_port_leave_the_worker_serving(deployment: Deployment, reference) -> None:
    """2,000 idle connections to the decode worker's metrics port: its file descriptors stay
    bounded (excess connections closed at once, idle ones timed out), a generate whose KV goes
    through a shared-memory segment succeeds meanwhile, and a fresh scrape is answered once the
    idle ones are gone. A scrape without the token gets 401."""
    decode = deployment.process("decode")
    host, port = decode.metrics_address.rsplit(":", 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE_CONNECTIONS + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    n = min(IDLE_CONNECTIONS, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
    before = _fd_count(decode.popen.pid)
    idle: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.settimeout(10)
            s.connect((host, int(port)))
            idle.append(s)
        time.sleep(0.5)   # kept: a window in which the worker, offered them all, must not hold them
        held = _fd_count(decode.popen.pid)
        assert held < before + 100, f"the decode worker holds {held} fds with {n} idle metrics connections " \
                                    f"(had {before})"
        prompt = random_prompts(1, PROMPT_TOKENS, PROMPT_TOKENS, seed=501)[0]
        assert deployment.generate(prompt) == reference(prompt)
        deadline = time.monotonic() + 60
        while True:   # answered once the served idle connections time out (5 s)
            try:
                samples = _scrape(decode.metrics_address)
                break
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert samples.get("pdserve:generation_tokens_total", 0) > 0
    finally:
        for s in idle:
            s.close()
    with pytest.raises(urllib.error.HTTPError) as err:
        _scrape(decode.metrics_address, token=None)
    assert err.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as err:
        _scrape(decode.metrics_address, token="x" * 40)
    assert err.value.code == 401


def _fill(directory: Path) -> Path:
    """A file taking every free byte of the tmpfs at directory."""
    filler = directory / "filler"
    chunk = b"\0" * (256 << 10)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_shared_memory_directory_hands_kv_off_inline(deployment: Deployment, reference) -> None:
    """With the tmpfs the segments go to full, the prefill worker's segment write fails and the
    same KV goes inline: exact tokens, no migration, nothing left in the directory."""
    warm = random_prompts(1, PROMPT_TOKENS, PROMPT_TOKENS, seed=511)[0]
    assert deployment.generate(warm) == reference(warm)   # the peers share memory (probed)
    filler = _fill(deployment.shm_dir)
    try:
        prompt = random_prompts(1, PROMPT_TOKENS, PROMPT_TOKENS, seed=512)[0]
        with Client(deployment.cluster.router_address, timeout=120) as client:
            out = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert out.token_ids == reference(prompt)
        assert out.timings["migrations"] == 0
        assert _segments(deployment.shm_dir) == []
    finally:
        filler.unlink()


def test_a_prefill_worker_killed_holding_a_segment_leaves_none(deployment: Deployment, reference) -> None:
    """kill -9 of the prefill worker while its first chunk's KV sits in a segment (the decode
    worker frozen, so nobody takes it): the supervisor removes the segment as soon as it sees
    the child dead, the request completes after the restart with exact tokens, and the
    deployment's exit leaves no segment (checked by the fixture)."""
    prefill, decode = deployment.process("prefill"), deployment.process("decode")
    prompt = random_prompts(1, PROMPT_TOKENS, PROMPT_TOKENS, seed=521)[0]
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["tokens"] = deployment.generate(prompt)
        except grpc.RpcError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: worker_status(deployment.cluster, decode.address).num_reserved > 0, 60, "a reservation")
    os.kill(decode.popen.pid, signal.SIGSTOP)
    try:
        pid = prefill.popen.pid
        wait_for(lambda: _segments(deployment.shm_dir, pid), 60, "the prefill worker's segment")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _segments(deployment.shm_dir, pid), 10, "the supervisor to remove the dead "
                                                                     "worker's segment")
    finally:
        os.kill(decode.popen.pid, signal.SIGCONT)
    thread.join(120)
    assert result.get("tokens") == reference(prompt), result
    wait_for(lambda: prefill.alive and prefill.popen.pid != pid, 30, "the restart")
    assert _segments(deployment.shm_dir, pid) == []


# ---- in-process peers on real sockets --------------------------------------------------------

SMALL_PROMPT = random_prompts(1, 60, 60, seed=531)[0]    # 8 blocks of 8 (the last one partial)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_qwen3: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8, num_kv_blocks=64))


def _blocks(rid: str, engine: LLMEngine, seed: int) -> list[KVBlock]:
    hashes = transfer_block_hashes(SMALL_PROMPT, 8)
    g = torch.Generator().manual_seed(seed)
    return [KVBlock(rid, i, hashes[i], torch.randn(engine.runner.block_shape, generator=g)) for i in range(8)]


async def _push(engine: LLMEngine, route: SharedMemoryRoute, receiver_dir: Path, rids: list[str],
                between=lambda servicer, i: None) -> list[object]:
    """Each rid's blocks from a sender using route to a real gRPC receiver whose segments are in
    receiver_dir; returns each stream's result (SendResult or the KVTransferError)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = KVTransferServicer(engine.kv, shared_memory=True, shared_memory_dir=str(receiver_dir))
    register_kv_servicer(servicer, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    sender = GrpcKVSender(lambda a: grpc.aio.insecure_channel(a, options=channel_options()), shared_memory=True,
                          shared_memory_route=route)
    results: list[object] = []
    try:
        for i, rid in enumerate(rids):
            between(servicer, i)
            res = engine.reserve(rid, SMALL_PROMPT, GREEDY)
            stream = sender.open(target, rid, res.transfer_token)
            await stream.send(_blocks(rid, engine, seed=i))
            try:
                results.append(await stream.finish(timeout=10))
            except KVTransferError as exc:
                results.append(exc)
    finally:
        await sender.close()
        await server.stop(None)
    return results


def _landed_exactly(engine: LLMEngine, rid: str, seed: int) -> bool:
    stored = engine.runner.read_blocks(engine.kv.receiving[rid].seq.block_table)
    return all(torch.equal(stored[j], b.data) for j, b in enumerate(_blocks(rid, engine, seed)))


def _finish(engine: LLMEngine, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    assert_no_leak(engine)


def test_a_receiver_that_cannot_open_our_segments_gets_its_kv_inline(engine: LLMEngine, tmp_path: Path) -> None:
    """The receiver looks for segments elsewhere (another directory; another IPC or mount
    namespace fails the same way): the sender's probe finds out once and every send goes inline,
    bit-exact; no segment is left on either side."""
    ours, theirs = tmp_path / "sender", tmp_path / "receiver"
    ours.mkdir()
    theirs.mkdir()
    route = SharedMemoryRoute(str(ours), min_bytes=0)
    rids = ["unshared-0", "unshared-1"]
    results = asyncio.run(_push(engine, route, theirs, rids))
    assert [getattr(r, "blocks", r) for r in results] == [8, 8]
    assert all(_landed_exactly(engine, rid, i) for i, rid in enumerate(rids))
    assert _segments(ours) == [] and _segments(theirs) == [] and route.in_flight == 0
    _finish(engine, rids)


def test_a_receiver_that_stops_seeing_our_segments_asks_for_inline(engine: LLMEngine, tmp_path: Path) -> None:
    """The probe passed, then the receiver can no longer open a segment: it answers
    FAILED_PRECONDITION (its request fails, to be migrated) and the sender sends inline to it
    from then on, so the retry gets its KV."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    route = SharedMemoryRoute(str(shared), min_bytes=0)

    def between(servicer: KVTransferServicer, i: int) -> None:
        if i == 1:
            servicer.shared_memory_dir = str(elsewhere)
    rids = ["moved-0", "moved-1", "moved-2"]
    first, refused, retry = asyncio.run(_push(engine, route, shared, rids, between))
    assert first.blocks == 8 and retry.blocks == 8
    assert isinstance(refused, KVTransferError) and refused.code == "FAILED_PRECONDITION", refused
    assert _landed_exactly(engine, rids[0], 0) and _landed_exactly(engine, rids[2], 2)
    assert engine.kv.state(rids[1]) is HandoffState.FAILED
    assert _segments(shared) == [] and route.in_flight == 0
    _finish(engine, rids)


class _CountingRoute(SharedMemoryRoute):
    """The route as the sender uses it, recording the sends it let into segments."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admitted: list[int] = []

    def reserve(self, nbytes: int) -> bool:
        ok = super().reserve(nbytes)
        if ok:
            self.admitted.append(nbytes)
        return ok


def test_bytes_in_segments_are_capped(engine: LLMEngine, tmp_path: Path) -> None:
    """A send that would take the sender's segments past the cap goes inline; one within it uses
    a segment (released at finish)."""
    send_bytes = 8 * engine.runner.kv_bytes_per_block
    for cap, admitted in ((send_bytes, [send_bytes]), (send_bytes - 1, [])):
        route = _CountingRoute(str(tmp_path), min_bytes=0, max_bytes=cap)
        rid = f"capped-{cap}"
        result, = asyncio.run(_push(engine, route, tmp_path, [rid]))
        assert result.blocks == 8 and _landed_exactly(engine, rid, 0)
        assert route.admitted == admitted and route.in_flight == 0
        _finish(engine, [rid])
    assert _segments(tmp_path) == []


def test_a_sender_sweeps_stale_segments_periodically(engine: LLMEngine, tmp_path: Path) -> None:
    """A segment no live hand-off can own (older than the lease cap) is removed while the sender
    runs, not only at the next start; a young one stays."""
    stale = tmp_path / f"{shared_memory.owner_prefix(999_999)}{'0' * 32}"
    young = tmp_path / f"{shared_memory.owner_prefix(999_999)}{'1' * 32}"
    for path in (stale, young):
        path.write_bytes(b"x")
        path.chmod(0o600)
    past = time.time() - 3600
    os.utime(stale, (past, past))
    route = SharedMemoryRoute(str(tmp_path), min_bytes=0, sweep_after_s=600)

    async def run() -> None:
        from pdserve.services.kv_transfer import grpc_transport
        interval = grpc_transport.SHM_SWEEP_INTERVAL_S
        grpc_transport.SHM_SWEEP_INTERVAL_S = 0.2
        try:
            results = await _push(engine, route, tmp_path, ["swept"])
            assert results[0].blocks == 8
            route._start_sweeper()
            deadline = time.monotonic() + 10
            while stale.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            grpc_transport.SHM_SWEEP_INTERVAL_S = interval
            await route.close()
    asyncio.run(run())
    assert not stale.exists() and young.exists()
    young.unlink()
    _finish(engine, ["swept"])
