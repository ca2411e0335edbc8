"""KV tiers under the prefix cache (engine/kv/tiers.py, engine/kv/tier_file.py): blocks the pool
evicts go to host RAM, then disk, and come back as prefix-cache hits with exact greedy output;
a restarted engine serves a prefix from disk; broken, foreign or colliding block files are
refused and recomputed; the budgets hold; a failing disk costs recomputation, never an error.

The pool is six blocks of 8 tokens: one sequence (32-token shared prefix + 5-token tail + 8 new
tokens = 45 tokens) fills it, so each turn evicts the previous one's blocks into the tiers.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.block_manager import prompt_block_hashes
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.tier_file import HEADER, KEY_FILE, TierBlock, block_file_name, encode, file_size
from pdserve.engine.kv.tiers import DiskTier, STAT_KEYS
from tests.conftest import assert_no_leak, hf_greedy, random_prompts

BS = 8
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PREFIX_A, PREFIX_B, PREFIX_C = random_prompts(3, 32, 32, seed=21)
TAILS = random_prompts(4, 5, 5, seed=22)
PREFIX_TOKENS = 32
BLOCK_BYTES = 2 * 2 * BS * 2 * 32 * 4          # tiny preset: 2 layers, K and V, 2 KV heads of 32, float32
FILE_BYTES = file_size(BS, BLOCK_BYTES)
# Turns that alternate prefixes: each evicts the previous prefix's blocks from the pool.
TURNS = [PREFIX_A + TAILS[0], PREFIX_B + TAILS[0], PREFIX_A + TAILS[1], PREFIX_B + TAILS[1], PREFIX_A + TAILS[2]]


def make_llm(model: str, **overrides) -> LLM:
    kwargs = dict(dtype="float32", block_size=BS, num_kv_blocks=6, max_num_batched_tokens=256, max_num_seqs=4)
    kwargs.update(overrides)
    return LLM(model, **kwargs)


def run_turns(llm: LLM, turns: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone, in order: (generated ids, cached prompt tokens); no leak after any."""
    out = []
    for prompt in turns:
        (o,) = llm.generate([prompt], GREEDY)
        out.append((o.token_ids, o.num_cached_tokens))
        assert_no_leak(llm)
    return out


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def dir_bytes(root: Path) -> int:
    """Bytes of the files under root but the tier's key."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != KEY_FILE)


def file_name(root: Path, key: int) -> str:
    """The name the tier under root gives block key (keyed by the secret it keeps there)."""
    return block_file_name((root / KEY_FILE).read_bytes(), key)


def block_file(root: Path, prompt: list[int], index: int) -> Path:
    (path,) = root.glob(f"*/{file_name(root, prompt_block_hashes(prompt, BS)[index])}")
    return path


@pytest.fixture(scope="module")
def reference(tiny_qwen3: str) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations of every prompt here with the tiers off (checked against HF once)."""
    prompts = [PREFIX_A + t for t in TAILS] + [PREFIX_B + t for t in TAILS] + [PREFIX_C + t for t in TAILS]
    llm = make_llm(tiny_qwen3, num_kv_blocks=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs[:4]] == hf_greedy(tiny_qwen3, prompts[:4], MAX_NEW)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


def check_exact(reference: dict, turns: list[list[int]], got: list[tuple[list[int], int]]) -> None:
    assert [ids for ids, _ in got] == [reference[tuple(p)] for p in turns]


# ---- host and disk under a small pool ---------------------------------------------------------
def test_evicted_prefixes_come_back_from_host_and_disk_exactly(tiny_qwen3: str, reference, tmp_path: Path) -> None:
    off = make_llm(tiny_qwen3)
    base = run_turns(off, TURNS)
    on = make_llm(tiny_qwen3, kv_host_cache_bytes=2 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path))
    got = run_turns(on, TURNS)
    check_exact(reference, TURNS, got)
    check_exact(reference, TURNS, base)
    # Without tiers the pool holds nothing of a prefix two turns back; with them all 4 blocks return.
    assert [c for _, c in base] == [0, 0, 0, 0, 0]
    assert [c for _, c in got] == [0, 0, PREFIX_TOKENS, PREFIX_TOKENS, PREFIX_TOKENS]
    stats = on.stats()
    assert stats["kv_host_hits"] > 0 and stats["kv_disk_hits"] > 0, stats
    assert stats["kv_host_hits"] + stats["kv_disk_hits"] == 3 * PREFIX_TOKENS // BS
    assert stats["prefix_cache_hits"] == off.stats()["prefix_cache_hits"] + 3 * PREFIX_TOKENS
    assert stats["kv_offloaded_blocks"] > 0 and stats["kv_host_bytes"] == 2 * BLOCK_BYTES
    assert stats["kv_tier_refused"] == stats["kv_tier_dropped_writes"] == stats["kv_tier_write_errors"] == 0
    on.engine.kv_tiers.flush()
    assert on.stats()["kv_disk_bytes"] == dir_bytes(tmp_path) > 0


def test_host_tier_alone_and_batched_prompts_with_preemption(tiny_qwen3: str, reference) -> None:
    llm = make_llm(tiny_qwen3, kv_host_cache_bytes=1 << 20)
    check_exact(reference, TURNS, run_turns(llm, TURNS))
    assert llm.stats()["kv_host_hits"] == 3 * PREFIX_TOKENS // BS and llm.stats()["kv_disk_hits"] == 0
    # Prefixes interleaved, all at once, growing past the pool: preemption frees and re-admits
    # sequences through the tiers; the same output as without them, and every block back.
    batch = [p + t for t in TAILS for p in (PREFIX_A, PREFIX_B, PREFIX_C)]
    longer = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = make_llm(tiny_qwen3, num_kv_blocks=11).generate(batch, longer)
    llm = make_llm(tiny_qwen3, num_kv_blocks=11, kv_host_cache_bytes=1 << 20)
    outs = llm.generate(batch, longer)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["kv_host_hits"] > 0, llm.stats()
    assert_no_leak(llm)


def test_tiers_are_off_without_prefix_caching_or_settings(tiny_qwen3: str, tmp_path: Path) -> None:
    llm = make_llm(tiny_qwen3, enable_prefix_caching=False, kv_host_cache_bytes=1 << 20, kv_disk_cache_dir=str(tmp_path))
    assert llm.engine.kv_tiers is None and llm.engine.block_manager.tiers is None
    run_turns(llm, TURNS[:3])
    assert not any(tmp_path.iterdir())
    plain = make_llm(tiny_qwen3)
    assert plain.engine.kv_tiers is None
    assert {k: plain.stats()[k] for k in STAT_KEYS} == dict.fromkeys(STAT_KEYS, 0)


def test_kv_events_say_tiered_on_offload_and_stored_on_reload(tiny_qwen3: str) -> None:
    """A router learns that a prefix left the pool for a tier (a load, not a recompute), that it
    came back, and, in a snapshot, which keys only a tier holds."""
    llm = make_llm(tiny_qwen3, kv_host_cache_bytes=1 << 20)
    engine = llm.engine
    keys = prompt_block_hashes(PREFIX_A, BS)
    llm.generate([TURNS[0]], GREEDY)
    cursor = engine.read_kv_events(None).cursor
    llm.generate([TURNS[1]], GREEDY)                   # prefix A leaves the pool for the host tier
    batch = engine.read_kv_events(cursor)
    assert set(keys) <= set(batch.tiered) and not set(keys) & set(batch.removed), batch
    snapshot = engine.read_kv_events(None)
    assert set(keys) <= set(snapshot.tiered) and not set(keys) & set(snapshot.stored)
    llm.generate([TURNS[2]], GREEDY)                   # and comes back from it
    assert set(keys) <= set(engine.read_kv_events(batch.cursor).stored)


def test_kv_events_say_removed_when_no_tier_keeps_the_block(tiny_qwen3: str) -> None:
    """A host tier of one block, no disk: the blocks it cannot keep are announced removed."""
    llm = make_llm(tiny_qwen3, kv_host_cache_bytes=BLOCK_BYTES)
    engine = llm.engine
    keys = prompt_block_hashes(PREFIX_A, BS)
    llm.generate([TURNS[0]], GREEDY)
    cursor = engine.read_kv_events(None).cursor
    llm.generate([TURNS[1]], GREEDY)
    batch = engine.read_kv_events(cursor)
    assert len(set(keys) & set(batch.tiered)) <= 1 and len(set(keys) & set(batch.removed)) >= len(keys) - 1, batch
    assert len(engine.read_kv_events(None).tiered) == 1


def test_a_decode_reservation_does_not_ask_for_blocks_a_tier_holds(tiny_qwen3: str) -> None:
    llm = make_llm(tiny_qwen3, kv_host_cache_bytes=1 << 20)
    llm.generate(TURNS[:2], GREEDY)                    # prefix A in the host tier only
    engine = llm.engine
    reservation = engine.reserve("r", PREFIX_A + TAILS[3], GREEDY)
    assert reservation.held_block_hashes == prompt_block_hashes(PREFIX_A, BS)
    assert engine.abort("r")
    assert_no_leak(llm)


# ---- disk: restart, refusal, budgets, failures -------------------------------------------------
def fill_disk(model: str, root: Path, turns: list[list[int]] = TURNS[:2], **overrides) -> LLM:
    """An engine with the disk tier alone: the turns leave the first prefix on disk; closed (written)."""
    llm = make_llm(model, kv_disk_cache_dir=str(root), **overrides)
    run_turns(llm, turns)
    llm.close()
    return llm


def test_a_restarted_engine_serves_a_prefix_from_disk_without_recomputing_it(tiny_qwen3: str, reference,
                                                                            tmp_path: Path) -> None:
    fill_disk(tiny_qwen3, tmp_path)
    assert len(block_files(tmp_path)) == PREFIX_TOKENS // BS + 1   # A's 4 prefix blocks and its tail block
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path))   # new process state: the index from the dir
    assert llm.stats()["kv_disk_blocks"] == PREFIX_TOKENS // BS + 1
    prompt = PREFIX_A + TAILS[3]
    got = run_turns(llm, [prompt])
    check_exact(reference, [prompt], got)
    assert got[0][1] == PREFIX_TOKENS and llm.stats()["kv_disk_hits"] == PREFIX_TOKENS // BS
    first = llm.engine.trace[0]
    assert first.num_tokens == [len(prompt) - PREFIX_TOKENS]     # only the uncached tail was computed


def test_a_prompt_waits_for_its_blocks_from_disk_while_another_is_served(tiny_qwen3: str, reference,
                                                                        tmp_path: Path, monkeypatch) -> None:
    """Disk reads run ahead on the reader thread: the prompt whose prefix is on disk waits for
    it (made slow here) while a prompt behind it is admitted and computed; then it is served
    from the blocks read ahead, with the tokens of a run without tiers."""
    fill_disk(tiny_qwen3, tmp_path)
    slow_get = DiskTier.get

    def get(self, *args):
        import threading
        import time
        assert threading.current_thread().name.startswith("kv-disk-reader")   # never the engine's step
        time.sleep(0.3)   # kept: a slow disk is what is tested
        return slow_get(self, *args)
    monkeypatch.setattr(DiskTier, "get", get)
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path), num_kv_blocks=16)
    on_disk, other = PREFIX_A + TAILS[3], PREFIX_C + TAILS[3]
    outs = llm.generate([on_disk, other], GREEDY)
    check_exact(reference, [on_disk, other], [(o.token_ids, o.num_cached_tokens) for o in outs])
    assert outs[0].num_cached_tokens == PREFIX_TOKENS and outs[1].num_cached_tokens == 0
    trace = llm.engine.trace
    assert trace[0].request_ids == [outs[1].request_id]   # the second prompt went first
    assert llm.engine.kv_tiers.prefetched == PREFIX_TOKENS // BS
    assert_no_leak(llm)
    llm.close()


def test_a_restart_in_a_real_subprocess_serves_its_blocks(tiny_qwen3: str, reference, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from pdserve.engine import LLM, SamplingParams
        llm = LLM({tiny_qwen3!r}, dtype="float32", block_size={BS}, num_kv_blocks=6, max_num_seqs=4,
                  kv_disk_cache_dir={str(tmp_path)!r})
        for prompt in {TURNS[:2]!r}:
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens={MAX_NEW}, ignore_eos=True))
        llm.close()
    """)
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(root)})
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path))
    got = run_turns(llm, [PREFIX_A + TAILS[2]])
    check_exact(reference, [PREFIX_A + TAILS[2]], got)
    assert got[0][1] == PREFIX_TOKENS and llm.stats()["kv_disk_hits"] == PREFIX_TOKENS // BS


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 8 * BS + 100] ^= 0x01
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


def _foreign_header(path: Path) -> None:
    """Another fingerprint with a valid MAC (made with the tier's own key): only the fingerprint
    check can catch it."""
    from pdserve.engine.kv.tier_file import DIGEST_BYTES, block_mac

    data = bytearray(path.read_bytes())
    data[8:24] = bytes(16)
    mac = block_mac((path.parents[1] / KEY_FILE).read_bytes())
    mac.update(bytes(data[:-DIGEST_BYTES]))
    data[-DIGEST_BYTES:] = mac.digest()
    path.write_bytes(data)


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _foreign_header], ids=lambda f: f.__name__[1:])
def test_a_damaged_or_foreign_block_file_is_refused_and_recomputed(tiny_qwen3: str, reference, tmp_path: Path,
                                                                  damage) -> None:
    fill_disk(tiny_qwen3, tmp_path)
    bad = block_file(tmp_path, PREFIX_A, 2)
    damage(bad)
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path))
    prompt = PREFIX_A + TAILS[3]
    got = run_turns(llm, [prompt])
    check_exact(reference, [prompt], got)
    stats = llm.stats()
    assert stats["kv_tier_refused"] == 1 and stats["kv_disk_hits"] == 2, stats   # blocks 0, 1; 2 refused, 3 after it
    assert got[0][1] == 2 * BS
    assert not bad.exists()   # deleted (the pool still holds the recomputed block: nothing rewrote it)


def test_an_engine_of_another_dtype_sharing_the_dir_never_uses_these_blocks(tiny_qwen3: str, reference,
                                                                          tmp_path: Path) -> None:
    fill_disk(tiny_qwen3, tmp_path)
    (f32,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    fill_disk(tiny_qwen3, tmp_path, dtype="bfloat16")
    (bf16,) = {d for d in tmp_path.iterdir() if d.is_dir()} - {f32}   # one directory per fingerprint
    # A bfloat16 file where a float32 one should be: a sound file of another fingerprint.
    name = file_name(tmp_path, prompt_block_hashes(PREFIX_A, BS)[0])
    shutil.copy(bf16 / name, f32 / name)
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path))
    prompt = PREFIX_A + TAILS[3]
    got = run_turns(llm, [prompt])
    check_exact(reference, [prompt], got)
    assert got[0][1] == 0 and llm.stats()["kv_tier_refused"] == 1 and llm.stats()["kv_disk_hits"] == 0
    assert not (f32 / name).exists() and (bf16 / name).exists()


def test_budgets_hold_and_a_zero_disk_budget_only_drops(tiny_qwen3: str, reference, tmp_path: Path) -> None:
    budget = 3 * FILE_BYTES
    llm = make_llm(tiny_qwen3, kv_host_cache_bytes=BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path),
                   kv_disk_cache_bytes=budget)
    turns = [PREFIX_A + TAILS[0], PREFIX_B + TAILS[0], PREFIX_C + TAILS[0], PREFIX_A + TAILS[1],
             PREFIX_B + TAILS[1], PREFIX_C + TAILS[1], PREFIX_A + TAILS[2]]
    got = []
    for prompt in turns:
        got += run_turns(llm, [prompt])
        llm.engine.kv_tiers.flush()
        assert dir_bytes(tmp_path) <= budget and llm.stats()["kv_host_bytes"] <= BLOCK_BYTES
    check_exact(reference, turns, got)
    assert llm.stats()["kv_disk_writes"] > 3 and llm.stats()["kv_disk_bytes"] == dir_bytes(tmp_path)
    # A restart with a smaller budget trims the directory to it, least recently used first.
    make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=FILE_BYTES)
    assert dir_bytes(tmp_path) <= FILE_BYTES
    zero = tmp_path / "zero"
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(zero), kv_disk_cache_bytes=0)
    check_exact(reference, TURNS, run_turns(llm, TURNS))
    assert block_files(zero) == [] and llm.stats()["kv_tier_dropped_writes"] > 0


def test_an_unusable_or_failing_directory_degrades_to_recomputation(tiny_qwen3: str, reference,
                                                                   tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(not_a_dir / "cache"))   # cannot be created
    check_exact(reference, TURNS, run_turns(llm, TURNS))
    llm.engine.kv_tiers.flush()
    assert llm.stats()["kv_tier_write_errors"] > 0 and llm.stats()["kv_disk_blocks"] == 0
    # (a block may still be served from the write queue before its write fails: kv_disk_hits may be > 0)
    # A directory that disappears under a running engine (a full or unwritable disk fails the same way).
    root = tmp_path / "cache"
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(root))
    check_exact(reference, TURNS[:2], run_turns(llm, TURNS[:2]))
    llm.engine.kv_tiers.flush()
    (sub,) = [d for d in root.iterdir() if d.is_dir()]
    shutil.rmtree(sub)
    sub.write_text("not a directory")
    check_exact(reference, TURNS[2:], run_turns(llm, TURNS[2:]))
    llm.close()
    stats = llm.stats()
    assert stats["kv_tier_write_errors"] > 0 and stats["kv_tier_refused"] == 0, stats
    if os.geteuid() != 0:   # root writes through permission bits
        ro = tmp_path / "ro"
        llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(ro))
        (sub,) = [d for d in ro.iterdir() if d.is_dir()]
        sub.chmod(0o500)
        try:
            check_exact(reference, TURNS, run_turns(llm, TURNS))
            llm.close()
            assert llm.stats()["kv_tier_write_errors"] > 0
        finally:
            sub.chmod(0o700)


# ---- the disk tier alone ------------------------------------------------------------------------
SHAPE = (2, 2, 4, 1, 2)


def tier(root: Path, budget: int = 1 << 20) -> DiskTier:
    return DiskTier(root, budget, b"f" * 16, SHAPE, torch.float32)


def block(key: int, tokens: tuple[int, ...] = (1, 2, 3, 4), parent: int = 7) -> TierBlock:
    return TierBlock(key, parent, tokens, torch.arange(32, dtype=torch.float32).view(SHAPE) + key)


def test_disk_tier_files_round_trip_and_are_shared_through_the_directory(tmp_path: Path) -> None:
    a, b = tier(tmp_path), tier(tmp_path)          # two workers of the same model on one host
    a.put(block(5))
    assert torch.equal(a.get(5, 7, (1, 2, 3, 4)), block(5).data)   # from the queue or the file
    a.flush()
    assert torch.equal(b.get(5, 7, (1, 2, 3, 4)), block(5).data)   # not in b's index: found on disk
    assert (a.hits, b.hits, a.writes) == (1, 1, 1)
    # A collision (same key, other tokens or parent) is refused but kept: it is a sound block.
    assert b.get(5, 7, (1, 2, 3, 9)) is None and b.get(5, 8, (1, 2, 3, 4)) is None
    assert b.refused == 2 and (tmp_path / (b"f" * 16).hex() / a.file_name(5)).exists()
    # A file vanishing between index and read is a plain miss.
    (tmp_path / (b"f" * 16).hex() / a.file_name(5)).unlink()
    assert a.get(5, 7, (1, 2, 3, 4)) is None and a.refused == 0 and len(a) == 0


def test_disk_tier_keeps_its_budget_least_recently_used_first(tmp_path: Path) -> None:
    size = file_size(4, 32 * 4)
    t = tier(tmp_path, budget=2 * size)
    for key in (1, 2):
        t.put(block(key))
    t.flush()
    assert t.get(1, 7, (1, 2, 3, 4)) is not None   # 1 is now the most recently used
    t.put(block(3))
    t.flush()
    assert t.get(2, 7, (1, 2, 3, 4)) is None and t.get(1, 7, (1, 2, 3, 4)) is not None
    assert dir_bytes(tmp_path) == t.bytes == 2 * size
    t.close()
    sub = tmp_path / (b"f" * 16).hex()
    stale, fresh = sub / ".0000000000000001.1.1.tmp", sub / ".0000000000000002.1.1.tmp"   # a killed writer's
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    os.utime(stale, (0, 0))
    assert len(tier(tmp_path, budget=2 * size)) == 2   # the index, rebuilt from the directory
    assert not stale.exists() and fresh.exists()        # (a fresh one may be a sharer's write in progress)


def test_a_full_write_queue_drops_and_counts(tmp_path: Path) -> None:
    import threading

    t = DiskTier(tmp_path, 1 << 20, b"f" * 16, SHAPE, torch.float32, queue_blocks=1)
    slow_disk = threading.Event()
    write = t._write
    t._write = lambda b: (slow_disk.wait(), write(b))   # the writer stalls on its first block
    for key in range(50):
        t.put(block(key))                  # never blocks: one written, one queued, the rest dropped
    assert t.dropped >= 48
    slow_disk.set()
    t.flush()
    assert t.writes + t.dropped == 50 and len(block_files(tmp_path)) == t.writes


def test_encode_writes_what_decode_checks() -> None:
    pieces = encode(block(9), b"f" * 16, b"k" * 32)
    assert sum(len(p) for p in pieces) == file_size(4, 32 * 4)


# ---- the disk tier under a hostile neighbour ---------------------------------------------------
TOKENS = (1, 2, 3, 4)
SPARSE_BYTES = 128 << 20


def sound_file(root: Path, key: int = 5) -> tuple[DiskTier, Path]:
    """A tier under root holding block key in a file (written and flushed), and that file's path."""
    t = tier(root)
    t.put(block(key))
    t.flush()
    return t, t.dir / t.file_name(key)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}


def test_directories_and_files_are_private_and_named_by_a_keyed_hash(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    t, path = sound_file(root)
    key_file = root / KEY_FILE
    assert modes(root) == {"kv": 0o700, f"kv/{KEY_FILE}": 0o600, f"kv/{t.dir.name}": 0o700,
                           f"kv/{t.dir.name}/{path.name}": 0o600}
    assert path.name == block_file_name(key_file.read_bytes(), 5) != f"{5:016x}.kv" and len(key_file.read_bytes()) == 32
    # A restart (or a sharer of the same user) reads the same key, so the same names and MACs.
    again = tier(root)
    assert torch.equal(again.get(5, 7, TOKENS), block(5).data) and again.refused == 0
    # Another directory, another key: neither the names nor the MACs carry over.
    other = tier(tmp_path / "other")
    assert other.file_name(5) != t.file_name(5)
    shutil.copy(path, other.dir / other.file_name(5))
    assert other.get(5, 7, TOKENS) is None and other.refused == 1


def _unblock(fifo: Path) -> None:
    """Let a reader stuck opening fifo go on (the old code's hang), so the test ends."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_at_a_block_name_is_refused_without_blocking(tmp_path: Path) -> None:
    import threading

    t, path = sound_file(tmp_path)
    path.unlink()
    os.mkfifo(path, 0o600)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(t.get(5, 7, TOKENS)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    stuck = reader.is_alive()
    _unblock(path)
    reader.join(timeout=10)
    assert not stuck, "the lookup blocked opening a FIFO"
    assert got == [None] and t.refused == 1 and not path.exists()
    # One planted before a start: the scan refuses it, never opens it for long.
    os.mkfifo(path, 0o600)
    fresh = tier(tmp_path)
    assert fresh.refused == 1 and len(fresh) == 0 and not path.exists()


def _sparse(path: Path, size: int = SPARSE_BYTES) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


def _peak_bytes_of(call) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("plant", ["symlink_to_sound_block", "symlink_to_huge_file", "huge_file"])
def test_a_symlink_or_wrong_sized_file_is_refused_before_any_read(tmp_path: Path, plant: str) -> None:
    t, path = sound_file(tmp_path / "kv")
    elsewhere = tmp_path / "elsewhere"
    if plant == "symlink_to_sound_block":   # even a sound block is not followed out of the directory
        shutil.move(path, elsewhere)
        path.symlink_to(elsewhere)
    elif plant == "symlink_to_huge_file":
        path.unlink()
        path.symlink_to(_sparse(elsewhere))
    else:
        path.unlink()
        _sparse(path)
    got: list = []
    peak = _peak_bytes_of(lambda: got.append(t.get(5, 7, TOKENS)))
    assert got == [None] and t.refused == 1 and t.hits == 0
    assert peak < 1 << 20, f"{peak} bytes allocated: the file was read"
    assert not path.is_symlink() and not path.exists()   # the name removed, never a symlink's target
    assert elsewhere.exists() == plant.startswith("symlink")


@pytest.mark.parametrize("change", ["owner", "group_readable"])
def test_a_block_file_not_ours_or_not_private_is_refused(tmp_path: Path, change: str) -> None:
    t, path = sound_file(tmp_path)
    if change == "owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user takes root")
        os.chown(path, 12345, 12345)
    else:
        path.chmod(0o640)
    assert t.get(5, 7, TOKENS) is None and t.refused == 1 and not path.exists()


def test_a_forged_block_with_chosen_kv_and_an_unkeyed_digest_is_refused(tmp_path: Path) -> None:
    import hashlib

    import numpy as np

    from pdserve.engine.kv.tier_file import DIGEST_BYTES, FORMAT_VERSION, MAGIC

    t, path = sound_file(tmp_path)
    chosen = torch.full(SHAPE, 42.0)
    payload = chosen.numpy().tobytes()
    body = HEADER.pack(MAGIC, FORMAT_VERSION, 0, b"f" * 16, 5, 7, len(TOKENS), len(payload)) + \
        np.asarray(TOKENS, dtype="<i8").tobytes() + payload
    path.write_bytes(body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest())   # (keeps 0600)
    assert t.get(5, 7, TOKENS) is None and t.refused == 1 and not path.exists()


@pytest.mark.parametrize("flaw", ["root_0755", "sub_0750", "root_symlink", "root_not_ours", "key_0644",
                                  "key_short", "key_symlink"])
def test_a_directory_or_key_not_private_turns_the_disk_tier_off(tmp_path: Path, flaw: str) -> None:
    root = tmp_path / "kv"
    t, path = sound_file(root)
    path.unlink()
    sub, key_file = t.dir, root / KEY_FILE
    if flaw == "root_0755":
        root.chmod(0o755)
    elif flaw == "sub_0750":
        sub.chmod(0o750)
    elif flaw == "root_symlink":
        root.rename(tmp_path / "real")
        root.symlink_to(tmp_path / "real")
    elif flaw == "root_not_ours":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user takes root")
        os.chown(root, 12345, 12345)
    elif flaw == "key_0644":
        key_file.chmod(0o644)
    elif flaw == "key_short":
        key_file.write_bytes(b"short")
    else:
        (tmp_path / "key").write_bytes(key_file.read_bytes())
        key_file.unlink()
        key_file.symlink_to(tmp_path / "key")
    before = modes(tmp_path)
    off = tier(root)
    assert not off.enabled and off.refused == 1 and off.errors == 0
    off.put(block(6))
    off.flush()
    assert off.get(5, 7, TOKENS) is None and off.dropped == 1 and len(off) == 0
    assert modes(tmp_path) == before   # nothing written, nothing repaired


def test_an_engine_on_a_shared_directory_keeps_serving_without_its_disk_tier(tiny_qwen3: str, reference,
                                                                            tmp_path: Path) -> None:
    tmp_path.chmod(0o755)   # e.g. a directory others can list: refused, not repaired
    llm = make_llm(tiny_qwen3, kv_disk_cache_dir=str(tmp_path))
    check_exact(reference, TURNS, run_turns(llm, TURNS))
    llm.close()
    stats = llm.stats()
    assert stats["kv_tier_refused"] == 1 and stats["kv_disk_writes"] == stats["kv_disk_hits"] == 0, stats
    assert list(tmp_path.iterdir()) == [] and llm.engine.kv_tiers.disk is None


def test_a_given_secret_is_checked_and_used(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="secret must be 16 to 64 bytes, got 3"):
        DiskTier(tmp_path, 1 << 20, b"f" * 16, SHAPE, torch.float32, secret=b"abc")
    a = DiskTier(tmp_path / "a", 1 << 20, b"f" * 16, SHAPE, torch.float32, secret=b"s" * 32)
    a.put(block(5))
    a.flush()
    b = DiskTier(tmp_path / "b", 1 << 20, b"f" * 16, SHAPE, torch.float32, secret=b"s" * 32)
    shutil.copy(a.dir / a.file_name(5), b.dir / b.file_name(5))
    assert torch.equal(b.get(5, 7, TOKENS), block(5).data)
    assert not (tmp_path / "a" / KEY_FILE).exists()


@pytest.mark.parametrize("field, value", [("kv_host_cache_bytes", -1), ("kv_disk_cache_bytes", -5),
                                          ("kv_host_cache_bytes", 1.5), ("kv_disk_cache_dir", None)])
def test_tier_settings_are_validated(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="/m", **{field: value})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
