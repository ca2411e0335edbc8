"""Suffix decoding (engine/spec_decode/suffix.py), pure Python: plain Sequences, no model.

What a draft is made of (earlier outputs, the request's own tokens, the most frequent
continuation, the probability floor, the length limits, the depth), what the global store keeps
(FIFO eviction leaving what a fresh build of the kept requests holds, the node cap, a long
request's last part only, one namespace per cache_salt), the per-request trie kept in step with
token_ids, every trie's invariants checked node by node, and a brute-force reference (a search over
the stored token lists) that propose must agree with on many random small-vocabulary cases."""
from __future__ import annotations

import math
import random
import time
from collections import Counter

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.suffix import INDEX_TOKENS_PER_CALL, SuffixProposer, _RequestIndex, _SuffixTrie

_NO = -1


def config(**fields) -> SpeculativeConfig:
    fields.setdefault("num_speculative_tokens", 8)
    return SpeculativeConfig(method="suffix", **fields)


def make_seq(tokens: list[int], prompt: int | None = None, salt: str | None = None, rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(cache_salt=salt), num_prompt_tokens=prompt or len(tokens))


def finish(proposer: SuffixProposer, prompt: list[int], output: list[int], salt: str | None = None) -> None:
    proposer.finished(make_seq(prompt + output, len(prompt), salt))


# ---- the brute-force reference ------------------------------------------------------------------
def occurrences(sources: list[list[int]], w: list[int]) -> int:
    return sum(src[s:s + len(w)] == w for src in sources for s in range(len(src) - len(w) + 1))


def followers(sources: list[list[int]], w: list[int]) -> Counter:
    """The tokens that follow an occurrence of w, with how often."""
    return Counter(src[s + len(w)] for src in sources for s in range(len(src) - len(w)) if src[s:s + len(w)] == w)


def reference_draft(sources: list[list[int]], context: list[int], cfg: SpeculativeConfig,
                    budget: int) -> tuple[list[int], float]:
    """The longest suffix of context (at most min(D - 1, max(1, D - k)) tokens) that is followed by
    something in sources; then its most frequent follower (the smaller token on a tie) while the
    path's probability stays >= min_token_prob, the whole string at most D tokens long."""
    depth, k = cfg.suffix_decoding_max_tree_depth, cfg.num_speculative_tokens
    max_match = min(depth - 1, max(1, depth - k))
    for m in range(min(max_match, len(context)), 0, -1):
        if followers(sources, context[-m:]):
            break
    else:
        return [], 0.0
    limit = min(budget, math.ceil(cfg.suffix_decoding_max_spec_factor * m - 1e-9))
    path, out, prob, score = context[-m:], [], 1.0, 0.0
    while len(out) < limit and len(path) < depth:
        nxt = followers(sources, path)
        if not nxt:
            break
        token = min(nxt, key=lambda t: (-nxt[t], t))
        p = prob * nxt[token] / occurrences(sources, path)
        if p < cfg.suffix_decoding_min_token_prob:
            break
        out.append(token)
        score += p
        prob, path = p, path + [token]
    return out, score


def reference_propose(cfg: SpeculativeConfig, context: list[int], outputs: list[list[int]], max_tokens: int,
                      own: list[int] | None = None) -> list[int]:
    """outputs: the kept requests' (indexed) outputs of the context's salt; own: the request's
    indexed tokens (all of context unless given)."""
    budget = min(max_tokens, cfg.num_speculative_tokens)
    if budget <= 0:
        return []
    own, own_score = reference_draft([context if own is None else own], context, cfg, budget)
    other, other_score = reference_draft(outputs, context, cfg, budget)
    return other if other_score > own_score else own


# ---- the tries' invariants, node by node --------------------------------------------------------
def check_trie(trie: _SuffixTrie, roots: dict[int, list[list[int]]]) -> None:
    """Every live node reachable from a root, with the count of its string in that root's sources
    (nothing with count 0 left), its suffix link, the children dict exactly the non-first children,
    a known best child the right one, and size the number of nodes."""
    depth = trie.depth
    seen, kid_keys = 0, set()
    for root, sources in roots.items():
        seen += 1
        nodes = {(): root}
        stack = [()]
        while stack:
            w = stack.pop()
            x = nodes[w]
            c, prev, children = trie.first[x], _NO, []
            while c != _NO:
                assert trie.prev[c] == prev
                children.append(c)
                if prev != _NO:
                    kid_keys.add(x << 32 | trie.token[c])
                    assert trie.kids[x << 32 | trie.token[c]] == c
                prev, c = c, trie.next[c]
            assert len(w) < depth or not children
            for c in children:
                cw = w + (trie.token[c],)
                assert trie.count[c] == occurrences(sources, list(cw)) > 0, cw
                nodes[cw] = c
                stack.append(cw)
                seen += 1
            if children and trie.best[x] != _NO:
                want = min(children, key=lambda c: (-trie.count[c], trie.token[c]))
                assert trie.best[x] == want
        for w, x in nodes.items():
            if w:
                assert trie.link[x] == nodes[w[1:]]
        want_strings = {tuple(src[s:s + n]) for src in sources for s in range(len(src))
                        for n in range(1, min(depth, len(src) - s) + 1)}
        assert set(nodes) - {()} == want_strings
    assert seen == trie.size
    assert kid_keys == set(trie.kids)


def check_global(proposer: SuffixProposer) -> None:
    by_root: dict[int, list[list[int]]] = {root: [] for root in proposer._roots.values()}
    for indexed in proposer._cached:
        by_root[indexed.root].append(list(indexed.tokens[indexed.start:]))
    check_trie(proposer._trie, by_root)


def random_outputs(rng: random.Random, n: int, vocab: int, length: tuple[int, int]) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(n)]


# ---- what a draft is made of ----------------------------------------------------------------------
def test_an_earlier_output_is_drafted_its_prompt_is_not():
    proposer = SuffixProposer(config())
    finish(proposer, [50, 51, 52, 53, 54, 55], [10, 11, 12, 13, 14, 15, 16])
    assert proposer.propose(make_seq([7, 8, 10, 11, 12], 2), 8) == [13, 14, 15]   # matched 3: 3 tokens
    assert proposer.propose(make_seq([7, 10, 11, 12, 13, 14], 1), 8) == [15, 16]  # the output's end
    assert proposer.propose(make_seq([7, 8, 52, 53]), 8) == []                     # a prompt: not indexed
    assert proposer.num_cached_requests == 1


def test_the_requests_own_prompt_is_drafted():
    proposer = SuffixProposer(config())
    seq = make_seq([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    # "1 2 3" occurred once before (and once at the end): each token at probability 1/2
    assert proposer.propose(seq, 8) == [4, 5, 6]
    seq.token_ids += [4, 5]
    assert proposer.propose(seq, 8) == [6, 9, 9, 1, 2]
    assert proposer.propose(make_seq([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3, 4, 5]), 8) == [6, 9, 9, 1, 2]


def test_the_most_frequent_continuation_wins_ties_to_the_smaller_token():
    proposer = SuffixProposer(config(suffix_decoding_min_token_prob=0.0))
    for output in ([1, 2, 7, 8], [1, 2, 7, 8], [1, 2, 5, 6], [3, 1, 2, 9]):
        finish(proposer, [0], output)
    assert proposer.propose(make_seq([4, 1, 2]), 2) == [7, 8]      # 7 twice, 5 and 9 once
    finish(proposer, [0], [1, 2, 5, 6])
    assert proposer.propose(make_seq([4, 1, 2]), 2) == [5, 6]      # 5 and 7 twice each: the smaller


def test_min_token_prob_stops_a_draft():
    outputs = ([1, 2, 3, 4, 5], [1, 2, 3, 6, 7])
    for floor, want in ((0.6, [3]), (0.5, [3, 4]), (1.0, [3]), (0.0, [3, 4])):
        proposer = SuffixProposer(config(suffix_decoding_min_token_prob=floor, suffix_decoding_max_spec_factor=1.0))
        for output in outputs:
            finish(proposer, [0], output)
        # "1 2": 3 at probability 1, then 4 or 6 at 1/2 each (the match is 2 long: 2 tokens at most)
        assert proposer.propose(make_seq([9, 1, 2]), 8) == want, floor
    proposer = SuffixProposer(config(suffix_decoding_min_token_prob=0.5, suffix_decoding_max_spec_factor=4.0))
    for output in outputs:
        finish(proposer, [0], output)
    assert proposer.propose(make_seq([9, 1, 2]), 8) == [3, 4, 5]   # 5 follows 4 always: still 1/2
    proposer = SuffixProposer(config(suffix_decoding_min_token_prob=0.51, suffix_decoding_max_spec_factor=4.0))
    for output in outputs:
        finish(proposer, [0], output)
    assert proposer.propose(make_seq([9, 1, 2]), 8) == [3]


def test_spec_factor_max_tokens_and_k_cut_the_draft():
    output = list(range(100, 140))
    for fields, max_tokens, context, want in (
            (dict(suffix_decoding_max_spec_factor=1.0), 64, [100, 101], [102, 103]),
            (dict(suffix_decoding_max_spec_factor=0.5), 64, [100, 101], [102]),
            (dict(suffix_decoding_max_spec_factor=0.5), 64, [100, 101, 102], [103, 104]),   # ceil(1.5)
            (dict(suffix_decoding_max_spec_factor=0.28, suffix_decoding_max_tree_depth=40), 64, list(range(100, 125)),
             list(range(125, 132))),                                  # 0.28 * 25 is 7.000000000000001
            (dict(suffix_decoding_max_spec_factor=2.0), 64, [100, 101], [102, 103, 104, 105]),
            (dict(suffix_decoding_max_spec_factor=0.0), 64, [100, 101], []),
            (dict(suffix_decoding_max_spec_factor=8.0), 3, [100, 101], [102, 103, 104]),
            (dict(suffix_decoding_max_spec_factor=8.0, num_speculative_tokens=5), 64, [100, 101],
             [102, 103, 104, 105, 106]),
            (dict(suffix_decoding_max_spec_factor=8.0), 0, [100, 101], [])):
        proposer = SuffixProposer(config(**fields))
        finish(proposer, [1], output)
        assert proposer.propose(make_seq([7] + context), max_tokens) == want, (fields, max_tokens)


def test_depth_bounds_the_match():
    # "1 2 3 4" is followed by 5 twice and by 7 once, the once after "9 1 2 3 4"
    outputs = ([9, 1, 2, 3, 4, 7, 7], [8, 1, 2, 3, 4, 5, 5], [8, 1, 2, 3, 4, 5, 5])
    context = [9, 1, 2, 3, 4]
    # D = 6, k = 2: at most 4 tokens matched ("1 2 3 4": 5 5); D = 7: 5, the longer context wins (7 7);
    # D = 3, k = 4: 1 matched ("4"), and the draft stops at depth 3 (5 5) though 4 were allowed
    for depth, k, factor, want in ((6, 2, 1.0, [5, 5]), (7, 2, 1.0, [7, 7]), (3, 4, 4.0, [5, 5])):
        cfg = config(suffix_decoding_max_tree_depth=depth, num_speculative_tokens=k,
                     suffix_decoding_max_spec_factor=factor, suffix_decoding_min_token_prob=0.0)
        proposer = SuffixProposer(cfg)
        for output in outputs:
            finish(proposer, [0], output)
        assert proposer.propose(make_seq(context), 8) == want, depth
        assert reference_propose(cfg, context, [list(o) for o in outputs], 8) == want
    cfg = config(suffix_decoding_max_tree_depth=1)
    proposer = SuffixProposer(cfg)
    finish(proposer, [0], [1, 2, 1, 2])
    assert proposer.propose(make_seq([1, 2, 1]), 8) == []       # depth 1: single tokens, nothing follows


def test_local_and_global_drafts_compete_by_score():
    proposer = SuffixProposer(config(suffix_decoding_min_token_prob=0.0))
    finish(proposer, [0], [1, 2, 30, 31])
    # own tokens: "1 2" followed by 20 21 once (probability 1/2 each: score 1); global: 30 31 at 1 (score 2)
    assert proposer.propose(make_seq([1, 2, 20, 21, 5, 1, 2]), 2) == [30, 31]
    # own: "5 1 2" matches, longer but at 1/2 still; global matches "1 2" only: scores decide, not lengths
    assert proposer.propose(make_seq([5, 1, 2, 20, 21, 5, 1, 2]), 2) == [30, 31]
    proposer = SuffixProposer(config(suffix_decoding_min_token_prob=0.0))
    finish(proposer, [0], [1, 2, 30, 1, 2, 31])      # global: 30 or 31 after "1 2", 1/2 each
    assert proposer.propose(make_seq([1, 2, 20, 21, 1, 2]), 2) == [20, 21]   # a tie: the request's own


# ---- the global store -----------------------------------------------------------------------------
def test_fifo_eviction_equals_a_fresh_build_of_the_kept_requests():
    rng = random.Random(7)
    cfg = config(suffix_decoding_max_tree_depth=5, num_speculative_tokens=3, suffix_decoding_max_cached_requests=4,
                 suffix_decoding_min_token_prob=0.05, suffix_decoding_max_spec_factor=2.0)
    proposer = SuffixProposer(cfg)
    history: list[tuple[list[int], str | None]] = []
    for step in range(14):
        output, salt = [rng.randrange(4) for _ in range(rng.randint(1, 25))], rng.choice([None, "a"])
        finish(proposer, [9], output, salt)
        history.append((output, salt))
        kept = history[-4:]
        assert proposer.num_cached_requests == len(kept)
        fresh = SuffixProposer(cfg)
        for out, s in kept:
            finish(fresh, [9], out, s)
        assert proposer.num_global_nodes == fresh.num_global_nodes
        check_global(proposer)
        for _ in range(20):
            context, salt = [rng.randrange(4) for _ in range(rng.randint(1, 8))], rng.choice([None, "a"])
            want = fresh.propose(make_seq(context, salt=salt), 8)
            assert proposer.propose(make_seq(context, salt=salt), 8) == want
            outputs = [out for out, s in kept if s == salt]
            assert want == reference_propose(cfg, context, outputs, 8)
    # every request evicted (one at a time, FIFO): the store is empty again, roots freed
    for i in range(4):
        proposer._evict_oldest()
    assert proposer.num_global_nodes == 0 and proposer.num_cached_requests == 0 and not proposer._roots


def test_the_node_cap_holds_evicting_the_oldest_first():
    rng = random.Random(3)
    cfg = config(suffix_decoding_max_tree_depth=6, num_speculative_tokens=3)
    cap = 400
    proposer = SuffixProposer(cfg, max_global_nodes=cap)
    history = []
    for step in range(30):
        output = [rng.randrange(1000) for _ in range(rng.randint(20, 60))]   # <= 360 nodes + a root: fits alone
        finish(proposer, [1], output, rng.choice([None, "x"]))
        history.append(output)
        assert proposer.num_global_nodes <= cap
        kept = [list(indexed.tokens) for indexed in proposer._cached]
        assert kept == history[-len(kept):]                     # the newest ones, whole
        assert len(kept) <= 3                                   # 4 take at least 4 * 105 nodes
    check_global(proposer)
    fresh = SuffixProposer(cfg)
    for indexed in proposer._cached:
        finish(fresh, [1], list(indexed.tokens), indexed.salt)
    assert fresh.num_global_nodes == proposer.num_global_nodes
    # a request longer than the store: evicts everything, then keeps only its last part
    long_output = rng.sample(range(1000), 500)
    finish(proposer, [1], long_output, "y")
    assert proposer.num_cached_requests == 1 and proposer.num_global_nodes <= cap
    check_global(proposer)
    assert proposer.propose(make_seq([5] + long_output[-10:-3], salt="y"), 8) == long_output[-3:]
    assert proposer.propose(make_seq([5] + long_output[:7], salt="y"), 8) == []


def test_the_token_cap_evicts_the_oldest_first():
    proposer = SuffixProposer(config(), max_indexed_tokens=10, max_global_tokens=30)
    for i in range(5):
        finish(proposer, [0], [100 + i] * 12)          # the last 10 kept, in D nodes
    assert proposer.num_cached_requests == 3
    assert [list(indexed.tokens) for indexed in proposer._cached] == [[102] * 10, [103] * 10, [104] * 10]
    assert proposer.propose(make_seq([1, 101]), 2) == []
    assert proposer.propose(make_seq([1, 102]), 2) == [102]
    assert proposer.propose(make_seq([1, 104, 104]), 2) == [104, 104]
    check_global(proposer)


def test_a_long_output_indexes_only_its_last_part():
    cfg = config(suffix_decoding_max_tree_depth=6, num_speculative_tokens=2)
    proposer = SuffixProposer(cfg, max_indexed_tokens=20)
    output = list(range(100, 160))
    finish(proposer, [1], output)
    assert proposer.propose(make_seq([3, 142, 143]), 8) == [144, 145]
    assert proposer.propose(make_seq([3, 138, 139]), 8) == []         # 40 tokens back: not kept
    fresh = SuffixProposer(cfg)
    finish(fresh, [1], output[-20:])
    assert fresh.num_global_nodes == proposer.num_global_nodes
    check_global(proposer)


def test_salts_isolate_and_share_one_fifo():
    proposer = SuffixProposer(config(suffix_decoding_max_cached_requests=2))
    finish(proposer, [0], [1, 2, 3, 4, 5], "tenant-a")
    context = [9, 1, 2, 3]
    assert proposer.propose(make_seq(context, salt="tenant-a"), 8) == [4, 5]
    assert proposer.propose(make_seq(context, salt="tenant-b"), 8) == []
    assert proposer.propose(make_seq(context, salt=None), 8) == []
    finish(proposer, [0], [1, 2, 3, 6, 7], None)
    assert proposer.propose(make_seq(context, salt=None), 8) == [6, 7]
    assert proposer.propose(make_seq(context, salt="tenant-a"), 8) == [4, 5]
    finish(proposer, [0], [8, 8, 8], "tenant-b")                 # the third: tenant-a's goes (FIFO)
    assert proposer.propose(make_seq(context, salt="tenant-a"), 8) == []
    assert proposer.propose(make_seq(context, salt=None), 8) == [6, 7]
    assert set(proposer._roots) == {None, "tenant-b"}
    check_global(proposer)


def test_finished_drops_the_request_state_and_ignores_an_empty_output():
    proposer = SuffixProposer(config())
    seq = make_seq([1, 2, 3, 1, 2])
    assert proposer.propose(seq, 8) == [3, 1]
    assert isinstance(seq.proposer_state, _RequestIndex)
    proposer.finished(seq)                     # a prompt only: nothing to index
    assert seq.proposer_state is None and proposer.num_cached_requests == 0 and proposer.num_global_nodes == 0


def test_a_token_out_of_range_raises_and_changes_nothing():
    proposer = SuffixProposer(config())
    finish(proposer, [0], [1, 2, 3])
    nodes = proposer.num_global_nodes
    with pytest.raises(OverflowError):
        finish(proposer, [0], [1, 2, -1])
    assert proposer.num_global_nodes == nodes and proposer.num_cached_requests == 1
    seq = make_seq([5, 6, 5])
    assert proposer.propose(seq, 8) == [6]
    seq.token_ids += [6, 2**32]
    with pytest.raises(OverflowError):
        proposer.propose(seq, 8)
    seq.token_ids[-1] = 5
    assert proposer.propose(seq, 8) == proposer.propose(make_seq(seq.token_ids), 8) == [6, 5]
    check_trie(seq.proposer_state.trie, {seq.proposer_state.seq.root: [seq.token_ids]})


def test_bounds_are_validated():
    with pytest.raises(ValueError, match="max_global_nodes"):
        SuffixProposer(config(suffix_decoding_max_tree_depth=24), max_global_nodes=25)
    with pytest.raises(ValueError, match="max_request_nodes"):
        SuffixProposer(config(suffix_decoding_max_tree_depth=24), max_request_nodes=10)
    with pytest.raises(ValueError, match="max_indexed_tokens"):
        SuffixProposer(config(), max_indexed_tokens=0)
    with pytest.raises(ValueError, match="max_global_tokens"):
        SuffixProposer(config(), max_indexed_tokens=100, max_global_tokens=99)


# ---- the per-request trie -------------------------------------------------------------------------
def test_incremental_request_trie_equals_a_fresh_build():
    rng = random.Random(11)
    cfg = config(suffix_decoding_max_tree_depth=7, num_speculative_tokens=4, suffix_decoding_min_token_prob=0.05,
                 suffix_decoding_max_spec_factor=1.5)
    proposer = SuffixProposer(cfg)
    seq = make_seq([rng.randrange(5) for _ in range(6)])
    for step in range(60):
        seq.token_ids += [rng.randrange(5) for _ in range(rng.choice((1, 1, 2, 5)))]
        if step % 15 == 14:       # not a continuation: a different last token, or fewer tokens
            seq.token_ids = seq.token_ids[:-rng.randint(1, 4)] + [5]
        draft = proposer.propose(seq, 8)
        fresh = make_seq(seq.token_ids)
        assert draft == proposer.propose(fresh, 8) == reference_propose(cfg, seq.token_ids, [], 8)
        state, built = seq.proposer_state, fresh.proposer_state
        assert state.trie.size == built.trie.size
        check_trie(state.trie, {state.seq.root: [seq.token_ids]})


def test_a_long_prompt_is_indexed_over_several_calls():
    """Each propose indexes at most INDEX_TOKENS_PER_CALL new tokens (no step stalls on a long
    prompt); once caught up the trie is the fresh build's and so are the drafts."""
    rng = random.Random(5)
    cfg = config(suffix_decoding_max_tree_depth=7, num_speculative_tokens=4)
    proposer = SuffixProposer(cfg)
    n = 3 * INDEX_TOKENS_PER_CALL + 17
    seq = make_seq([rng.randrange(6) for _ in range(n)])
    synced = []
    for _ in range(5):
        proposer.propose(seq, 4)
        synced.append(seq.proposer_state.synced)
    assert synced == [INDEX_TOKENS_PER_CALL * i for i in (1, 2, 3)] + [n, n]
    assert proposer.propose(seq, 4) == reference_propose(cfg, seq.token_ids, [], 4)
    check_trie(seq.proposer_state.trie, {seq.proposer_state.seq.root: [seq.token_ids]})


def test_request_trie_bounds_hold_and_slide():
    rng = random.Random(5)
    cfg = config(suffix_decoding_max_tree_depth=8, num_speculative_tokens=3)
    proposer = SuffixProposer(cfg, max_request_nodes=200, max_indexed_tokens=50)
    seq = make_seq([rng.randrange(1000) for _ in range(300)])
    proposer.propose(seq, 8)
    assert len(seq.proposer_state.seq.tokens) == 50        # a long first call indexes only its last part
    for _ in range(100):
        seq.token_ids.append(rng.randrange(1000))
        proposer.propose(seq, 8)
        trie, indexed = seq.proposer_state.trie, seq.proposer_state.seq
        assert trie.size <= 200 and indexed.window <= 50
    check_trie(trie, {indexed.root: [list(indexed.tokens[indexed.start:])]})
    # within the token window alone (repeating text needs few nodes): equals a fresh build of the last 50
    proposer = SuffixProposer(cfg, max_indexed_tokens=50)
    seq = make_seq([rng.randrange(1000) for _ in range(200)])
    for _ in range(60):
        seq.token_ids += seq.token_ids[-rng.randint(10, 60):][:rng.randint(1, 4)]
        tail = make_seq(seq.token_ids[-50:])
        assert proposer.propose(seq, 8) == proposer.propose(tail, 8)
        assert seq.proposer_state.trie.size == tail.proposer_state.trie.size


# ---- against the reference ------------------------------------------------------------------------
def test_propose_agrees_with_the_brute_force_reference():
    rng = random.Random(2024)
    checked = drafted = 0
    for case in range(250):
        cfg = config(suffix_decoding_max_tree_depth=rng.randint(2, 7), num_speculative_tokens=rng.randint(1, 6),
                     suffix_decoding_max_cached_requests=rng.randint(1, 5),
                     suffix_decoding_max_spec_factor=rng.choice((0.5, 1.0, 1.5, 3.0)),
                     suffix_decoding_min_token_prob=rng.choice((0.0, 0.1, 0.3, 0.5, 0.6)))
        vocab = rng.randint(2, 4)
        window = rng.choice((1, 2, 3, 5, 100))      # tokens indexed per request: often fewer than D
        proposer = SuffixProposer(cfg, max_indexed_tokens=window)
        history = []
        for _ in range(rng.randint(0, 7)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 14))]
            salt = rng.choice((None, "s"))
            finish(proposer, prompt, output, salt)
            if output:
                history.append((output[-window:], salt))
        kept = history[-cfg.suffix_decoding_max_cached_requests:]
        for _ in range(3):
            salt = rng.choice((None, "s"))
            outputs = [out for out, s in kept if s == salt]
            seq = make_seq([rng.randrange(vocab) for _ in range(rng.randint(1, 10))], salt=salt)
            for _ in range(4):      # the same sequence growing: its trie kept in step
                max_tokens = rng.randint(0, 8)
                draft = proposer.propose(seq, max_tokens)
                want = reference_propose(cfg, seq.token_ids, outputs, max_tokens, own=seq.token_ids[-window:])
                assert draft == want, (case, seq.token_ids)
                checked += 1
                drafted += bool(draft)
                seq.token_ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        check_global(proposer)
    assert drafted > checked // 3       # the cases exercise drafts, not only empty answers


# ---- costs ----------------------------------------------------------------------------------------
def test_costs():
    """A 2000-token sequence at the defaults (D = 24, k = 4) against 50 cached 500-token outputs:
    the figures quoted in the module docstring, with a bound far above them (a shared machine)."""
    rng = random.Random(1)
    proposer = SuffixProposer(config(num_speculative_tokens=4))
    start = time.perf_counter()
    for i in range(50):
        finish(proposer, [1], [rng.randrange(50000) for _ in range(500)])
    finished_ms = (time.perf_counter() - start) * 1e3 / 50
    seq = make_seq([rng.randrange(50000) for _ in range(2000)], 1000)
    start = time.perf_counter()
    while seq.proposer_state is None or seq.proposer_state.synced < len(seq.token_ids):
        proposer.propose(seq, 4)
    build_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(500):
        proposer.propose(seq, 4)
    propose_us = (time.perf_counter() - start) * 1e6 / 500
    start = time.perf_counter()
    for _ in range(500):
        seq.token_ids.append(rng.randrange(50000))
        proposer.propose(seq, 4)
    step_us = (time.perf_counter() - start) * 1e6 / 500
    print(f"finished (500 tokens) {finished_ms:.1f} ms, indexing a 2000-token prompt {build_ms:.1f} ms, "
          f"propose {propose_us:.1f} us, a token appended + propose {step_us:.1f} us")
    assert propose_us < 1000 and step_us < 2000


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
