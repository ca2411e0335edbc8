"""Batch-invariant mode (EngineConfig.batch_invariant, on by default): a sequence's greedy tokens,
and the logits under them bit for bit, do not depend on the batch around it.

The matrix of issue 19: 20 prompts each alone and in batches of 2, 7, 20 and 32, under two chunk
budgets, in the default compute dtype and with bfloat16 forced (in process, comparing tokens and
the sampled tokens' logprobs exactly); a prompt continued from its own generated tokens (a
migration's re-prefill: KV and logits computed by a prefill step equal those of the decode steps);
then over real processes, colocated and disaggregated, 20 concurrent requests each, and through a
migration forced by killing the decode worker mid-stream."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading

import pytest
import torch

from pdserve.engine import LLM, SamplingParams, cpu_features
from pdserve.engine.layers import cpu_kernels
from pdserve.engine.layers.linear import Linear
from pdserve.services.client import AsyncClient
from tests.conftest import random_prompts
from tests.faults.harness import Observed, observe, wait_for
from tests.serving import assert_blocks_at_baseline, catch_holder, start_cluster, worker_status

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_linear_available(),
                                reason="batch-invariant mode needs the native CPU kernels (AVX2 or AVX-512)")

PROMPTS = random_prompts(20, 5, 80, seed=19)
FILLERS = random_prompts(12, 5, 80, seed=1919)    # batch members beside the 20 (a batch of 32)
MAX_NEW = 24
MIGRATION_PROMPT, MIGRATION_NEW = random_prompts(1, 40, 40, seed=1920)[0], 1000   # long enough to outlast the freeze
BATCHES = (2, 7, 20, 32)
BUDGETS = (16, 512)                               # chunked prefill (prompts split) and whole prompts
DTYPES = ("auto", "bfloat16")                     # auto: float32 on CPUs without fast bf16 GEMMs
ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=1024, max_num_seqs=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _engine_args(compute_dtype: str, budget: int) -> list[str]:
    return ["--block-size", "8", "--num-kv-blocks", "1024", "--dtype", "float32", "--compute-dtype", compute_dtype,
            "--max-num-batched-tokens", str(budget)]


def _key(out) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Greedy tokens and the logprob of each: equal logprobs mean equal logits rows, in practice."""
    return tuple(out.token_ids), tuple(lp.logprob for lp in out.logprobs)


@functools.lru_cache(maxsize=None)
def _llm(compute_dtype: str, budget: int) -> LLM:
    llm = LLM(PROMPTS_MODEL[0], compute_dtype=compute_dtype, max_num_batched_tokens=budget, **ENGINE)
    assert llm.engine.runner.batch_invariant, "batch-invariant mode not in force"
    return llm


PROMPTS_MODEL: list[str] = []   # the tiny model's path, set by the fixture below (lru_cache keys stay small)


@pytest.fixture(scope="module")
def model(tiny_qwen3: str) -> str:
    PROMPTS_MODEL[:] = [tiny_qwen3]
    yield tiny_qwen3
    _llm.cache_clear()
    _reference.cache_clear()


@functools.lru_cache(maxsize=None)
def _reference(compute_dtype: str) -> list[tuple]:
    """Each prompt alone, under the first budget: what every other run must reproduce."""
    llm = _llm(compute_dtype, BUDGETS[0])
    return [_key(llm.generate([p], GREEDY)[0]) for p in PROMPTS]


def _batched(llm: LLM, size: int) -> list[tuple]:
    """The 20 prompts in batches of size (the last ones topped up with fillers)."""
    outs: list[tuple] = []
    for i in range(0, len(PROMPTS), size):
        group = PROMPTS[i:i + size]
        outs += [_key(o) for o in llm.generate(group + FILLERS[:size - len(group)], GREEDY)[:len(group)]]
    return outs


def _differing(got: list[tuple], want: list[tuple]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


# ---- the kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", ["float32", "bf16-values", "bfloat16", "w8a16"])
def test_linear_row_does_not_depend_on_the_rows_beside_it(weights: str) -> None:
    """Every row count (1 to past the bf16-weight kernel's 32 and the chunk of 192) and every
    offset gives a row the same bits as computing it alone; within float32 rounding of F.linear."""
    g = torch.Generator().manual_seed(0)
    lin = Linear(96, [40, 60], bias=True)   # 100 outputs: padded to 128 columns
    w = torch.randn(100, 96, generator=g)
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    lin.weight.data = (w.to(torch.bfloat16).float() if weights == "bf16-values" else w).to(dtype)
    lin.bias.data = torch.randn(100, generator=g).to(dtype)
    if weights == "w8a16":
        lin.quantize_w8a16()
    assert lin.pack_invariant()
    x = torch.randn(400, 96, generator=g).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    for m in (2, 7, 20, 32, 33, 200, 400):
        assert torch.equal(lin(x[:m])[:40], alone[:min(m, 40)]), m
    assert torch.equal(lin(x[5:37]), alone[5:37])   # another offset
    x3 = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 or weights == "w8a16" else 1e-4
    ref = torch.nn.functional.linear(x3.float(), (lin.qweight.float() * lin.scale.float()[:, None]) if lin.qweight
                                     is not None else lin.weight.float(), lin.bias.float())
    assert torch.allclose(lin(x3).float(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.amx_available(), reason="no AMX on this CPU")
@pytest.mark.parametrize("weights", ["bfloat16", "w8a16"])
def test_amx_linear_row_does_not_depend_on_the_rows_beside_it(weights: str) -> None:
    """On AMX the mode's GEMM is the AMX tile kernel: a row alone (one zero-padded 16-row block)
    gets the same bits as among up to 400 rows (25 blocks; the column groups split over two
    threads), at any offset; within bf16 rounding of F.linear; and the packed copy unpacks to the
    weight exactly."""
    g = torch.Generator().manual_seed(0)
    lin = Linear(96, [64, 128], bias=True)   # 192 outputs: three 64-column groups
    lin.weight.data = torch.randn(192, 96, generator=g).to(torch.bfloat16)
    lin.bias.data = torch.randn(192, generator=g).to(torch.bfloat16)
    weight = lin.weight.detach().clone()
    if weights == "w8a16":
        lin.quantize_w8a16()
    assert lin.pack_invariant(amx=True) and lin.invariant_kernel == "amx"
    x = torch.randn(400, 96, generator=g).to(torch.bfloat16)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for m, t in ((2, 1), (15, 1), (16, 2), (17, 1), (33, 2), (200, 1), (400, 2)):
            torch.set_num_threads(t)
            assert torch.equal(lin(x[:m])[:40], alone[:min(m, 40)]), m
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(lin(x[5:37]), alone[5:37])   # another offset
    w = lin.qweight.float() * lin.scale.float()[:, None] if lin.qweight is not None else weight.float()
    ref = torch.nn.functional.linear(x[:3].float(), w, lin.bias.float())
    assert torch.allclose(lin(x[:3]).float(), ref, rtol=2e-2, atol=2e-1)
    if weights == "bfloat16":
        assert lin.release_plain_weight() and lin.weight is None
        lin.unpack_invariant()
        assert lin.invariant_kernel == "" and torch.equal(lin.weight, weight)


@pytest.mark.skipif(not cpu_kernels.bf16dot_available(), reason="no AVX512-BF16 on this CPU (or no C++ compiler)")
def test_a_linear_that_cannot_pack_turns_the_mode_off_with_every_weight_back(tiny_qwen3: str, monkeypatch) -> None:
    """The plain weights go as each linear is packed (the load's peak is one copy of the model);
    should a later linear not pack, the mode is off for all, every weight is back exactly when the
    other paths pack it, and the model generates as one loaded without the mode."""
    args = dict(compute_dtype="bfloat16", block_size=8, num_kv_blocks=256)
    # the tuned kernels, even where tuned mode would run the invariant ones (AVX512-BF16 without AMX)
    monkeypatch.setattr(cpu_features, "invariant_kernels_are_fastest", lambda *a: False)
    plain = LLM(tiny_qwen3, batch_invariant=False, **args)
    assert not any(m.invariant_kernel for m in plain.engine.runner.model.modules() if isinstance(m, Linear))
    vocab = plain.engine.runner.model.lm_head.out_features
    loaded: dict[int, torch.Tensor] = {}     # each linear's weight as loaded, by id
    seen: list[int] = []                     # the linears pack_for_cpu saw, its weight checked first
    released: list[int] = []                 # bytes each plain weight released before the failure held
    pack, pack_for_cpu, release = Linear.pack_invariant, Linear.pack_for_cpu, Linear.release_plain_weight

    def pack_invariant(self: Linear, amx: bool = False) -> bool:
        loaded[id(self)] = self.weight.detach().clone()
        return False if self.out_features == vocab else pack(self, amx)   # the LM head, packed last, fails

    def check_then_pack(self: Linear, *a, **k):
        assert self.packed_invariant is None and torch.equal(self.weight, loaded[id(self)])
        seen.append(id(self))
        return pack_for_cpu(self, *a, **k)
    monkeypatch.setattr(Linear, "pack_invariant", pack_invariant)
    monkeypatch.setattr(Linear, "pack_for_cpu", check_then_pack)
    monkeypatch.setattr(Linear, "release_plain_weight", lambda self: released.append(release(self)) or released[-1])
    fallen = LLM(tiny_qwen3, batch_invariant=True, **args)
    assert not fallen.engine.runner.batch_invariant
    assert len(released) == len(loaded) - 1 and all(released)   # every one before the LM head was dropped
    assert len(seen) == len(loaded) > 1 and set(seen) == set(loaded)
    prompts = random_prompts(3, 8, 30, seed=25)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in fallen.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, h, hkv", [(32, 4, 2), (64, 8, 4), (128, 4, 1)])
def test_attention_row_does_not_depend_on_the_rows_beside_it(cache_dtype: torch.dtype, d: int, h: int,
                                                              hkv: int) -> None:
    """A prefill chunk's queries as decode rows (what the mode runs): in one call (neighbouring rows
    of a sequence share K/V loads), at another offset (other pairs) and each alone, the same bits;
    and softmax(q K^T) V to float32 rounding."""
    g = torch.Generator().manual_seed(d + h)
    bs, start, n = 16, 37, 90
    kc = torch.randn(16, bs, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(16, bs, hkv, d, generator=g).to(cache_dtype)
    table = torch.randperm(16, generator=g)[:9]
    q = torch.randn(n, h, d, generator=g)
    tables = table.expand(n, -1).contiguous()
    lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
    scale = d ** -0.5
    together = cpu_kernels.decode_attention(q, kc, vc, tables, lens, scale)
    alone = torch.cat([cpu_kernels.decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], scale)
                       for i in range(n)])
    assert torch.equal(together, alone)
    assert torch.equal(cpu_kernels.decode_attention(q[1:], kc, vc, tables[1:], lens[1:], scale), alone[1:])
    keys = kc[table].reshape(-1, hkv, d).double().repeat_interleave(h // hkv, 1)
    values = vc[table].reshape(-1, hkv, d).double().repeat_interleave(h // hkv, 1)
    for i in (0, n // 2, n - 1):
        L = int(lens[i])
        p = (torch.einsum("hd,lhd->hl", q[i].double(), keys[:L]) * scale).softmax(-1)
        assert torch.allclose(together[i].double(), torch.einsum("hl,lhd->hd", p, values[:L]), atol=1e-5)


# ---- in process: the matrix -------------------------------------------------------------------

@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_alone_batched_and_chunked_give_the_same_logits(model: str, compute_dtype: str) -> None:
    ref = _reference(compute_dtype)
    failures = {}
    for budget in BUDGETS:
        llm = _llm(compute_dtype, budget)
        if budget != BUDGETS[0]:
            failures[(budget, 1)] = _differing([_key(llm.generate([p], GREEDY)[0]) for p in PROMPTS], ref)
        for size in BATCHES:
            failures[(budget, size)] = _differing(_batched(llm, size), ref)
    assert not any(failures.values()), {k: v for k, v in failures.items() if v}


@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_reprefill_of_generated_tokens_equals_their_decode(model: str, compute_dtype: str) -> None:
    """A migration re-prefills prompt + generated tokens: the prefill step's logits of the last
    of them must be the decode step's, and so must the KV it leaves for the rest."""
    ref = _reference(compute_dtype)
    llm = _llm(compute_dtype, BUDGETS[1])
    cut = 10
    continued = [p + list(r[0][:cut]) for p, r in zip(PROMPTS, ref)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW - cut, ignore_eos=True, logprobs=0)
    outs = [_key(o) for o in llm.generate(continued, params)]
    assert _differing(outs, [(r[0][cut:], r[1][cut:]) for r in ref]) == []


# ---- real processes ---------------------------------------------------------------------------

async def _generate_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncClient(address, timeout=120) as client:
        outs = await asyncio.gather(*(client.generate(p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                                      for p in prompts))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_colocated_serving_equals_alone(model: str, compute_dtype: str) -> None:
    """One colocated worker, chunk budget 16: 20 concurrent requests batch and chunk as they arrive."""
    want = [list(r[0]) for r in _reference(compute_dtype)]
    cluster = start_cluster(model, prefill_workers=0, decode_workers=0, colocated_workers=1,
                            engine_args=_engine_args(compute_dtype, BUDGETS[0]))
    try:
        got = asyncio.run(_generate_all(cluster.router_address, PROMPTS))
        assert _differing(got, want) == []
        assert_blocks_at_baseline(cluster)
    finally:
        cluster.stop()


@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_disaggregated_serving_and_migration_equal_alone(model: str, compute_dtype: str) -> None:
    """1 prefill + 2 decode workers, budget 512: 20 concurrent requests; then a long request whose
    decode worker is killed mid-stream finishes elsewhere (a re-prefill of prompt + generated
    tokens) with exactly the tokens of the request alone in process."""
    want = [list(r[0]) for r in _reference(compute_dtype)]
    migration_want = _llm(compute_dtype, BUDGETS[0]).generate(
        [MIGRATION_PROMPT], SamplingParams(temperature=0.0, max_tokens=MIGRATION_NEW, ignore_eos=True))[0].token_ids
    cluster = start_cluster(model, prefill_workers=1, decode_workers=2,
                            engine_args=_engine_args(compute_dtype, BUDGETS[1]),
                            router_args=["--stall-timeout-s", "3", "--worker-wait-s", "20", "--migration-limit", "3"])
    try:
        got = asyncio.run(_generate_all(cluster.router_address, PROMPTS))
        assert _differing(got, want) == []
        decoders = [p for p in cluster.processes if p.name.startswith("decode")]
        frozen = threading.Event()

        def freeze_at_8_tokens(o: Observed) -> None:   # in the client's thread: no lag behind the stream
            if len(o.tokens) >= 8 and not frozen.is_set():
                for p in decoders:
                    os.kill(p.popen.pid, signal.SIGSTOP)
                frozen.set()
        obs = observe(cluster.router_address, MIGRATION_PROMPT, MIGRATION_NEW, on_message=freeze_at_8_tokens)
        try:
            wait_for(lambda: frozen.is_set() or obs.done.is_set(), 60, "8 tokens")
        finally:   # frozen or not, catch_holder resumes every decoder
            victim = catch_holder(decoders, lambda p: worker_status(cluster, p.address).num_running > 0,
                                  lambda p: p.popen.pid, already_frozen=True)
        assert victim is not None and not obs.done.is_set(), "the request finished before the fault"
        os.kill(victim.popen.pid, signal.SIGKILL)
        assert obs.done.wait(90), "the request hung after its decode worker was killed"
        assert obs.code is None, (obs.code, obs.details)
        assert obs.migrations >= 1
        assert obs.tokens == migration_want
        survivors = [p.address for p in cluster.processes if p.name != "router" and p is not victim]
        wait_for(lambda: all(s.num_free_blocks == s.num_total_blocks
                             for s in (worker_status(cluster, a) for a in survivors)),
                 30, "free blocks back at baseline on the surviving workers")
    finally:
        cluster.stop()
