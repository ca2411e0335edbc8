"""bench/kv_handoff_hosts.py's pure pieces: its flags, the KV and link arithmetic, the ratios, the
rows made from the client's samples and the table. No hosts, no timings."""
from __future__ import annotations

import math

import pytest

from bench import kv_handoff_hosts as kh
from pdserve.engine.presets import get_preset

QWEN3_06B_KV_PER_TOKEN = 28 * 2 * 8 * 128 * 2    # layers x (K, V) x KV heads x head_dim x bf16: 112 KiB


def test_flags_default_to_the_issue_23_run_and_parse_comma_lists() -> None:
    cfg = kh.parse_args([])
    assert cfg.models == ("small", "qwen3-0.6b-kv")
    assert cfg.rates_gbit == (1.0, 10.0) and cfg.tokens == (256, 1200, 4096)
    cfg = kh.parse_args(["--models", "small", "--rates-gbit", "2.5", "--tokens", "16,32", "--repeats", "1",
                         "--warmup", "0", "--compression", "off", "--out", "/tmp/x.json"])
    assert (cfg.models, cfg.rates_gbit, cfg.tokens, cfg.repeats, cfg.warmup) == (("small",), (2.5,), (16, 32), 1, 0)
    assert cfg.compression == "off" and cfg.out == "/tmp/x.json"


@pytest.mark.parametrize("argv", [["--tokens", "0,16"], ["--tokens", "a"], ["--rates-gbit", "0"], ["--repeats", "0"],
                                  ["--models", ""], ["--compression", "zstd"]])
def test_bad_flags_are_usage_errors(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        kh.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_pinning_gives_the_prefill_and_decode_hosts_a_cpu_each(monkeypatch) -> None:
    monkeypatch.setattr(kh.os, "sched_getaffinity", lambda pid: {3, 5, 7})
    argv = ["python", "-m", "pdserve.services.cli", "prefill"]
    assert kh.pinned(argv, 1, pin=False) == argv and kh.pinned(argv, 0, pin=True) == argv   # the router's host floats
    assert kh.pinned(argv, 1, pin=True) == ["taskset", "-c", "3", *argv]
    assert kh.pinned(argv, 2, pin=True) == ["taskset", "-c", "5", *argv]
    assert kh.parse_args(["--pin-hosts"]).pin_hosts and not kh.parse_args([]).pin_hosts
    monkeypatch.setattr(kh.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="pin_hosts"):
        kh.Config(pin_hosts=True)


def test_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="tokens"):
        kh.Config(tokens=(-1,))


def test_kv_bytes_of_the_qwen3_kv_shaped_preset_are_112_kib_a_token() -> None:
    p = get_preset("qwen3-0.6b-kv")
    assert (p.num_hidden_layers, p.num_key_value_heads, p.head_dim, p.dtype) == (28, 8, 128, "bfloat16")
    per_token = kh.kv_bytes(1, p.num_hidden_layers, p.num_key_value_heads, p.head_dim, 2)
    assert per_token == QWEN3_06B_KV_PER_TOKEN == 112 << 10
    assert kh.kv_bytes(4096, 28, 8, 128, 2, block_size=16) == 4096 * per_token


def test_kv_bytes_count_whole_blocks() -> None:
    assert kh.kv_bytes(17, 2, 2, 32, 4, block_size=16) == kh.kv_bytes(32, 2, 2, 32, 4)
    assert kh.kv_bytes(16, 2, 2, 32, 4, block_size=16) == 2 * 2 * 16 * 2 * 32 * 4


def test_link_time_is_bits_over_rate() -> None:
    assert kh.link_ms(125_000_000, 1e9) == pytest.approx(1000.0)
    assert kh.link_ms(125_000_000, 10e9) == pytest.approx(100.0)


def _row(**kw) -> kh.Row:
    base = dict(model="m", rate_gbit=1.0, tokens=256, kv_bytes=12_500_000, kv_bytes_formula=12_500_000,
                exposed_ms=300.0, ttft_ms=900.0, prefill_ms=500.0, socket_ms=120.0)
    return kh.Row(**{**base, **kw})


def test_ratios_divide_the_exposed_hand_off_by_the_link_and_the_socket() -> None:
    r = _row()
    assert r.link_ms == pytest.approx(100.0)
    assert r.over_link == pytest.approx(3.0) and r.over_socket == pytest.approx(2.5)
    d = r.as_dict()
    assert d["exposed_over_link"] == pytest.approx(3.0) and d["link_ms"] == pytest.approx(100.0)
    assert math.isnan(_row(socket_ms=0.0).over_socket)


def _sample(tokens: int, exposed: float, warmup: bool = False, cached: int = 0, nbytes: int = 4096,
            wire: int | None = None) -> dict:
    return {"tokens": tokens, "warmup": warmup, "usage": {"cached_tokens": cached}, "kv_bytes": [nbytes, nbytes],
            "timings": {"kv_transfer_ms": exposed, "ttft_ms": exposed + 10, "prefill_ms": 5.0, "kv_wire_bytes": wire}}


def test_rows_are_medians_of_the_measured_requests_per_size() -> None:
    model = kh.ModelInfo("/m", "m", layers=2, kv_heads=2, head_dim=32, itemsize=4, vocab=1024, max_len=2048)
    samples = [_sample(16, 999.0, warmup=True), _sample(16, 1.0), _sample(16, 3.0), _sample(16, 2.0),
               _sample(16, 0.0), _sample(32, 7.0, nbytes=8192, wire=5000)]
    rows = kh.rows_from(samples, model, 1.0, 16, {4096: 0.5, 8192: 0.9}, "off")
    assert [(r.tokens, r.exposed_ms, r.kv_bytes, r.socket_ms) for r in rows] == [(16, 2.0, 4096, 0.5),
                                                                                (32, 7.0, 8192, 0.9)]
    assert rows[0].kv_bytes_formula == kh.kv_bytes(16, 2, 2, 32, 4) and rows[0].ttft_ms == 12.0
    assert rows[0].samples["kv_transfer_ms"] == [1.0, 3.0, 2.0] and rows[0].compression == "off"
    assert (rows[0].no_handoff, rows[0].wire_bytes, rows[1].no_handoff, rows[1].wire_bytes) == (1, 0, 0, 5000)


def test_a_size_without_any_reported_hand_off_is_an_error() -> None:
    model = kh.ModelInfo("/m", "m", 2, 2, 32, 4, 1024, 2048)
    with pytest.raises(RuntimeError, match="kv_transfer_ms 0"):
        kh.rows_from([_sample(16, 0.0)], model, 1.0, 16, {})


def test_a_prefix_cache_hit_is_refused() -> None:
    model = kh.ModelInfo("/m", "m", 2, 2, 32, 4, 1024, 2048)
    with pytest.raises(RuntimeError, match="prefix cache"):
        kh.rows_from([_sample(16, 1.0, cached=16)], model, 1.0, 16, {})


def test_the_table_has_a_header_and_one_line_a_row() -> None:
    text = kh.table([_row(), _row(tokens=1200, compression="lossless", wire_bytes=3 << 20)])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == len(kh.COLUMNS) + 1
    assert lines[1].count("|") == len(kh.COLUMNS) + 1
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert dict(zip(kh.COLUMNS, cells)) == {
        "model": "m", "Gbit/s": "1", "KV comp.": "-", "tokens": "256", "KV MiB": "11.92", "wire MiB": "-", "link ms": "100.0",
        "raw socket ms": "120.0", "exposed hand-off ms": "300.0", "exposed / link": "3.00",
        "exposed / socket": "2.50", "prefill ms": "500", "TTFT ms": "900"}
    assert "lossless" in lines[3] and "| 1200 |" in lines[3] and "| 3.00 |" in lines[3]
