"""Block manager (engine/kv/block_manager.py), pure Python: ref counts, hash-chained prefix hits,
eviction order, salted chains, and every block back free at the end."""
from __future__ import annotations

import pytest

from pdserve.engine.kv.block_manager import BlockManager, NoFreeBlocks, prompt_block_hashes, salt_root
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

BS = 4


def seq(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4, cache_salt=salt))


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Allocate and compute the whole prompt, as a step would."""
    bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.mark_computed(s)
    return s


def test_shared_prefix_is_a_hit_and_ref_counted() -> None:
    bm = BlockManager(16, BS)
    a = computed(bm, seq("a", list(range(12))))
    b = seq("b", list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.allocate(b) == 8                                  # two leading blocks found computed
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 12 + 13
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_a_chain_breaks_at_the_first_different_block() -> None:
    bm = BlockManager(16, BS)
    computed(bm, seq("a", list(range(12))))
    other = [0, 1, 2, 3, 40, 5, 6, 7, 8, 9, 10, 11]            # block 1 differs: block 2 cannot hit
    assert bm.allocate(seq("b", other + [1])) == 4
    assert prompt_block_hashes(other, BS)[2] != prompt_block_hashes(list(range(12)), BS)[2]


def test_the_last_token_is_always_computed() -> None:
    bm = BlockManager(16, BS)
    computed(bm, seq("a", list(range(8))))
    assert bm.allocate(seq("b", list(range(8)))) == 4          # all cached, the last block recomputed


def test_freed_blocks_stay_cached_and_the_tail_is_evicted_first() -> None:
    bm = BlockManager(4, BS)
    a = computed(bm, seq("a", list(range(12))))
    head, mid, tail = a.block_table
    bm.free(a)
    assert bm.num_free_blocks == 4                              # free, but still found by key
    assert bm.allocate(seq("b", list(range(8)) + [7])) == 8     # head and mid hit again
    bm2 = BlockManager(4, BS)
    a = computed(bm2, seq("a", list(range(12))))
    head, mid, tail = a.block_table
    bm2.free(a)
    c = seq("c", [50, 51, 52, 53, 54, 55])                      # two fresh blocks: the never-used one, then the tail
    bm2.allocate(c)
    assert tail in c.block_table and head not in c.block_table and mid not in c.block_table
    assert bm2.allocate(seq("d", list(range(8)))) == 4         # the head of the chain survived


def test_no_free_blocks_changes_nothing() -> None:
    bm = BlockManager(3, BS)
    a = computed(bm, seq("a", list(range(8))))
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq("b", list(range(100, 112))))
    assert bm.num_free_blocks == 1 and [bm.blocks[i].ref_count for i in a.block_table] == [1, 1]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq("c", [1, 2, 3]), reserve_blocks=1)     # room kept for others
    bm.free(a)
    assert bm.num_free_blocks == 3


def test_salted_chains_never_share() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(12))
    computed(bm, seq("a", tokens, salt="alice"))
    assert bm.allocate(seq("b", tokens + [1], salt="bob")) == 0
    assert bm.allocate(seq("c", tokens + [1])) == 0
    assert bm.allocate(seq("d", tokens + [1], salt="alice")) == 12
    assert salt_root("alice") != salt_root("bob") != salt_root(None)
    assert bm.computed_prefix_blocks(tokens) == []
    assert bm.computed_prefix_blocks(tokens, salt_root("alice")) == prompt_block_hashes(tokens, BS, salt_root("alice"))


def test_a_received_sequence_shares_only_computed_blocks_and_is_keyed_when_verified() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(12))
    pending = seq("p", tokens)
    bm.allocate(pending)                                        # keyed, not computed yet
    r = seq("r", tokens)
    assert bm.allocate(r, max_cached_tokens=r.num_tokens, receiving=True) == 0
    assert set(r.block_table).isdisjoint(pending.block_table)   # a block still being computed is not shared
    bm.free(pending)
    bm.free(r)
    bm = BlockManager(16, BS)
    r = seq("r", tokens)
    bm.allocate(r, max_cached_tokens=r.num_tokens, receiving=True)
    assert bm.hash_to_block == {}                               # unverified bytes: no key
    r.num_computed_tokens = r.num_tokens
    bm.mark_computed(r)                                         # verified: its keys go in
    assert len(bm.computed_keys()) == 3
    assert bm.allocate(seq("x", tokens + [5])) == 12


def test_a_reused_run_of_blocks_comes_back_in_ascending_order() -> None:
    """A freed sequence's blocks return tail first; the next sequence still gets them as one
    ascending run (the KV hand-off writes and reads the pool a run at a time)."""
    bm = BlockManager(8, BS)
    a = computed(bm, seq("a", list(range(32))))
    assert a.block_table == list(range(8))
    bm.free(a)
    b = seq("b", [100 + t for t in range(32)])   # no hit: all eight blocks fresh, taken tail first
    bm.allocate(b)
    assert b.block_table == list(range(8))
