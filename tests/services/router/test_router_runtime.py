"""The router's runtime under hostile or heavy load: incremental detokenization that stays linear
(and exact) whatever tokens come, bounded admission bookkeeping, queued requests that are not
mistaken for stalled ones, and logs that cannot be forged or redirected."""
from __future__ import annotations

import asyncio
import os
import random
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.services.api.detokenizer import IncrementalDetokenizer
from pdserve.services.client import Client
from pdserve.services.common.grpc_setup import SERVER_OPTIONS, options as channel_options
from pdserve.services.common.log_format import escape_controls
from pdserve.services.deployment.launcher import Process, open_log
from pdserve.services.router.admission import AdmissionQueue
from tests.serving import metric, scrape, start_cluster, wait_for

TEXTS = ["naïve café — 日本語 🙂 Ünïcödé ✓", "hello world, once upon a time", "Ω≈ç√∫˜µ≤≥÷ 𝕳𝖊𝖑𝖑𝖔 한국어 ありがとう"]


class CountingTokenizer:
    """The real tokenizer, counting the tokens handed to decode (the detokenizer's work)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def _random_text(rng: random.Random, n: int) -> str:
    """n characters from anywhere in Unicode but the surrogates: many multi-byte, split across tokens."""
    return "".join(chr(rng.choice([rng.randrange(0x80, 0xD800), rng.randrange(0xE000, 0x20000)])) for _ in range(n))


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str:
    """ids fed in chunks of 1-3 tokens (as decode steps deliver them); the concatenated deltas."""
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        out.append(detok.add(ids[i:i + k], final=i + k >= len(ids)))
        i += k
    return "".join(out)


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's decoder: byte tokens <0xXX> through ByteFallback)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁the", "▁cat", "a", "▁sat", "é", "日", "▁日本"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


# ---- detokenization ------------------------------------------------------------------------
def test_detokenizer_text_is_the_full_decode_of_random_streams(tiny_qwen3: str) -> None:
    """Random streams of text tokens (multi-byte characters split across tokens), arbitrary ids
    (invalid byte sequences), and special tokens: the deltas add up to decode(all), both with and
    without skip_special_tokens, and no delta but the last ends in an incomplete character."""
    tok = load_tokenizer(tiny_qwen3)
    rng = random.Random(0)
    specials = tok.all_special_ids
    for _ in range(200):
        ids: list[int] = []
        for _ in range(rng.randint(1, 10)):
            kind = rng.random()
            if kind < 0.3:
                ids += tok.encode(rng.choice(TEXTS))[:rng.randint(1, 30)]
            elif kind < 0.5:
                ids += [rng.randrange(len(tok)) for _ in range(rng.randint(1, 10))]
            elif kind < 0.65:
                ids += [rng.choice(specials) for _ in range(rng.randint(1, 6))]
            else:
                ids += tok.encode(_random_text(rng, 5))
        for skip in (True, False):
            assert _stream(IncrementalDetokenizer(tok, skip), ids, rng) == tok.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_byte_fallback_decoder_gives_valid_utf8_exactly() -> None:
    """A ByteFallback decoder renders a run of byte tokens as one unit: valid UTF-8 split into byte
    tokens, with skipped special tokens in between, still comes out as decode(all)."""
    tok = _byte_fallback_tokenizer()
    rng = random.Random(1)
    alphabet = "the cat sat 日本語 é 🙂 ä ü Ж"
    for _ in range(200):
        ids = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))), add_special_tokens=False)
        ids = [t for i in ids for t in ([i, 2] if rng.random() < 0.1 else [i])]
        assert _stream(IncrementalDetokenizer(tok), ids, rng) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("case", ["skipped special tokens", "invalid bytes", "byte-fallback invalid bytes"])
def test_detokenizer_work_per_token_is_bounded(tiny_qwen3: str, case: str) -> None:
    """Tokens that add no visible text (skipped specials, invalid byte sequences: what a request
    with ignore_eos or min_tokens may emit for as long as it likes) cost a bounded decode per
    token, not a decode of their whole tail: the work for 4,000 of them stays under a small
    multiple of 4,000 tokens, and the text is still the full decode."""
    if case.startswith("byte-fallback"):
        tok, token, bound = _byte_fallback_tokenizer(), 3 + 0x80, 80
    else:
        tok = load_tokenizer(tiny_qwen3)
        token = tok.eos_token_id if case.startswith("skipped") else next(
            t for t in range(len(tok)) if tok.decode([t]) == "\ufffd")
        bound = 16
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    prefix = tok.encode("once upon a time", add_special_tokens=False)
    n = 4000
    ids = [*prefix, *[token] * n]
    text = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert counting.decoded <= bound * len(ids), f"{counting.decoded} tokens decoded for {len(ids)}"
    if not case.startswith("byte-fallback"):   # (a ByteFallback run is cut past its bound: see detokenizer.py)
        assert text == tok.decode(ids, skip_special_tokens=True)


# ---- admission bookkeeping -------------------------------------------------------------------
def test_admission_record_stays_bounded_over_many_requests() -> None:
    """The admission times kept for the retry hint's rate cover one window, whatever the number of
    requests admitted and whether any is ever refused."""
    async def run() -> AdmissionQueue:
        queue = AdmissionQueue(max_waiting=4, rate_window_s=0.05)
        for _ in range(300):
            async with queue.turn(timeout=5):
                pass
            await asyncio.sleep(0.002)   # kept: arrivals spread over many rate windows (what is tested)
        return queue

    queue = asyncio.run(run())
    # 300 admissions at least 2 ms apart span >= 0.6 s: a 0.05 s window holds at most ~26 of them
    assert len(queue._admitted) <= 40, len(queue._admitted)


# ---- logs ------------------------------------------------------------------------------------
def test_logged_request_ids_cannot_forge_lines() -> None:
    """A request id with a line break, a terminal escape and a bidi override, logged by a process
    configured as every pdserve process is, stays on its one line with its controls escaped."""
    rid = "req\n2026-01-01 00:00:00 services.api.grpc_router ERROR forged\x1b[2J\u202e\r"
    code = ("import logging, sys\n"
            "from pdserve.services.cli.usage_errors import configure_logging\n"
            "configure_logging('INFO')\n"
            "logging.getLogger('pdserve.services.router.migration').warning('request %s migrates (1/3) after %s', sys.argv[1], "
            "'fault')\n")
    out = subprocess.run([sys.executable, "-c", code, rid], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[3])
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "forged" in lines[0], out.stderr
    assert not any(c in out.stderr for c in "\x1b\r\u202e"), repr(out.stderr)
    assert escape_controls(rid) in lines[0]


def test_log_file_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    """A child's log that someone replaced by a symbolic link (or a FIFO) is refused: the process
    does not start, the link's target is untouched; a real log file is created private."""
    target = tmp_path / "victim"
    target.write_text("precious\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "decode-0.log").symlink_to(target)
    os.mkfifo(logs / "prefill-0.log")
    for name in ("decode-0", "prefill-0"):
        proc = Process(name, [sys.executable, "-c", "print('written')"], "127.0.0.1:1", dict(os.environ),
                       log_path=str(logs / f"{name}.log"))
        with pytest.raises(OSError, match=f"log file .*{name}.log"):
            proc.start()
        assert proc.popen is None
    assert target.read_text() == "precious\n"
    ok = Process("router", [sys.executable, "-c", "print('written')"], "127.0.0.1:1", dict(os.environ),
                 log_path=str(logs / "router.log"))
    ok.start()
    assert ok.popen.wait(60) == 0
    assert "written" in (logs / "router.log").read_text()
    assert stat.S_IMODE((logs / "router.log").stat().st_mode) == 0o600
    with open_log(str(logs / "router.log")) as f:   # appends
        f.write(b"again\n")
    assert (logs / "router.log").read_text().endswith("written\nagain\n")


# ---- a queue is not a stall --------------------------------------------------------------------
STALL_S = 1.0
AHEAD_MAX_TOKENS = 1900   # the tiny model's max_model_len is 2048


@pytest.fixture(scope="module")
def one_slot(tiny_qwen3: str):
    """A colocated worker that runs one sequence at a time, behind a router with a short stall watchdog."""
    cluster = start_cluster(tiny_qwen3, colocated_workers=1,
                            engine_args=["--block-size", "8", "--num-kv-blocks", "512", "--dtype", "float32",
                                         "--max-num-seqs", "1"],
                            router_args=["--stall-timeout-s", str(STALL_S), "--migration-limit", "3"])
    try:
        yield cluster
    finally:
        cluster.stop()


def test_request_queued_longer_than_the_stall_timeout_is_not_migrated(one_slot) -> None:
    """Behind a long request on a one-sequence worker, a request waits for its first token far
    longer than the stall watchdog's timeout; the worker's heartbeats while it is queued keep it
    where it is: it is served once, without a migration (no thrash under overload)."""
    address = one_slot.router_address
    with Client(address, timeout=120) as client:
        # calibration: the decode pace alone (first token to last), so that the long request holds
        # the slot for about 5 stall timeouts; the assertion below asks for 2
        calibration = client.generate_stream([1, 2, 3], max_tokens=65, ignore_eos=True, temperature=0.0)
        next(calibration)
        t0 = time.monotonic()
        list(calibration)
        per_token = (time.monotonic() - t0) / 64
        # requests ahead holding the slot for about 5 stall timeouts, each under max_model_len
        # (a fast CPU decodes one request's 1,900 tokens in less than 2 stall timeouts)
        total = 64 + int(5 * STALL_S / per_token)
        lengths = [min(AHEAD_MAX_TOKENS, total - start) for start in range(0, total, AHEAD_MAX_TOKENS)]
        finals: list = [None] * len(lengths)
        holding = threading.Event()

        def run_ahead(i: int, max_tokens: int) -> None:
            for msg in client.generate_stream([5 + i, 6, 7, 8], max_tokens=max_tokens, ignore_eos=True,
                                              temperature=0.0):
                holding.set()
                finals[i] = msg

        ahead = [threading.Thread(target=run_ahead, args=(i, n), daemon=True) for i, n in enumerate(lengths)]
        ahead[0].start()
        assert holding.wait(60)   # the first one holds the only slot now
        for thread in ahead[1:]:
            thread.start()
        router_metrics = next(p.metrics_address for p in one_slot.processes if p.name == "router")
        wait_for(lambda: metric(scrape(router_metrics), "pdserve:num_requests_running") >= len(ahead), 60,
                 "the requests ahead in flight at the router", interval=0.05)   # the others queue first
        t0 = time.monotonic()
        queued = client.generate([9, 10, 11], max_tokens=4, ignore_eos=True, temperature=0.0)
        waited = time.monotonic() - t0
        for thread in ahead:
            thread.join(120)
    assert all(f is not None and f.finished and f.timings.migrations == 0 for f in finals), finals
    assert waited > 2 * STALL_S, f"the queued request waited only {waited:.2f}s: the test did not queue it"
    assert queued.finish_reason == "length" and len(queued.token_ids) == 4
    assert queued.timings["migrations"] == 0


# ---- a silent stream is not a ping flood ---------------------------------------------------
def test_a_stream_silent_for_several_keepalive_intervals_stays_open() -> None:
    """A request waiting for a restarting worker is silent for seconds while its channel sends a
    keepalive ping every 2 s: pdserve's servers take those (the ping-flood guard strikes only pings
    closer than a second), so the stream lives on to its own deadline instead of dying 'Too many
    pings' after three of them."""
    async def run() -> tuple[str, float]:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as ch:
                t0 = time.monotonic()
                try:   # Watch sends the status once, then nothing while it does not change
                    async for _ in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=9):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name, time.monotonic() - t0
                return "OK", time.monotonic() - t0
        finally:
            await server.stop(0)

    code, lasted = asyncio.run(run())
    assert code == "DEADLINE_EXCEEDED" and lasted > 8, (code, lasted)
