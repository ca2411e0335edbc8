"""A neighbour on the host attacks a worker's disk KV tier (issue 41, finding 4): one colocated
worker with `--kv-disk-cache-dir`, behind a router. Its directories are 0700 and its files 0600;
what the neighbour plants where a known prompt's first block would be looked for (a FIFO, a symlink
to a 1 GiB sparse file, a block with chosen KV and a valid unkeyed digest) is refused: the request
completes at its usual pace with the tokens of a run without tiers, the worker's memory does not
grow, no planted KV is used.

The planted files go under both names a block may have: the chain hash in hex (the old, unkeyed
name a neighbour can compute from a prompt) and the keyed name (engine/kv/tier_file.block_file_name:
here planted as if the neighbour had the key, and the directory's write permission, which it has
not: each check holds on its own)."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv import tier_file as kv_tier_file
from pdserve.engine.kv.block_manager import prompt_block_hashes
from pdserve.services.client import Client
from tests.conftest import random_prompts
from tests.serving import metric, scrape, start_cluster

BS = 8
MAX_NEW = 8
ENGINE_ARGS = ["--block-size", str(BS), "--num-kv-blocks", "16", "--dtype", "float32"]
PROMPTS = random_prompts(8, 40, 40, seed=41)   # 5 blocks each, +1 for the new tokens: 3 fill the pool
SPARSE_BYTES = 1 << 30


@pytest.fixture(scope="module")
def deployment(tiny_qwen3: str, tmp_path_factory: pytest.TempPathFactory):
    """(cluster, worker process, tier root, reference tokens per prompt, the block's payload bytes)."""
    root = tmp_path_factory.mktemp("kv-tier-attacks") / "kv"   # made by the worker
    offline = LLM(tiny_qwen3, dtype="float32", block_size=BS, num_kv_blocks=64)
    outs = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, outs)}
    payload = int(np.prod(offline.engine.runner.block_shape)) * 4
    cluster = start_cluster(tiny_qwen3, colocated_workers=1,
                            engine_args=[*ENGINE_ARGS, "--kv-disk-cache-dir", str(root)])
    try:
        worker = next(p for p in cluster.processes if p.name != "router")
        yield cluster, worker, root, reference, payload
    finally:
        cluster.stop()


def generate(cluster, prompt: list[int], timeout: float = 60) -> tuple[list[int], float]:
    t0 = time.monotonic()
    with Client(cluster.router_address, timeout=timeout) as client:
        out = client.generate(prompt, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return out.token_ids, time.monotonic() - t0


def fingerprint_dir(root: Path) -> Path:
    (sub,) = [d for d in root.iterdir() if d.is_dir()]
    return sub


def planted_paths(root: Path, prompt: list[int]) -> list[Path]:
    """Where the worker may look for prompt's first block: the unkeyed name, and the keyed one."""
    key = prompt_block_hashes(prompt, BS)[0]
    sub = fingerprint_dir(root)
    paths = [sub / f"{key:016x}.kv"]
    name_of = getattr(kv_tier_file, "block_file_name", None)
    if name_of is not None:
        paths.append(sub / name_of((root / kv_tier_file.KEY_FILE).read_bytes(), key))
    return paths


def tier_counts(worker) -> tuple[float, float]:
    samples = scrape(worker.metrics_address)
    return metric(samples, "pdserve:kv_disk_hits_total"), metric(samples, "pdserve:kv_tier_refused_total")


def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_the_tier_directories_and_block_files_are_private(deployment) -> None:
    cluster, _, root, reference, _ = deployment
    for prompt in PROMPTS[:3]:   # the third evicts the first's blocks to disk
        assert generate(cluster, prompt)[0] == reference[tuple(prompt)]
    sub = fingerprint_dir(root)
    deadline = time.monotonic() + 30
    while not list(sub.glob("*.kv")):   # (written in the background)
        assert time.monotonic() < deadline, "no block file written"
        time.sleep(0.05)
    mode = lambda p: p.stat().st_mode & 0o777   # noqa: E731
    assert (mode(root), mode(sub)) == (0o700, 0o700)
    assert {p.name: mode(p) for p in sub.glob("*.kv")} == {p.name: 0o600 for p in sub.glob("*.kv")}
    assert mode(root / kv_tier_file.KEY_FILE) == 0o600


def test_a_planted_block_with_chosen_kv_and_a_valid_digest_is_refused(deployment) -> None:
    cluster, worker, root, reference, payload_bytes = deployment
    prompt = PROMPTS[3]
    key = prompt_block_hashes(prompt, BS)[0]
    payload = np.full(payload_bytes // 4, 42.0, dtype=np.float32).tobytes()   # the KV the neighbour chose
    body = kv_tier_file.HEADER.pack(kv_tier_file.MAGIC, kv_tier_file.FORMAT_VERSION, 0,
                                    bytes.fromhex(fingerprint_dir(root).name), key, 0, BS, len(payload)) + \
        np.asarray(prompt[:BS], dtype="<i8").tobytes() + payload
    forged = body + hashlib.blake2b(body, digest_size=kv_tier_file.DIGEST_BYTES).digest()
    hits, refused = tier_counts(worker)
    for path in planted_paths(root, prompt):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # private, as the worker's own
        with os.fdopen(fd, "wb") as f:
            f.write(forged)
    tokens, _ = generate(cluster, prompt)
    assert tokens == reference[tuple(prompt)]
    hits_after, refused_after = tier_counts(worker)
    assert hits_after == hits and refused_after > refused, (hits, hits_after, refused, refused_after)


def test_a_symlink_to_a_huge_sparse_file_does_not_grow_the_worker(deployment, tmp_path: Path) -> None:
    cluster, worker, root, reference, _ = deployment
    prompt = PROMPTS[4]
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(SPARSE_BYTES)
    for path in planted_paths(root, prompt):
        path.symlink_to(huge)
    pid = worker.popen.pid
    rss, hwm = vm_kb(pid, "VmRSS"), vm_kb(pid, "VmHWM")
    tokens, _ = generate(cluster, prompt)
    assert tokens == reference[tuple(prompt)]
    grew_kb = vm_kb(pid, "VmHWM") - max(hwm, rss)
    print(f"a link to a {SPARSE_BYTES >> 20} MiB sparse file at a block's name: the worker's peak grew "
          f"{grew_kb >> 10} MiB")
    assert grew_kb < 256 << 10, f"the worker's peak memory grew by {grew_kb >> 10} MiB"
    assert huge.stat().st_size == SPARSE_BYTES   # the target untouched


def test_a_fifo_at_a_known_prefix_name_does_not_hang_the_worker(deployment) -> None:
    """Last here: on a worker that opens it (the old code), the engine thread hangs for good."""
    cluster, worker, root, reference, _ = deployment
    _, usual = generate(cluster, PROMPTS[5])
    prompt = PROMPTS[6]
    fifos = planted_paths(root, prompt)
    for path in fifos:
        os.mkfifo(path, 0o600)
    _, refused = tier_counts(worker)
    try:
        tokens, took = generate(cluster, prompt, timeout=max(30.0, 20 * usual))
        assert tokens == reference[tuple(prompt)]
        print(f"a FIFO at a prefix's block name: the request took {took:.2f}s (usually {usual:.2f}s)")
        assert took < max(10.0, 10 * usual), f"{took:.1f} s, usually {usual:.2f} s"
        assert generate(cluster, PROMPTS[7])[0] == reference[tuple(PROMPTS[7])]   # and it keeps serving
        assert tier_counts(worker)[1] > refused
    finally:
        for path in fifos:   # a reader stuck opening it (the old code) goes on; then it is gone
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            path.unlink(missing_ok=True)
