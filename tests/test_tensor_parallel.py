"""Tensor parallelism (engine/parallel.py, engine/tp_rank.py): TP=2 over gloo, in real rank
processes, gives Hugging Face's greedy tokens; a dead rank fails the engine without a hang."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model_maker import make_model
from engine.parallel import RankFailure, TPLayout, check_divisible
from engine.step_plan import SeqView, StepPlan
from tests.conftest import assert_no_leak, hf_greedy, random_prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(6, 3, 60, seed=11)


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    """A TP driver runs on one torch thread (process-wide): give the later test modules theirs back."""
    import torch
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny(model_root: Path, preset: str, arch: str) -> str:
    path = model_root / f"{preset}-{arch}"
    if not path.exists():
        make_model(path, preset=preset, arch=arch, seed=0)
    return str(path)


def make_llm(model: str, **overrides) -> LLM:
    kwargs = dict(dtype="float32", block_size=8, num_kv_blocks=128, max_num_batched_tokens=256, max_num_seqs=16)
    kwargs.update(overrides)
    return LLM(model, **kwargs)


def gone(pid: int) -> bool:
    """No such process, or only its zombie (exited; its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def rank_processes(driver_pids: set[int]) -> list[int]:
    """Live `engine.tp_rank` processes started by these drivers."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "engine.tp_rank" in argv and "--driver-pid" in argv:
            if int(argv[argv.index("--driver-pid") + 1]) in driver_pids and not gone(int(entry)):
                found.append(int(entry))
    return found


def test_layout_splits_heads() -> None:
    # fewer KV heads than ranks: replicated; as many or more: split evenly
    assert [TPLayout(r, 4, 8, 2).kv_head_range for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TPLayout(r, 2, 4, 4).kv_head_range for r in range(2)] == [(0, 2), (2, 4)]
    assert TPLayout(1, 2, 4, 2).head_range == (2, 4)
    with pytest.raises(ValueError, match="attention heads"):
        check_divisible(6, 2, 4)
    with pytest.raises(ValueError, match="KV heads"):
        check_divisible(12, 3, 2)


def test_step_plan_round_trip() -> None:
    plan = StepPlan([5, 6, 7, 8], [9, 0, 1, 2], [73, 0, 1, 2], [0, 3],
                    [SeqView(9, [9, 4]), SeqView(0, [0, 1, 2])], [1, 3], 1)
    header, payload = plan.encode()
    got = StepPlan.decode(header + [0, 0], payload)
    assert (got.input_ids, got.positions, got.slots, got.sample_rows, got.num_new_tokens, got.num_decode) == (
        plan.input_ids, plan.positions, plan.slots, plan.sample_rows, plan.num_new_tokens, 1)
    assert [(s.num_computed_tokens, s.block_table) for s in got.seqs] == [(9, [9, 4]), (0, [0, 1, 2])]


@pytest.mark.parametrize("arch,preset", [
    ("qwen3", "tiny-kv1"), ("qwen3", "tiny"), ("qwen3", "tiny-kv4"),
    ("llama", "tiny-kv1"), ("llama", "tiny"), ("llama", "tiny-kv4"),
])
def test_tp2_matches_tp1_and_hf(model_root: Path, arch: str, preset: str) -> None:
    """KV heads 1 (< 2 ranks, replicated), 2 (= ranks), 4 (> ranks)."""
    model = tiny(model_root, preset, arch)
    want = hf_greedy(model, PROMPTS, MAX_NEW)
    assert [o.token_ids for o in make_llm(model).generate(PROMPTS, GREEDY)] == want
    with make_llm(model, tensor_parallel_size=2) as llm:
        pids = llm.engine.runner.ranks.pids
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert_no_leak(llm)
    assert all(gone(p) for p in pids)


def test_tp2_chunked_prefill_and_prefix_hits(tiny_qwen3: str) -> None:
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    shared = [prefix + t for t in random_prompts(3, 2, 9, seed=8)]
    # a budget of 16 tokens splits every longer prompt; mixed steps carry decodes beside chunks
    with make_llm(tiny_qwen3, tensor_parallel_size=2, max_num_batched_tokens=16, schedule_policy="mixed") as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert any(t.num_prefill_tokens == 16 for t in llm.engine.trace)
        first = llm.generate(shared[:1], GREEDY)
        rest = llm.generate(shared[1:], GREEDY)
        assert all(o.num_cached_tokens == 40 for o in rest)
        assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW)
        assert [o.token_ids for o in first + rest] == hf_greedy(tiny_qwen3, shared, MAX_NEW)
        assert_no_leak(llm)


def test_tp2_preemption_keeps_output(tiny_qwen3: str) -> None:
    # 8 prompts of up to 70 + 20 tokens in blocks of 8 need far more than 24 blocks at once
    prompts, params = random_prompts(8, 3, 70, seed=1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with make_llm(tiny_qwen3, tensor_parallel_size=2, num_kv_blocks=24) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_preemptions"] > 0
        assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, prompts, 20)
        assert_no_leak(llm)


def test_tp2_w8a16_matches_tp1_w8a16(tiny_qwen3: str) -> None:
    want = [o.token_ids for o in make_llm(tiny_qwen3, quantization="w8a16").generate(PROMPTS, GREEDY)]
    with make_llm(tiny_qwen3, quantization="w8a16", tensor_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_killed_rank_fails_the_engine_and_frees_blocks(tiny_qwen3: str) -> None:
    llm = make_llm(tiny_qwen3, tensor_parallel_size=2)
    try:
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == hf_greedy(tiny_qwen3, PROMPTS[:1], MAX_NEW)[0]
        [pid] = llm.engine.runner.ranks.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailure):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 10
        assert_no_leak(llm)
        with pytest.raises(RankFailure):   # and it stays failed
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.close()
    assert gone(pid)


def test_rank_dies_with_a_dead_driver(tiny_qwen3: str, tmp_path: Path) -> None:
    """A driver killed with SIGKILL takes its ranks with it (no orphan keeps a core busy)."""
    import subprocess
    import sys
    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"
        "from engine import LLM\n"
        f"llm = LLM({tiny_qwen3!r}, dtype='float32', num_kv_blocks=16, tensor_parallel_size=2)\n"
        "print(llm.engine.runner.ranks.pids[0], flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        rank_pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not gone(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(rank_pid)


def test_tp_size_must_divide_heads(tiny_qwen3: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        make_llm(tiny_qwen3, tensor_parallel_size=3)


# ---- heterogeneous layouts across the hand-off (engine/kv_connector.py) --------------------------
def _prefill_then_decode(model: str, prefill_tp: int, decode_tp: int, prompts: list[list[int]]) -> list[list[int]]:
    """Prefill in one engine, each block's head ranges as their own wire pieces (header + bytes, as
    a transport sends them), decode in another engine with another layout."""
    from engine import EngineConfig, LLMEngine
    from engine.block_manager import transfer_block_hashes
    from services.kv_transfer import KVBlock, block_meta

    kw = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    prefill = LLMEngine(EngineConfig(model=model, role="prefill", tensor_parallel_size=prefill_tp, **kw))
    decode = LLMEngine(EngineConfig(model=model, role="decode", tensor_parallel_size=decode_tp, **kw))
    try:
        reservations = {f"r{i}": decode.reserve(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)}
        firsts: dict[str, int] = {}
        for i, p in enumerate(prompts):
            prefill.add_request(f"r{i}", p, GREEDY)
        pieces_seen = set()
        while prefill.has_unfinished_requests():
            for out in prefill.step():
                rid = out.request_id
                if not out.ready_blocks:
                    continue
                hashes = transfer_block_hashes(prompts[int(rid[1:])], 8)
                for j, idx in enumerate(out.ready_blocks):
                    for start, end, data in prefill.kv.read_block_pieces(rid, out.ready_blocks):
                        pieces_seen.add((start, end))
                        header, payload = KVBlock(rid, idx, hashes[idx], 8, data[j], head_start=start,
                                                  head_end=end).encode()
                        decode.kv.accept(block_meta(header), reservations[rid].transfer_token, payload)
                if out.prefill_done:
                    firsts[rid] = out.new_token_ids[0]
                    prefill.release(rid)
        n_heads = prefill.model_config.num_kv_heads
        assert len(pieces_seen) == (min(prefill_tp, n_heads) if prefill_tp > 1 else 1)
        outs: dict[str, list[int]] = {}
        for rid, tok in firsts.items():
            assert decode.admit(rid, tok) is None
            outs[rid] = [tok]
        while decode.has_unfinished_requests():
            for out in decode.step():
                outs[out.request_id].extend(out.new_token_ids)
        assert_no_leak(prefill)
        assert_no_leak(decode)
        return [outs[f"r{i}"] for i in range(len(prompts))]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_handoff_between_layouts_matches_hf(tiny_qwen3: str, prefill_tp: int, decode_tp: int) -> None:
    prompts = PROMPTS[:3]
    assert _prefill_then_decode(tiny_qwen3, prefill_tp, decode_tp, prompts) == hf_greedy(tiny_qwen3, prompts, MAX_NEW)


def test_head_ranges_are_checked(tiny_qwen3: str) -> None:
    """A piece must fit the model's heads and may not repeat heads already received; a block with
    some heads still missing is not ready."""
    import torch

    from engine import EngineConfig, LLMEngine
    from engine.block_manager import transfer_block_hashes
    from engine.kv_connector import HandoffError, HandoffState
    from services.kv_transfer import KVBlock, block_meta

    decode = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8, num_kv_blocks=16))
    prompt = list(range(10, 18))   # one full block
    hashes = transfer_block_hashes(prompt, 8)
    n_layers, _, _, n_heads, d = decode.runner.block_shape

    def piece(rid: str, start: int, end: int):
        data = torch.randn(n_layers, 2, 8, end - start, d)
        header, payload = KVBlock(rid, 0, hashes[0], 8, data, head_start=start, head_end=end).encode()
        return block_meta(header), payload

    res = decode.reserve("a", prompt, GREEDY)
    meta, payload = piece("a", 0, 1)
    assert decode.kv.accept(meta, res.transfer_token, payload) is HandoffState.RECEIVING
    meta, payload = piece("a", 0, 1)
    with pytest.raises(HandoffError, match="overlap"):
        decode.kv.accept(meta, res.transfer_token, payload)
    assert decode.kv.state("a") is HandoffState.FAILED
    res = decode.reserve("b", prompt, GREEDY)
    meta, payload = piece("b", 1, 2)
    assert decode.kv.accept(meta, res.transfer_token, payload) is HandoffState.RECEIVING
    meta, payload = piece("b", 0, 1)
    assert decode.kv.accept(meta, res.transfer_token, payload) is HandoffState.READY
    decode.abort("b")
    res = decode.reserve("c", prompt, GREEDY)
    meta, payload = piece("c", 1, 2)
    outside = dataclasses.replace(meta, head_start=n_heads, head_end=n_heads + 1)
    with pytest.raises(HandoffError, match="outside"):
        decode.kv.accept(outside, res.transfer_token, payload)
    assert_no_leak(decode)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_disaggregated_grpc_between_layouts_gives_offline_tokens(tiny_qwen3: str, prefill_tp: int,
                                                                 decode_tp: int) -> None:
    """`pdserve up --prefill-tp P --decode-tp D` over real processes and gRPC."""
    import asyncio

    from services.client import AsyncClient
    from tests.serving import assert_blocks_at_baseline, start_cluster

    want = hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW)
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1, prefill_tp=prefill_tp,
                            decode_tp=decode_tp)
    drivers = {p.popen.pid for p in cluster.processes if p.name != "router"}
    try:
        assert len(rank_processes(drivers)) == 1
        async def run() -> list:
            async with AsyncClient(cluster.router_address, timeout=60) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                                              for p in PROMPTS))
        assert [o.token_ids for o in asyncio.run(run())] == want
        assert_blocks_at_baseline(cluster)
    finally:
        cluster.stop()
    deadline = time.monotonic() + 10
    while rank_processes(drivers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank_processes(drivers)


@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL)")
def test_tp2_nccl_matches_hf(tiny_qwen3: str) -> None:
    want = hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW)
    with make_llm(tiny_qwen3, device="cuda", tensor_parallel_size=2, block_size=16) as llm:
        assert llm.engine.runner.tp.pg.name().lower() == "nccl"
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_up_gives_each_tp_worker_a_core_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.launcher import Cluster, Deployment

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    spec = Deployment(model="m", prefill_tp=2, engine_tp=1, decode_workers=2)
    assert (spec.tp("prefill"), spec.tp("decode")) == (2, 1)
    pinned = Cluster(spec)._cores()
    assert pinned["prefill-0"] == {0, 1} and pinned["decode-0"] == {2} and pinned["decode-1"] == {3}
    assert pinned["router"] == {3}
    # not enough cores for every rank: nothing is pinned (the OS decides)
    assert Cluster(Deployment(model="m", prefill_tp=4, decode_tp=4, threads_per_worker=2))._cores() == {}
    with pytest.raises(ValueError, match="decode_tp"):
        Deployment(model="m", decode_tp=0)
