"""Speculative decoding in the engine (engine/spec_decode, issue 44's first slice): n-gram prompt
lookup drafts, verified in one forward pass with greedy acceptance.

The proposer and the acceptance rule alone; the scheduler's drafts (the step budget, max_tokens,
the pool, sampled requests) and the step plan's rows; then the tiny random models, where greedy
speculative output must equal plain greedy output token for token (and, in batch-invariant mode,
the logprob of every token, bit for bit) in both kernel modes, float32 and bf16, in mixed steps,
with prefix-cache hits (no cached block ever holds a draft token), preemption, aborts (blocks back
to baseline) and every stop condition applied exactly."""
from __future__ import annotations

import functools
import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.block_manager import BlockManager, prompt_block_hashes, salt_root
from pdserve.engine.model_maker import make_model
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.ngram import NgramProposer, ngram_lookup
from pdserve.engine.spec_decode.depth import PRIOR_ACCEPTANCE, SHARED_STEP_STRETCH, DraftDepth, draft_state
from pdserve.engine.spec_decode.speculator import Speculator, request_counts
from pdserve.engine.spec_decode.verify import accepted_length, verify
from pdserve.engine.step_plan import StepPlan
from tests.conftest import assert_no_leak

# Fixed depth: which drafts adaptive depth verifies depends on measured step times (a loaded
# machine verifies fewer); the tests of adaptive depth below fix its costs.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "adaptive_depth": False}
MAX_NEW = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# block_size 8 fills blocks (prefix-cache keys) within a few verifications; a budget of 24 tokens
# splits the prompts into chunks that share steps with the verifications
ENGINE = dict(block_size=8, num_kv_blocks=512, max_num_batched_tokens=24, max_num_seqs=8, num_threads=1)
DTYPES = {"float32": dict(dtype="float32", compute_dtype="float32"),
          "bfloat16": dict(dtype="bfloat16", compute_dtype="bfloat16")}


def copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a pattern (drafts from the prompt, mostly rejected by a random model)
    after a random head; the tiny models' outputs settle into repeats, whose drafts are accepted."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pattern = [rng.randrange(2, 1000) for _ in range(rng.randint(3, 8))]
        out.append([rng.randrange(2, 1000) for _ in range(rng.randint(3, 12))] + pattern * rng.randint(2, 6))
    return out


PROMPTS = copy_prompts(8, seed=44)


@pytest.fixture(autouse=True, scope="module")
def _torch_threads():
    """ENGINE's one thread (where the fused decode call runs) does not outlive this module."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def arch_model(request: pytest.FixtureRequest, model_root) -> str:
    """The tiny checkpoints of conftest's tiny_model (qwen3: tied embeddings, q/k norms; llama: untied)."""
    path = model_root / f"tiny-{request.param}"
    if not path.exists():
        make_model(path, preset="tiny", arch=request.param, seed=0)
    return str(path)


def _llm(model: str, spec: bool | dict, **overrides) -> LLM:
    """spec: True for SPEC, a dict for SPEC with those fields changed."""
    kwargs = {**ENGINE, **overrides}
    return LLM(model, speculative_config={**SPEC, **(spec if isinstance(spec, dict) else {})} if spec else None,
               **kwargs)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    return llm.generate(prompts, params)


def _spec_counts(llm: LLM) -> dict[str, int]:
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def _assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    st = _spec_counts(llm)
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] > 0, st
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"], f"no rejection: {st}"
    assert st["spec_decode_num_accepted_tokens_pos_0"] >= st.get("spec_decode_num_accepted_tokens_pos_1", 0)


def _verified_keys(token_lists: list[list[int]], block_size: int) -> set[int]:
    return {h for ids in token_lists for h in prompt_block_hashes(ids, block_size, salt_root(None))}


# ---- the proposer -------------------------------------------------------------------------------

def _propose(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 4, max_tokens: int = 99) -> list[int]:
    return NgramProposer(k, lo, hi).propose(Sequence("s", list(tokens), GREEDY), max_tokens)


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    assert _propose([1, 2, 3, 4, 5, 6, 7, 1, 2, 3]) == [4, 5, 6, 7]
    # two earlier occurrences of [8, 9]: the latest one's continuation
    assert _propose([8, 9, 1, 1, 8, 9, 2, 2, 5, 8, 9]) == [2, 2, 5, 8]
    # the longest n first: [3, 8, 9] matches at the start, [8, 9] alone later
    assert _propose([3, 8, 9, 4, 4, 4, 8, 9, 6, 6, 6, 3, 8, 9], k=2) == [4, 4]
    assert _propose([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], k=2) == [4, 5]
    assert _propose([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], max_tokens=3) == [4, 5, 6]


def test_ngram_needs_prompt_lookup_min_tokens_to_match() -> None:
    assert _propose([1, 2, 3, 4, 5, 6, 7]) == []             # nothing repeats
    assert _propose([5, 6, 7, 1, 9, 8, 7]) == []             # only the last token occurs earlier (n=1 < min)
    assert _propose([5, 6, 7, 1, 9, 8, 7], lo=1) == [1, 9, 8, 7]
    assert _propose([4, 4], lo=2) == [] and _propose([], lo=1) == []
    assert _propose([1, 2, 3, 1, 2, 3], max_tokens=0) == []


def test_ngram_continues_the_period_a_recent_match_reveals() -> None:
    assert _propose([9, 7, 7, 7, 7]) == [7, 7, 7, 7]
    assert _propose([5, 1, 2, 3, 1, 2], k=5) == [3, 1, 2, 3, 1]


def test_ngram_lookup_equals_a_brute_force_search() -> None:
    rng = random.Random(3)

    def brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
        for n in range(hi, lo - 1, -1):
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    out = tokens[start + n:start + n + k]
                    period = len(tokens) - (start + n)
                    while len(out) < k:
                        out.append(out[len(out) - period])
                    return out
        return []

    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        assert ngram_lookup(np.array(tokens, dtype=np.int64), lo, hi, k) == brute(tokens, lo, hi, k), (tokens, lo, hi)


def test_the_token_mirror_follows_appends_and_rebuilds_on_anything_else() -> None:
    proposer = NgramProposer(3, 2, 3)
    seq = Sequence("s", [1, 2, 3, 4, 1, 2], GREEDY)
    assert proposer.propose(seq, 9) == [3, 4, 1]
    seq.token_ids += [3] + list(range(10, 400))      # past the mirror's first capacity
    seq.token_ids += [10, 11]
    assert proposer.propose(seq, 9) == [12, 13, 14]
    seq.token_ids[:] = [7, 8, 9, 7, 8]                # not a continuation: rebuilt
    assert proposer.propose(seq, 9) == [9, 7, 8]


# ---- acceptance, counters, config ----------------------------------------------------------------

def test_greedy_acceptance_takes_the_matching_prefix_then_the_models_token() -> None:
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]    # all accepted, and the bonus token
    assert verify([5, 6, 7], [5, 9, 7, 8]) == [5, 9]          # the model's token at the first mismatch
    assert verify([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert verify([], [3]) == [3]


def test_counters_per_position() -> None:
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(3, 3)
    stats.observe(4, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 11, 5)
    assert stats.accepted_per_position == [2, 2, 1, 0]
    assert stats.as_dict()["spec_decode_num_accepted_tokens_pos_2"] == 1
    assert stats.acceptance_rate == 5 / 11 and stats.mean_accepted_length == 1 + 5 / 3


def test_speculative_config_from_a_dict_json_or_nothing() -> None:
    assert EngineConfig(model="m").speculative_config is None
    cfg = EngineConfig(model="m", speculative_config=SPEC).speculative_config
    assert cfg == SpeculativeConfig(adaptive_depth=False) and cfg == SpeculativeConfig.parse(json.dumps(SPEC))
    assert EngineConfig(model="m", speculative_config='{"num_speculative_tokens": 2}').speculative_config == \
        SpeculativeConfig(num_speculative_tokens=2)
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg and SpeculativeConfig.parse("none") is None
    for bad, words in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 5}, "must not exceed"), ({"k": 3}, "unknown"),
                       ("[1]", "dict"), ("{", "JSON")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(model="m", speculative_config=bad)


# ---- the scheduler's drafts and the step plan -----------------------------------------------------

class _FixedProposer:
    """Drafts draft (cut to what is asked) for the requests in only (None: all), and records who asked."""

    def __init__(self, draft: list[int], only: set[str] | None = None) -> None:
        self.draft, self.only, self.asked = draft, only, []

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        self.asked.append((seq.request_id, max_tokens))
        return self.draft[:max_tokens] if self.only is None or seq.request_id in self.only else []

    def finished(self, seq: Sequence) -> None:
        pass


def _decoding(rid: str, n: int, params: SamplingParams = GREEDY) -> Sequence:
    seq = Sequence(rid, list(range(1, n + 1)), params, num_prompt_tokens=n - 1)
    seq.first_token_time = 1.0
    return seq


def _scheduler(budget: int, blocks: int = 64, draft: tuple = (7, 7, 7, 7)) -> Scheduler:
    config = EngineConfig(model="none", block_size=4, max_num_batched_tokens=budget, max_num_seqs=8)
    speculator = Speculator(SpeculativeConfig(adaptive_depth=False), _FixedProposer(list(draft)))
    return Scheduler(config, BlockManager(blocks, 4), speculator=speculator, max_model_len=1000)


def _start_decoding(s: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        s.block_manager.allocate(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        s.add_running(seq)


def test_drafts_take_the_budget_the_decodes_leave_and_prompts_what_drafts_leave() -> None:
    s = _scheduler(budget=8)
    a, b = _decoding("a", 6), _decoding("b", 6)
    _start_decoding(s, a, b)
    s.add(Sequence("p", list(range(50, 70)), GREEDY))
    batch = s.schedule()
    # two decodes (2 tokens), a's draft of 4, b's draft of what is left (2), no prompt token
    assert [q.request_id for q in batch.seqs] == ["a", "b"]
    assert batch.num_new_tokens == [5, 3] and batch.drafts == [[7, 7, 7, 7], [7, 7]]
    assert batch.num_tokens == 8 and batch.num_draft_tokens == 6
    assert s.trace(1, batch).num_prefill_tokens == 0 and s.trace(1, batch).num_draft_tokens == 6
    # the drafts' slots have blocks (a: 6 tokens + 4 draft slots = 10 -> 3 blocks of 4)
    assert len(a.block_table) == 3 and len(b.block_table) == 2


def test_a_draft_stops_short_of_max_tokens_and_the_model_length() -> None:
    s = _scheduler(budget=64)
    near_end = _decoding("a", 6, SamplingParams(temperature=0.0, max_tokens=3))   # 1 emitted, 2 left
    _start_decoding(s, near_end)
    batch = s.schedule()
    assert batch.drafts == [[7]]   # a verification emits up to len(draft) + 1 tokens: 2
    s = _scheduler(budget=64)
    s.max_model_len = 8
    _start_decoding(s, _decoding("b", 6))
    assert s.schedule().drafts == [[7]]


def test_sampled_requests_draft_too() -> None:
    s = _scheduler(budget=64)
    sampled = _decoding("t", 6, SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    _start_decoding(s, sampled, _decoding("g", 6))
    batch = s.schedule()
    assert batch.drafts == [[7, 7, 7, 7]] * 2 and [r for r, _ in s.speculator.proposer.asked] == ["t", "g"]


def test_drafts_take_free_blocks_only_above_the_watermark_and_never_preempt() -> None:
    s = _scheduler(budget=64, blocks=4)
    a = _decoding("a", 8)        # 2 blocks; watermark 1: one block left for its draft
    _start_decoding(s, a)
    batch = s.schedule()
    assert batch.drafts == [[7, 7, 7, 7]] and s.block_manager.num_free_blocks == 1
    s = _scheduler(budget=64, blocks=3)
    b = _decoding("b", 7)        # 2 blocks, one slot left in its last; no free block above the watermark
    _start_decoding(s, b)
    assert s.schedule().drafts == [[7]] and s.num_preemptions == 0


def test_the_step_plan_lays_a_draft_out_as_decode_rows_at_their_positions_all_sampled() -> None:
    s = _scheduler(budget=64, draft=(70, 71))
    s.speculator.proposer.only = {"a"}                    # a verifies a draft, b decodes plainly
    a, b = _decoding("a", 6), _decoding("b", 3)
    _start_decoding(s, a, b)
    s.add(Sequence("p", [40, 41, 42], GREEDY))
    batch = s.schedule()
    assert batch.drafts == [[70, 71], []] and batch.num_new_tokens == [3, 1, 3]
    plan = StepPlan.from_batch(batch, 4)
    # decode rows by context: b's, then a's last token and its draft, each attending up to itself; p's prompt
    assert plan.input_ids == [3, 6, 70, 71, 40, 41, 42]
    assert plan.positions == [2, 5, 6, 7, 0, 1, 2]
    assert plan.slots[1:4] == [a.block_table[p // 4] * 4 + p % 4 for p in (5, 6, 7)]
    assert plan.num_decode == 4 and plan.num_new_tokens == [1, 1, 1, 1, 3]
    assert plan.seqs[0] is b and [(v.num_computed_tokens, v.block_table) for v in plan.seqs[1:4]] == \
        [(p, a.block_table) for p in (5, 6, 7)] and plan.seqs[4].request_id == "p"
    assert plan.sample_rows == [0, 1, 2, 3, 6] and plan.sample_seqs == [1, 0, 0, 0, 2]
    # the ranks' form: the same rows and metadata
    back = StepPlan.decode(*plan.encode())
    assert (back.input_ids, back.positions, back.slots, back.sample_rows, back.num_decode) == \
        (plan.input_ids, plan.positions, plan.slots, plan.sample_rows, 4)
    assert [(v.num_computed_tokens, v.block_table) for v in back.seqs] == \
        [(v.num_computed_tokens, list(v.block_table)) for v in plan.seqs]


def test_trim_gives_the_lookahead_blocks_back_first_in_line() -> None:
    bm = BlockManager(8, 4)
    seq = _decoding("a", 5)
    bm.allocate(seq)
    assert bm.append_lookahead(seq, 6) == 6 and len(seq.block_table) == 3
    extra = seq.block_table[2]
    seq.token_ids.append(9)              # one token accepted: 6 tokens, 2 blocks
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert next(iter(bm.free_ids)) == extra and bm.blocks[extra].hash is None


# ---- the engine: greedy speculative output is plain greedy output ------------------------------

def _watch_fused_decode(llm: LLM) -> list[tuple[bool, bool]]:
    """(the step verifies drafts, the backend ran it as one fused decode call) per decode-only forward."""
    runner, seen = llm.engine.runner, []
    backend, run = runner.backend, runner.run
    drafts = [False]

    def run_noting_drafts(batch, *args):
        drafts[0] = batch.num_draft_tokens > 0
        return run(batch, *args)

    def decode_model(model, input_ids, positions, meta):
        hidden = type(backend).decode_model(backend, model, input_ids, positions, meta)
        seen.append((drafts[0], hidden is not None))
        return hidden

    runner.run = run_noting_drafts
    backend.decode_model = decode_model
    return seen

LOGPROBS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
# Tuned mode promises nothing across step shapes: a prompt's logits depend on where its chunks are
# cut, and drafts, sharing the budget, move the cuts. There the prompts are computed whole (a
# budget above them all), and a few run at once so that the others join later, mixed steps still.
TUNED = dict(max_num_batched_tokens=2048, max_num_seqs=3)


def _keyed(outs) -> tuple:
    return tuple((tuple(o.token_ids), tuple(lp.logprob for lp in o.logprobs)) for o in outs)


@functools.lru_cache(maxsize=None)
def _plain_reference(model: str, invariant: bool, dtype: str) -> tuple:
    """Plain greedy output with each token's logprob: every prompt alone, then all in one batch."""
    llm = _llm(model, False, batch_invariant=invariant, **DTYPES[dtype], **({} if invariant else TUNED))
    return _keyed(llm.generate([p], LOGPROBS)[0] for p in PROMPTS), _keyed(_run(llm, PROMPTS, LOGPROBS))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "tuned"])
def test_greedy_speculative_output_is_plain_output_in_mixed_steps(arch_model: str, invariant: bool,
                                                                    dtype: str) -> None:
    alone, batched = _plain_reference(arch_model, invariant, dtype)
    # fixed depth: adaptive depth may leave no verification beside a prompt chunk; prompts in arrival
    # order, so the long ones' chunks run beside the first short ones' drafts
    llm = _llm(arch_model, {"adaptive_depth": False}, batch_invariant=invariant, prompt_order="fcfs",
               **DTYPES[dtype], **({} if invariant else TUNED))
    fused = _watch_fused_decode(llm)
    got = _keyed(_run(llm, PROMPTS, LOGPROBS))
    if invariant:
        assert llm.engine.runner.batch_invariant
        assert alone == batched and got == batched   # the same logits, bit for bit, for every token
    elif [t for t, _ in alone] != [t for t, _ in batched]:
        pytest.skip("tuned mode's kernels are not batch-invariant on this CPU: plain output depends on the batch")
    else:
        assert [t for t, _ in got] == [t for t, _ in batched]
    _assert_drafts_accepted_and_rejected(llm)
    if any(ran for _, ran in fused):   # where the backend has the fused decode call, verifications take it too
        assert any(ran for drafts, ran in fused if drafts)
    trace = list(llm.engine.trace)
    assert any(t.num_draft_tokens and t.num_prefill_tokens for t in trace), "no step mixed drafts and prompts"
    budget = llm.config.max_num_batched_tokens
    assert all(sum(t.num_tokens) == t.num_prefill_tokens + t.num_decode_seqs + t.num_draft_tokens <= budget
               for t in trace)
    assert_no_leak(llm)


def test_prefix_cache_hits_keep_output_and_no_cached_block_holds_a_draft_token(tiny_qwen3: str) -> None:
    prefix = copy_prompts(1, seed=7)[0]
    prompts = [prefix + tail for tail in copy_prompts(4, seed=9)]
    plain = [o.token_ids for o in _run(_llm(tiny_qwen3, False, dtype="float32"), prompts, GREEDY)]
    llm = _llm(tiny_qwen3, True, dtype="float32")
    engine, bm = llm.engine, llm.engine.block_manager
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            # after every step: each computed block a running sequence holds has its verified tokens' key
            for seq in engine.requests.values():
                for j, block_id in enumerate(seq.block_table[:seq.num_computed_tokens // 8]):
                    block = bm.blocks[block_id]
                    assert block.computed and block.token_ids == tuple(seq.token_ids[j * 8:(j + 1) * 8])
                assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens), "a draft's blocks kept"
    assert [outs[f"r{i}"] for i in range(len(prompts))] == plain
    assert engine.stats()["prefix_cache_hits"] >= 3 * (len(prefix) // 8) * 8
    _assert_drafts_accepted_and_rejected(llm)
    cached = {h for h, b in bm.hash_to_block.items() if bm.blocks[b].computed}
    verified = _verified_keys([p + outs[f"r{i}"] for i, p in enumerate(prompts)], 8)
    assert cached and cached <= verified, "a cached block holds tokens no request emitted"
    assert_no_leak(llm)


def test_preemption_keeps_output(tiny_qwen3: str) -> None:
    plain = [o.token_ids for o in _run(_llm(tiny_qwen3, False, dtype="float32"), PROMPTS, GREEDY)]
    llm = _llm(tiny_qwen3, True, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64)
    outs = _run(llm, PROMPTS, GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == plain
    _assert_drafts_accepted_and_rejected(llm)
    assert_no_leak(llm)


def test_an_abort_mid_generation_and_during_a_verification_leaves_the_pool_at_baseline(tiny_qwen3: str) -> None:
    plain = [o.token_ids for o in _run(_llm(tiny_qwen3, False, dtype="float32"), PROMPTS, GREEDY)]
    llm = _llm(tiny_qwen3, True, dtype="float32")
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    run = engine.runner.run
    aborted_in_flight: list[int] = []

    def run_and_abort(batch, *args):   # aborts r1 while the forward pass that verifies its draft runs
        i = next((i for i, s in enumerate(batch.seqs) if s.request_id == "r1" and batch.draft(i)), None)
        if i is not None and not aborted_in_flight:
            aborted_in_flight.append(len(batch.seqs[i].block_table))
            assert engine.abort("r1")
        return run(batch, *args)

    engine.runner.run = run_and_abort
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if len(outs.get("r2", ())) >= 12 and "r2" in engine.requests:
            assert engine.abort("r2")
    assert aborted_in_flight, "r1 never verified a draft"
    assert "r1" not in outs or len(outs["r1"]) < MAX_NEW
    assert outs["r2"] == plain[2][:len(outs["r2"])]
    assert all(outs[f"r{i}"] == plain[i] for i in range(len(PROMPTS)) if i not in (1, 2))
    assert_no_leak(llm)


def test_max_tokens_stop_ids_eos_and_model_length_are_applied_token_by_token(tiny_qwen3: str) -> None:
    prompts = PROMPTS[:4]
    plain_llm = _llm(tiny_qwen3, False, dtype="float32")
    plain = [o.token_ids for o in _run(plain_llm, prompts, GREEDY)]
    llm = _llm(tiny_qwen3, True, dtype="float32")
    # where verifications emitted several tokens at once (the stops below fall inside those runs)
    engine = llm.engine
    chunks: dict[str, list[list[int]]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    while engine.has_unfinished_requests():
        for o in engine.step():
            chunks.setdefault(o.request_id, []).append(o.new_token_ids)
    assert [sum(chunks[f"r{i}"], []) for i in range(len(prompts))] == plain
    # max_tokens: every length, in one batch
    lengths = list(range(1, 13))
    outs = _run(llm, [prompts[0]] * len(lengths),
                [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.token_ids for o in outs] == [plain[0][:n] for n in lengths]
    assert all(o.finish_reason == "length" for o in outs)
    # a stop id first emitted at a later place of a multi-token verification
    cases = []
    for i in range(len(prompts)):
        at = 0
        for chunk in chunks[f"r{i}"]:
            for j, tok in enumerate(chunk):
                if j and tok not in plain[i][:at + j]:
                    cases.append((i, tok, at + j))
            at += len(chunk)
    assert cases, "no verification emitted a new token after an accepted one"
    eos = engine.eos_token_ids
    for i, tok, at in cases[:3]:
        out = _run(llm, [prompts[i]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[tok],
                                                     ignore_eos=True))[0]
        assert (out.token_ids, out.finish_reason) == (plain[i][:at + 1], "stop")
        engine.eos_token_ids = {tok}   # the same token as the model's EOS
        out = _run(llm, [prompts[i]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0]
        engine.eos_token_ids = eos
        assert (out.token_ids, out.finish_reason) == (plain[i][:at + 1], "stop")
        # min_tokens past it: the stop id cannot be sampled until then (vLLM's rule), in every row
        # of a verification as in plain decoding
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[tok], ignore_eos=True,
                                min_tokens=at + 2)
        out = _run(llm, [prompts[i]], params)[0]
        assert tok not in out.token_ids[:at + 2] and out.token_ids == _run(plain_llm, [prompts[i]], params)[0].token_ids
    # the model length (validation keeps max_tokens within it): drafts stop short of it too
    short = _llm(tiny_qwen3, True, dtype="float32", max_model_len=len(prompts[1]) + 9)
    out = _run(short, [prompts[1]], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason) == (plain[1][:9], "length")
    assert_no_leak(llm)
    assert_no_leak(short)


def test_seeded_sampled_requests_emit_their_plain_tokens_while_speculating(tiny_qwen3: str) -> None:
    """Each verified row samples with the uniform plain decoding draws at its output index, so a
    seeded request's tokens are its plain tokens, top-k / top-p rows and greedy neighbours alike."""
    sampled = [SamplingParams(temperature=0.9, max_tokens=MAX_NEW, ignore_eos=True, seed=100 + i, **extra)
               for i, extra in enumerate(({}, {"top_k": 5}, {"top_p": 0.8}))]
    params = sampled + [GREEDY] * 3
    prompts = PROMPTS[:6]
    plain = [o.token_ids for o in _run(_llm(tiny_qwen3, False, dtype="float32"), prompts, params)]
    llm = _llm(tiny_qwen3, True, dtype="float32")
    proposer = llm.engine.speculator.proposer
    asked: set[float] = set()
    propose = proposer.propose

    def spy(seq, max_tokens):
        asked.add(seq.params.temperature)
        return propose(seq, max_tokens)

    proposer.propose = spy
    assert [o.token_ids for o in _run(llm, prompts, params)] == plain
    assert asked == {0.0, 0.9}
    _assert_drafts_accepted_and_rejected(llm)
    assert_no_leak(llm)


# ---- rejection sampling: sampled speculative output follows the plain distribution ---------------

class _GreedyPathProposer:
    """Drafts the greedy continuation while the output so far is on a known greedy path
    (paths[first output token]: the greedy tokens after it), nothing off it."""

    def __init__(self, prompt_len: int, paths: dict[int, list[int]]) -> None:
        self.prompt_len, self.paths = prompt_len, paths

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        out = seq.token_ids[self.prompt_len:]
        path = self.paths.get(out[0], [])
        return path[len(out) - 1:][:max_tokens] if out[1:] == path[:len(out) - 1] else []

    def finished(self, seq: Sequence) -> None:
        pass


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile z (3.09: 0.999), Wilson-Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _homogeneity(a: dict, b: dict) -> tuple[float, int]:
    """Pearson's two-sample chi-square statistic (equal sample sizes) and its degrees of freedom."""
    cells = set(a) | set(b)
    stat = sum((a.get(c, 0) - b.get(c, 0)) ** 2 / (a.get(c, 0) + b.get(c, 0)) for c in cells)
    return stat, len(cells) - 1


@pytest.mark.parametrize("acceptance", ["rejection-sampling", "greedy-acceptance"])
def test_sampled_speculative_output_follows_the_plain_distribution(tiny_qwen3: str, monkeypatch,
                                                                   acceptance: str) -> None:
    """Unseeded requests, top-k 4: the joint distribution of the first three tokens (64 cells)
    with every second and third token drafted along the greedy path and verified, against plain
    sampling: a two-sample chi-square below its 0.999 quantile. The same test with greedy
    acceptance (a draft token accepted when it is the model's argmax, as every draft here is)
    must fail it: the control that shows the test can see a wrong distribution."""
    n = 1500
    prompt = PROMPTS[0][:10]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    engine_args = dict(dtype="float32", max_num_seqs=256, max_num_batched_tokens=4096)
    plain_llm = _llm(tiny_qwen3, False, **engine_args)
    plain = [tuple(o.token_ids) for o in _run(plain_llm, [prompt] * n, params)]
    firsts = sorted({t[0] for t in plain})
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    paths = {t: o.token_ids for t, o in zip(firsts, _run(plain_llm, [prompt + [t] for t in firsts], greedy))}
    llm = LLM(tiny_qwen3, speculative_config={**SPEC, "adaptive_depth": False}, **{**ENGINE, **engine_args})
    llm.engine.speculator.proposer = _GreedyPathProposer(len(prompt), paths)
    if acceptance == "greedy-acceptance":
        monkeypatch.setattr("pdserve.engine.llm_engine.verify", lambda draft, targets: [*draft, targets[len(draft)]])
    spec = [tuple(o.token_ids) for o in _run(llm, [prompt] * n, params)]
    st = _spec_counts(llm)
    assert st["spec_decode_num_drafts"] > n // 4 and st["spec_decode_num_accepted_tokens"] > 0, st
    stat, df = _homogeneity(Counter(plain), Counter(spec))
    if acceptance == "rejection-sampling":
        assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"], st
        assert stat < _chi2_critical(df), (stat, df)
    else:
        assert stat > _chi2_critical(df), (stat, df)
    assert_no_leak(llm)


# ---- adaptive depth -------------------------------------------------------------------------------

def _observed(acceptance: list[tuple[int, int]]) -> Sequence:
    seq = _decoding("s", 6)
    depth = DraftDepth()
    for drafted, accepted in acceptance:
        depth.observe(seq, drafted, accepted)
    return seq


def test_a_sequences_acceptance_estimate_follows_its_verifications() -> None:
    fresh = _decoding("f", 6)
    assert draft_state(fresh).acceptance == PRIOR_ACCEPTANCE and request_counts(fresh) == (0, 0, 0)
    copying, rejecting = _observed([(4, 4)] * 10), _observed([(4, 0)] * 10)
    assert draft_state(copying).acceptance > 0.9 and draft_state(rejecting).acceptance < 0.15
    assert request_counts(copying) == (10, 40, 40) and request_counts(rejecting) == (10, 40, 0)
    recent = _observed([(4, 4)] * 10 + [(4, 0)] * 8)   # recent verifications weigh most
    assert draft_state(recent).acceptance < 0.5


def test_drafts_go_as_deep_as_they_pay_for_their_rows() -> None:
    depth = DraftDepth()
    for rows, ms in ((1, 20.0), (5, 36.0), (9, 52.0), (3, 28.0)):   # base 16 ms, 4 ms a row
        depth.observe_step(rows, ms)
    assert depth.costs() == pytest.approx((16.0, 4.0))
    draft = [7] * 40
    copying, rejecting = _observed([(8, 8)] * 10), _observed([(4, 0)] * 10)
    alone = depth.choose([copying], [draft], budget=64)[0]
    assert 8 <= alone < 40                                     # a copy verifies deep, not endlessly
    assert depth.choose([rejecting], [draft], budget=64) == [0]   # rejected drafts are not verified
    assert depth.choose([copying], [draft], budget=3) == [3]   # the budget caps it
    # in a batch of 16 the step is already worth 16 tokens: each row must be worth more
    batch = [_observed([(8, 8)] * 10) for _ in range(16)]
    assert max(depth.choose(batch, [draft] * 16, budget=1000)) < alone
    # expected tokens per millisecond: the chosen rows beat the plain step, and one more row would not
    a = draft_state(copying).acceptance
    gain = sum(a ** j for j in range(1, alone + 1))
    assert (1 + gain) / (16 + 4 * (1 + alone)) > 1 / 20
    assert a ** (alone + 1) * (16 + 4 * (1 + alone)) <= 4 * (1 + gain)


def test_drafts_lengthen_a_shared_step_by_a_bounded_share_only() -> None:
    depth = DraftDepth()
    for rows, ms in ((1, 20.0), (5, 36.0), (9, 52.0)):   # base 16 ms, 4 ms a row
        depth.observe_step(rows, ms)
    draft = [7] * 40
    copying = [_observed([(8, 8)] * 10) for _ in range(2)]
    alone = depth.choose(copying[:1], [draft], budget=64)[0]
    shared = depth.choose(copying, [draft] * 2, budget=64)
    base_ms, ms_per_row = depth.costs()
    cap_rows = SHARED_STEP_STRETCH * (base_ms + 2 * ms_per_row) / ms_per_row   # 3 here
    assert alone > 20                                   # a lone sequence's drafts lengthen only its own step
    assert cap_rows - 1 <= sum(shared) <= cap_rows and min(shared) > 0, shared


def test_a_passed_over_sequence_drifts_back_to_the_prior_and_is_tried_again() -> None:
    depth = DraftDepth()
    depth.observe_step(1, 20.0), depth.observe_step(5, 36.0)
    seq = _observed([(4, 0)] * 10)
    tries = [depth.choose([seq], [[7] * 4], budget=64)[0] for _ in range(60)]
    first = tries.index(1)
    assert first > 5 and not any(tries[:first]), tries   # passed over for a while, then one token tried


def test_a_sequence_whose_drafts_cannot_pay_is_not_asked_for_one() -> None:
    proposer = _FixedProposer([7] * 4)
    speculator = Speculator(SpeculativeConfig(), proposer)
    for rows, ms in ((1, 20.0), (5, 36.0)):
        speculator.observe_step(rows, ms)
    rejecting, fresh = _observed([(4, 0)] * 10), _decoding("fresh", 6)
    rejecting.request_id = "rejecting"
    drafts = speculator.drafts([rejecting, fresh], [10, 10], budget=64)
    assert [rid for rid, _ in proposer.asked] == ["fresh"] and drafts[0] == [] and drafts[1]
    before = draft_state(rejecting).rejected
    speculator.drafts([rejecting], [10], budget=64)
    assert draft_state(rejecting).rejected < before   # passed over: back towards the prior


def test_fixed_depth_verifies_whole_drafts_while_the_budget_lasts() -> None:
    depth = DraftDepth(adaptive=False)
    seqs = [_observed([(4, 0)] * 10), _decoding("b", 6)]
    assert depth.choose(seqs, [[7] * 4, [7] * 4], budget=6) == [4, 2]


def test_drafts_that_never_pay_are_backed_off_and_the_outputs_report_their_counts(tiny_qwen3: str) -> None:
    """A proposer whose drafts the model rejects (token 1023 four times, where the tiny model
    never puts it): fixed depth verifies four tokens on every decode step, adaptive depth a
    fraction of that, with the same output. Every finished output carries its request's counts,
    which add up to the engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS[:4]
    plain = [o.token_ids for o in _run(_llm(tiny_qwen3, False, dtype="float32"), prompts, params)]
    assert not any(1023 in p for p in plain)
    drafted = {}
    for adaptive in (False, True):
        llm = LLM(tiny_qwen3, speculative_config={**SPEC, "adaptive_depth": adaptive}, **ENGINE, dtype="float32")
        engine = llm.engine
        engine.speculator.proposer = _FixedProposer([1023] * 4)
        engine.speculator.depth.costs = lambda: (16.0, 4.0)   # not the measured steps: the same on a busy machine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        counts, outs = {}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                assert (o.spec_counts is not None) == o.finished
                if o.finished:
                    counts[o.request_id] = o.spec_counts
        assert [outs[f"r{i}"] for i in range(len(prompts))] == plain
        st = _spec_counts(llm)
        assert len(counts) == len(prompts) and st["spec_decode_num_accepted_tokens"] == 0
        assert [sum(c[j] for c in counts.values()) for j in range(3)] == [
            st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"], st["spec_decode_num_accepted_tokens"]]
        drafted[adaptive] = st["spec_decode_num_draft_tokens"]
        assert_no_leak(llm)
    assert drafted[False] >= 4 * 4 * 40 and drafted[True] <= drafted[False] // 10, drafted


def test_suffix_decoding_drafts_earlier_outputs_and_keeps_the_greedy_output(tiny_qwen3: str) -> None:
    """method suffix: the first round drafts from each sequence's own tokens; the same prompts
    again draft the first round's outputs (the global trie), accepted far more often; greedy
    output is plain output throughout, and the pool is back at baseline."""
    plain = [o.token_ids for o in _run(_llm(tiny_qwen3, False, dtype="float32"), PROMPTS, GREEDY)]
    llm = _llm(tiny_qwen3, {"method": "suffix"}, dtype="float32")
    rounds = []
    for _ in range(2):
        before = _spec_counts(llm)
        assert [o.token_ids for o in _run(llm, PROMPTS, GREEDY)] == plain
        after = _spec_counts(llm)
        rounds.append({k: after[k] - before.get(k, 0) for k in ("spec_decode_num_drafts",
                                                                 "spec_decode_num_accepted_tokens")})
    assert rounds[0]["spec_decode_num_accepted_tokens"] > 0
    assert rounds[1]["spec_decode_num_accepted_tokens"] > 1.5 * rounds[0]["spec_decode_num_accepted_tokens"], rounds
    assert llm.engine.speculator.proposer.num_cached_requests == 2 * len(PROMPTS)
    assert_no_leak(llm)
