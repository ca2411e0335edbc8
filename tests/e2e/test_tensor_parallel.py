"""Tensor parallelism (engine/parallel.py, engine/tp_rank.py): TP=2 over gloo, in real rank
processes, gives Hugging Face's greedy tokens; a dead or stalled rank fails the engine (and its
worker) without a hang and frees its blocks.

Starting a TP=2 engine (a rank process that imports torch and loads the model) is most of what
these tests cost, so the tiny Qwen3 checks share one module-wide TP=2 engine (``tp2_llm``) whose
settings make every path run at once: a 16-token budget chunks prompts, 32 blocks force
preemption, and it is the TP=2 receiving side of a hand-off."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_maker import make_model
from pdserve.engine.parallel import RankFailure, TPLayout, check_divisible
from pdserve.engine.step_plan import SeqView, StepPlan
from pdserve.services.common.process_table import is_alive
from tests.conftest import assert_no_leak, hf_greedy, random_prompts

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(6, 3, 60, seed=11)
# The shared TP=2 engine: prompts chunked by a 16-token budget, decodes beside the chunks (mixed),
# and a pool small enough that 8 long prompts preempt.
# arrival order: the preemption test's 8 prompts all admitted before the pool runs out
SHARED = dict(tensor_parallel_size=2, max_num_batched_tokens=16, schedule_policy="mixed", num_kv_blocks=32,
              prompt_order="fcfs")
TIMEOUT_S = 2.0   # the collective timeout of the failure tests (production default: 60 s)


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


@pytest.fixture(scope="module")
def tp2_llm(tiny_qwen3: str):
    """One TP=2 engine of tiny Qwen3 for the module (SHARED settings); each test leaves it empty."""
    llm = make_llm(tiny_qwen3, **SHARED)
    pids = llm.engine.runner.ranks.pids
    yield llm
    llm.close()
    assert all(gone(p) for p in pids)


def gone(pid: int) -> bool:
    """No such process, or only its zombie (exited; its parent has not reaped it yet)."""
    return not is_alive(pid)


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
        if "pdserve.engine.tp_rank" in argv and "--driver-pid" in argv:
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
def test_tp2_matches_tp1_and_hf(request: pytest.FixtureRequest, model_root: Path, arch: str, preset: str) -> None:
    """KV heads 1 (< 2 ranks, replicated), 2 (= ranks), 4 (> ranks). Tiny Qwen3 runs on the shared
    engine (chunked, mixed steps); the others on an engine of their own, at default settings."""
    model = tiny(model_root, preset, arch)
    want = hf_greedy(model, PROMPTS, MAX_NEW)
    assert [o.token_ids for o in make_llm(model).generate(PROMPTS, GREEDY)] == want
    if (arch, preset) == ("qwen3", "tiny"):
        llm = request.getfixturevalue("tp2_llm")
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert_no_leak(llm)
        return
    with make_llm(model, tensor_parallel_size=2) as llm:
        pids = llm.engine.runner.ranks.pids
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert_no_leak(llm)
    assert all(gone(p) for p in pids)


def test_tp2_chunked_prefill_and_prefix_hits(tp2_llm: LLM, tiny_qwen3: str) -> None:
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    shared = [prefix + t for t in random_prompts(3, 2, 9, seed=8)]
    # a budget of 16 tokens splits every longer prompt; mixed steps carry decodes beside chunks
    last = tp2_llm.engine.num_steps
    outs = tp2_llm.generate(PROMPTS, GREEDY)
    trace = [t for t in tp2_llm.engine.trace if t.step > last]
    assert any(t.num_prefill_tokens == 16 for t in trace)
    assert any(t.num_prefill_tokens and t.num_decode_seqs for t in trace)
    first = tp2_llm.generate(shared[:1], GREEDY)
    rest = tp2_llm.generate(shared[1:], GREEDY)
    assert all(o.num_cached_tokens == 40 for o in rest)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW)
    assert [o.token_ids for o in first + rest] == hf_greedy(tiny_qwen3, shared, MAX_NEW)
    assert_no_leak(tp2_llm)


def test_tp2_preemption_keeps_output(tp2_llm: LLM, tiny_qwen3: str) -> None:
    # 8 prompts of 40 to 70 + 20 tokens in blocks of 8 need far more than 32 blocks at once
    prompts, params = random_prompts(8, 40, 70, seed=1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    before = tp2_llm.stats()["num_preemptions"]
    outs = tp2_llm.generate(prompts, params)
    assert tp2_llm.stats()["num_preemptions"] > before
    assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, prompts, 20)
    assert_no_leak(tp2_llm)


def test_tp2_w8a16_matches_tp1_w8a16(tiny_qwen3: str) -> None:
    want = [o.token_ids for o in make_llm(tiny_qwen3, quantization="w8a16").generate(PROMPTS, GREEDY)]
    with make_llm(tiny_qwen3, quantization="w8a16", tensor_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_tp2_greedy_speculative_output_equals_hf(tiny_qwen3: str) -> None:
    """A draft's rows are decode rows of the step plan the ranks execute: TP=2 verifies them as
    TP=1 does, with mixed steps (a 16-token budget) and the pool's lookahead blocks back after."""
    from tests.e2e.test_spec_decode_serving import SPEC, copy_prompts
    prompts, n = copy_prompts(4, 30, seed=47), 24
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with make_llm(tiny_qwen3, tensor_parallel_size=2, max_num_batched_tokens=16, speculative_config=SPEC) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0, stats
        assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, prompts, n)
        assert_no_leak(llm)


def test_stalled_rank_fails_the_engine_within_the_timeout(tiny_qwen3: str) -> None:
    """A rank that stops answering (SIGSTOP): the step's collective gives up after
    tp_collective_timeout_s, every request fails and frees its blocks, the engine stays failed,
    and close() kills the ranks at once (a failed group cannot be told to stop)."""
    llm = make_llm(tiny_qwen3, tensor_parallel_size=2, tp_collective_timeout_s=TIMEOUT_S)
    [pid] = llm.engine.runner.ranks.pids
    try:
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == hf_greedy(tiny_qwen3, PROMPTS[:1], MAX_NEW)[0]
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="collective"):
            llm.generate(PROMPTS, GREEDY)
        assert TIMEOUT_S - 0.2 < time.monotonic() - start < TIMEOUT_S + 8
        assert_no_leak(llm)
        with pytest.raises(RankFailure):   # and it stays failed
            llm.generate(PROMPTS[:1], GREEDY)
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 3
    finally:
        llm.close()
    assert gone(pid)


def test_worker_with_a_killed_rank_fails_and_frees_its_blocks(tiny_qwen3: str) -> None:
    """serve_worker, what `pdserve up` and the Ray actors run: a rank killed while a request decodes
    and another request's blocks are reserved for its KV fails both and frees every block; the
    worker drains and raises RankFailure (its supervisor restarts it) instead of hanging."""
    from pdserve.engine import EngineConfig
    from pdserve.engine.kv.handoff import HandoffState
    from pdserve.services.workers.options import WorkerOptions
    from pdserve.services.workers.worker_process import serve_worker

    config = EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8, num_kv_blocks=64,
                          tensor_parallel_size=2, tp_collective_timeout_s=TIMEOUT_S)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run() -> int:
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve_worker(config, WorkerOptions(worker_id="tp-kill"),
                                                on_start=started.set_result))
        done, _ = await asyncio.wait({started, task}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert started in done, task.result() if task.done() else "the worker did not start"
        aengine = started.result().aengine
        engine = aengine.engine
        [pid] = engine.runner.ranks.pids
        engine.reserve("handoff", PROMPTS[0], GREEDY)
        async with aengine.add("decoding", PROMPTS[1], long) as stream:
            assert (await stream.get(timeout=60)).output.new_token_ids   # it runs
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            while not (res := await stream.get(timeout=30)).output.finished:
                pass
            assert res.output.finish_reason == "abort"
        with pytest.raises(RankFailure):
            await asyncio.wait_for(task, 30)
        assert time.monotonic() - start < 15
        assert engine.kv.state("handoff") in (HandoffState.FAILED, None)
        assert_no_leak(engine)
        return pid

    assert gone(asyncio.run(run()))


def test_rank_dies_with_a_dead_driver(tiny_qwen3: str, tmp_path: Path) -> None:
    """A driver killed with SIGKILL takes its ranks with it (no orphan keeps a core busy)."""
    import subprocess
    import sys
    script = tmp_path / "driver.py"
    script.write_text(   # only what starts the ranks: the driver need not load the model
        "import time, torch\n"
        "from pdserve.engine.config import EngineConfig\n"
        "from pdserve.engine.parallel import RankProcesses\n"
        f"ranks = RankProcesses(EngineConfig({tiny_qwen3!r}, dtype='float32', num_kv_blocks=16, "
        "tensor_parallel_size=2), torch.device('cpu'))\n"
        "print(ranks.pids[0], flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        rank_pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not gone(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(rank_pid)


def test_tp_collective_timeout_is_a_validated_engine_flag() -> None:
    from pdserve.engine import EngineConfig
    from pdserve.services.cli.commands import build_parser
    from pdserve.services.common.topology import ENGINE_FIXED
    from pdserve.services.common.config_flags import given

    for bad in (0.1, 3601, True, "5"):
        with pytest.raises(ValueError, match=r"tp_collective_timeout_s must be .*\[0\.5, 3600\]"):
            EngineConfig(model="m", tp_collective_timeout_s=bad)
    args = build_parser().parse_args(["worker", "--role", "decode", "--tp-collective-timeout-s", "2.5"])
    assert EngineConfig(model="m", **given(args, EngineConfig, ENGINE_FIXED)).tp_collective_timeout_s == 2.5
    assert EngineConfig(model="m").tp_collective_timeout_s == 60


def test_tp_size_must_divide_heads(tiny_qwen3: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        make_llm(tiny_qwen3, tensor_parallel_size=3)


# ---- heterogeneous layouts across the hand-off (engine/kv/connector.py) --------------------------
def _prefill_then_decode(prefill, decode, prompts: list[list[int]]) -> list[list[int]]:
    """Prefill in one engine, each block's head ranges as their own wire pieces (header + bytes, as
    a transport sends them), decode in another engine with another layout."""
    from pdserve.engine.kv.block_manager import transfer_block_hashes
    from pdserve.services.kv_transfer import KVBlock, block_meta

    bs = prefill.config.block_size
    reservations = {f"h{i}": decode.reserve(f"h{i}", p, GREEDY) for i, p in enumerate(prompts)}
    firsts: dict[str, int] = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"h{i}", p, GREEDY)
    pieces_seen = set()
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            rid = out.request_id
            if out.ready_blocks:
                res = reservations[rid]
                hashes = transfer_block_hashes(prompts[int(rid[1:])], bs)
                for start, end, data in prefill.kv.read_block_pieces(rid, out.ready_blocks):
                    pieces_seen.add((start, end))
                    for j, idx in enumerate(out.ready_blocks):
                        if idx in res.needed_block_indices:
                            header, payload = KVBlock(rid, idx, hashes[idx], data[j], head_start=start,
                                                      head_end=end).encode()
                            decode.kv.accept(block_meta(header), res.transfer_token, payload)
            if out.prefill_done:
                firsts[rid] = out.new_token_ids[0]
                prefill.release(rid)
    n_heads, tp = prefill.model_config.num_kv_heads, prefill.config.tensor_parallel_size
    assert len(pieces_seen) == (min(tp, n_heads) if tp > 1 else 1)
    outs: dict[str, list[int]] = {}
    for rid, tok in firsts.items():
        assert decode.admit(rid, tok) is None
        outs[rid] = [tok]
    while decode.has_unfinished_requests():
        for out in decode.step():
            outs[out.request_id].extend(out.new_token_ids)
    assert_no_leak(prefill)
    assert_no_leak(decode)
    return [outs[f"h{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_handoff_between_layouts_matches_hf(request: pytest.FixtureRequest, tiny_qwen3: str, prefill_tp: int,
                                            decode_tp: int) -> None:
    """TP=2 -> TP=1 and TP=1 -> TP=2 (the shared engine receives)."""
    from pdserve.engine import EngineConfig, LLMEngine

    prompts = random_prompts(3, 3, 60, seed=12)
    kw = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    prefill = LLMEngine(EngineConfig(model=tiny_qwen3, role="prefill", tensor_parallel_size=prefill_tp, **kw))
    try:
        decode = (request.getfixturevalue("tp2_llm").engine if decode_tp == 2
                  else LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", **kw)))
        assert decode.config.tensor_parallel_size == decode_tp
        assert _prefill_then_decode(prefill, decode, prompts) == hf_greedy(tiny_qwen3, prompts, MAX_NEW)
    finally:
        prefill.close()


def test_head_ranges_are_checked(tiny_qwen3: str) -> None:
    """A piece must fit the model's heads and may not repeat heads already received; a block with
    some heads still missing is not ready."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.kv.block_manager import transfer_block_hashes
    from pdserve.engine.kv.handoff import HandoffError, HandoffState
    from pdserve.services.kv_transfer import KVBlock, block_meta

    decode = LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8, num_kv_blocks=16))
    prompt = list(range(10, 18))   # one full block
    hashes = transfer_block_hashes(prompt, 8)
    n_layers, _, _, n_heads, d = decode.runner.block_shape

    def piece(rid: str, start: int, end: int):
        data = torch.randn(n_layers, 2, 8, end - start, d)
        header, payload = KVBlock(rid, 0, hashes[0], data, head_start=start, head_end=end).encode()
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

    from pdserve.services.client import AsyncClient
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
    from pdserve.services.deployment.launcher import Cluster, Deployment

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    spec = Deployment(model="m", prefill_tp=2, engine_tp=1, decode_workers=2)
    assert (spec.tp("prefill"), spec.tp("decode")) == (2, 1)
    pinned = Cluster(spec)._cores()
    assert pinned["prefill-0"] == {0, 1} and pinned["decode-0"] == {2} and pinned["decode-1"] == {3}
    assert pinned["router"] == {4, 5, 6, 7}   # the cores no worker has
    # every core taken by a worker: the router shares the last decode worker's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    assert Cluster(spec)._cores()["router"] == {3}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert Cluster(Deployment(model="m"))._cores() == {"prefill-0": {0}, "decode-0": {1}, "router": {1}}
    # colocated workers: the router has the spare cores, or floats when there are none
    assert Cluster(Deployment(model="m", prefill_workers=0, decode_workers=0, colocated_workers=1))._cores() == \
        {"both-0": {0}, "router": {1}}
    assert "router" not in Cluster(Deployment(model="m", prefill_workers=0, decode_workers=0,
                                              colocated_workers=2))._cores()
    # not enough cores for every rank: nothing is pinned (the OS decides)
    assert Cluster(Deployment(model="m", prefill_tp=4, decode_tp=4, threads_per_worker=2))._cores() == {}
    with pytest.raises(ValueError, match="decode_tp"):
        Deployment(model="m", decode_tp=0)
