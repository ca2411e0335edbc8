"""engine/layers/logits_processors.py and the sampler's min-p, against plain-Python references
written from vLLM V1's semantics (one token at a time, float32 arithmetic via numpy scalars:
each step rounds to float32 as vLLM's float32 tensors do, so the results must be equal exactly)."""
from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
import torch

from pdserve.engine.layers import cpu_kernels
from pdserve.engine.layers.logits_processors import apply_logits_processors
from pdserve.engine.layers.sampler import Sampler, _row_seed
from pdserve.engine.sampling_params import SamplingParams

V = 1000
EOS = (2, 7)
F32 = np.float32
NEG_INF = F32(-np.inf)


# ---- the reference: vLLM V1, token by token ----

def reference(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
              outputs: list[list[int]], stop_ids: tuple[int, ...]) -> torch.Tensor:
    rows = []
    for b, p in enumerate(params):
        row = [F32(v) for v in logits[b].tolist()]
        if p.processes_logits:
            out, prompt = outputs[b], set(prompts[b])
            # 1. bad words (vllm/v1/sample/ops/bad_words.py)
            for word in p.bad_words_token_ids or []:
                if len(word) > len(out) + 1:
                    continue
                prefix = out[len(out) - (len(word) - 1):] if len(word) > 1 else []
                if prefix == word[:-1]:
                    row[word[-1]] = NEG_INF
            # 2. min tokens (MinTokensLogitsProcessor)
            if len(out) < p.min_tokens:
                for tok in set(stop_ids) | set(p.stop_token_ids):
                    if tok < len(row):   # a larger id can never be sampled
                        row[tok] = NEG_INF
            # 3. logit bias (LogitBiasLogitsProcessor)
            for tok, bias in (p.logit_bias or {}).items():
                row[tok] = row[tok] + F32(bias)
            # 4. penalties (apply_penalties): repetition, frequency, presence
            for tok in range(len(row)):
                count = out.count(tok)
                x = row[tok]
                if tok in prompt or count > 0:
                    x = x / F32(p.repetition_penalty) if x > 0 else x * F32(p.repetition_penalty)
                x = x - F32(p.frequency_penalty) * F32(count)
                x = x - F32(p.presence_penalty) * F32(count > 0)
                row[tok] = x
        rows.append(np.array(row, dtype=np.float32))
    return torch.from_numpy(np.stack(rows))


def batch(seed: int) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], list[list[int]]]:
    """8 rows mixing every feature with rows that have none; repeated tokens, positive and
    negative logits, bad words matching and not matching the tail, min_tokens reached and not."""
    rng = random.Random(seed)
    logits = 3 * torch.randn(8, V, generator=torch.Generator().manual_seed(seed))
    pool = [rng.randrange(V) for _ in range(12)]          # drawn often: repeats

    def tokens(n: int) -> list[int]:
        return [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(V) for _ in range(n)]

    prompts = [tokens(rng.randrange(5, 40)) for _ in range(8)]
    outputs = [tokens(rng.randrange(3, 25)) for _ in range(8)]
    outputs[7] = []
    out3 = outputs[3]
    params = [
        SamplingParams(),                                                            # untouched
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=-0.5),
        SamplingParams(bad_words_token_ids=[[rng.randrange(V)], [*out3[-2:], 11],       # 1 token; tail matches
                                            [(out3[-2] + 1) % V, out3[-1], 12],        # last token only matches
                                            [5, 999, 13]],                             # tail does not match
                       min_tokens=len(out3) + 3, max_tokens=64, stop_token_ids=[17, 3 * V]),   # not reached
        SamplingParams(min_tokens=len(outputs[4]), max_tokens=64, stop_token_ids=[19], repetition_penalty=1.5,
                       logit_bias={EOS[0]: 5.0, pool[0]: -3.5, 400: 0.25}),
        SamplingParams(logit_bias={t: 2.0 for t in prompts[5][:6]}, repetition_penalty=2.0,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.1),                        # untouched
        SamplingParams(bad_words_token_ids=[[pool[1]], [pool[2], 14]], min_tokens=2, presence_penalty=1.5,
                       frequency_penalty=1.0, repetition_penalty=1.2, logit_bias={pool[3]: -1.0, 20: 10.0}),
    ]
    for p in params:
        p.validate()
    return logits, params, prompts, outputs


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_matches_reference_exactly(seed: int) -> None:
    logits, params, prompts, outputs = batch(seed)
    want = reference(logits, params, prompts, outputs, EOS)
    got = logits.clone()
    apply_logits_processors(got, params, prompts, outputs, EOS)
    assert torch.equal(got, want)
    assert torch.isinf(got[3, [11, EOS[0], EOS[1], 17]]).all()              # bad word, min_tokens
    assert not torch.isinf(got[3, [12, 13]]).any()                           # prefixes that do not match
    assert not torch.isinf(got[4, [EOS[0], EOS[1], 19]]).any()                # min_tokens reached
    for b in (0, 6):   # rows that process nothing: bit for bit
        assert torch.equal(got[b].view(torch.int32), logits[b].view(torch.int32))
    # greedy sampling on the processed logits picks the reference's argmax
    greedy = [SamplingParams(temperature=0.0)] * len(params)
    assert Sampler(0)(got, greedy, [0] * len(params)) == [int(np.argmax(r)) for r in want.numpy()]


def test_order_follows_vllm() -> None:
    """Bias before the repetition penalty (1 - 2 = -1, then x 2 = -2; the other way: 1 / 2 - 2),
    bad words before bias (-inf stays -inf), repetition before frequency and presence."""
    logits = torch.zeros(1, 8)
    logits[0, 1], logits[0, 2], logits[0, 3] = 1.0, 4.0, 3.0
    p = SamplingParams(logit_bias={1: -2.0, 5: 7.0}, repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25, bad_words_token_ids=[[5]])
    apply_logits_processors(logits, [p], [[1, 2]], [[2, 3, 3]], EOS)
    assert logits[0, 1].item() == -2.0
    assert logits[0, 5].item() == float("-inf")
    assert logits[0, 2].item() == 4.0 / 2 - 0.5 * 1 - 0.25
    assert logits[0, 3].item() == 3.0 / 2 - 0.5 * 2 - 0.25
    assert logits[0, 0].item() == 0.0 and logits[0, 4].item() == 0.0


def test_nothing_to_do_returns_at_once() -> None:
    logits = torch.randn(4, V)
    before = logits.clone()
    plain = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, min_p=0.2),
             SamplingParams(top_k=3, seed=4)]
    apply_logits_processors(logits, plain, [], [], EOS)   # prompt/output lists are never read
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))


def test_logit_bias_outside_vocab() -> None:
    logits = torch.zeros(2, V)
    params = [SamplingParams(min_tokens=1, repetition_penalty=2.0), SamplingParams(logit_bias={3: 1.0, V: 1.0})]
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logits_processors(logits, params, [[1], [1]], [[], []], EOS)
    assert not logits.any()   # nothing written before the error


def test_non_contiguous_and_edge_rows() -> None:
    logits, params, prompts, outputs = batch(9)
    prompts[1] = []                                      # penalties over the output alone
    prompts[2], outputs[2] = [], []                      # nothing to penalize
    want = reference(logits, params, prompts, outputs, EOS)
    got = logits.t().contiguous().t()                    # same values, column-major
    assert not got.is_contiguous()
    apply_logits_processors(got, params, prompts, outputs, EOS)
    assert torch.equal(got, want)
    # int64 numpy prompts (a caller's cache) give the same result
    got = logits.clone()
    apply_logits_processors(got, params, [np.array(p, dtype=np.int64) for p in prompts], outputs, EOS)
    assert torch.equal(got, want)


# ---- min-p in the sampler ----

def reference_sample(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """vLLM's order: temperature, min-p, top-k, top-p (over the min-p survivors, renormalized);
    then the sampler's CDF inversion with its draw: the first token (in id order) whose
    cumulative probability exceeds U x total. Float64 arithmetic, loops over tokens."""
    if p.greedy:
        return int(logits.argmax())
    gen = torch.Generator()
    gen.manual_seed(_row_seed(p.seed, index))
    u = torch.empty(1, dtype=torch.float64).uniform_(generator=gen).item()
    scaled = (logits / torch.tensor(p.temperature, dtype=torch.float32)).tolist()
    top = max(scaled)
    weight = [math.exp(s - top) for s in scaled]            # probability x sum; the largest is 1
    keep = [w >= p.min_p for w in weight]                    # p >= min_p x p_max
    order = sorted((t for t in range(len(scaled)) if keep[t]), key=lambda t: -scaled[t])
    if 0 < p.top_k < len(scaled):
        order = order[:p.top_k]
    total = sum(weight[t] for t in order)
    chosen, before = set(), 0.0
    for t in order:
        if before / total > p.top_p:
            break
        chosen.add(t)
        before += weight[t]
    probs = [weight[t] if t in chosen else 0.0 for t in range(len(scaled))]
    target, cdf = u * sum(probs), 0.0
    for t, q in enumerate(probs):
        cdf += q
        if cdf > target:
            return t
    return max(chosen)


NATIVE = [False] + ([True] if cpu_kernels.load() is not None else [])


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_sampler_matches_reference(seed: int, native: bool) -> None:
    logits = 2 * torch.randn(12, 500, generator=torch.Generator().manual_seed(100 + seed))
    params = [SamplingParams(temperature=0.0, min_p=0.3, seed=1),
              SamplingParams(temperature=1.0, min_p=0.05, seed=seed + 2),
              SamplingParams(temperature=0.6, min_p=0.2, seed=seed + 3),
              SamplingParams(temperature=1.4, min_p=0.1, top_k=5, seed=seed + 4),
              SamplingParams(temperature=1.4, min_p=0.02, top_k=100, seed=seed + 5),
              SamplingParams(temperature=1.0, min_p=0.01, top_p=0.6, seed=seed + 6),
              SamplingParams(temperature=0.9, min_p=0.1, top_k=30, top_p=0.8, seed=seed + 7),
              SamplingParams(temperature=1.0, min_p=1.0, seed=seed + 8),          # the top token only
              SamplingParams(temperature=1.0, seed=seed + 9),                    # no min-p
              SamplingParams(temperature=0.8, top_p=0.9, seed=seed + 10),
              SamplingParams(temperature=1.2, min_p=0.001, seed=seed + 11),
              SamplingParams(temperature=0.5, top_k=7, seed=seed + 12)]
    index = [3 * i + seed for i in range(12)]
    got = Sampler(0, native=native)(logits, params, index)
    assert got == [reference_sample(logits[i], params[i], index[i]) for i in range(12)]
    # min-p rows do not depend on the batch around them
    assert [Sampler(5, native=native)(logits[i:i + 1], params[i:i + 1], index[i:i + 1])[0] for i in range(12)] == got


@pytest.mark.parametrize("native", NATIVE)
def test_min_p_is_applied(native: bool) -> None:
    """Three tokens hold nearly all the mass between them; min_p = 0.5 leaves only those within a
    factor 2 of the largest (tokens 0 and 1). Ignoring min-p, the 64 draws would pick token 2 or
    the tail many times (checked below with min_p = 0)."""
    logits = torch.full((1, 300), -1.0)
    logits[0, :3] = torch.tensor([4.0, 3.6, 3.0])
    allowed = {0, 1}

    def draws(min_p: float) -> list[int]:
        params = [SamplingParams(temperature=1.0, min_p=min_p, seed=s) for s in range(64)]
        return Sampler(0, native=native)(logits.repeat(64, 1), params, [0] * 64)

    with_min_p = draws(0.5)
    assert set(with_min_p) == allowed
    assert not set(draws(0.0)) <= allowed


def test_penalty_timing() -> None:
    """Not asserted: B = 32, V = 49152, all three penalties on every row (prompt 512, output 128)."""
    b, vocab = 32, 49152
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(512)] for _ in range(b)]
    outputs = [[rng.randrange(vocab) for _ in range(128)] for _ in range(b)]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)] * b
    logits = torch.randn(b, vocab)
    apply_logits_processors(logits, params, prompts, outputs, EOS)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        apply_logits_processors(logits, params, prompts, outputs, EOS)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"\napply_logits_processors B={b} V={vocab} penalties on every row: "
          f"median {times[15] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms")
