"""bench/roofline.py's counting, against a hand computation at the tiny preset (2 layers, hidden
64, 4 heads / 2 KV heads of 32, MLP 128, vocab 1024, float32, tied), and its report with given
peaks. No timing is asserted: the measurements are only run at toy sizes to see they report."""
from __future__ import annotations

import json
import math

import pytest

from bench import roofline as rl
from pdserve.engine import model_maker as mm
from pdserve.engine.model_config import ModelConfig


def test_tiny_costs_by_hand(tiny_qwen3: str) -> None:
    c = rl.model_cost(ModelConfig.from_dir(tiny_qwen3))
    # Per layer: q 64x128 + k, v 64x64 each + o 128x64 + gate, up, down 64x128 each = 49,152 weights.
    assert c.linear_flops == 2 * 2 * 49_152 == 196_608
    assert c.lm_head_flops == 2 * 1024 * 64 == 131_072
    assert c.attn_flops_per_key == 4 * 4 * 32 * 2 == 1024          # QK^T and AV, 4 heads of 32, 2 layers
    assert c.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4 == 1024      # K and V, 2 layers, 2 KV heads of 32, fp32
    # Weights: the layers (with their 64 + 64 norm and 32 + 32 q/k-norm weights), the final norm, the
    # tied LM head: every parameter of the tiny model once.
    assert c.weight_bytes == (2 * (49_152 + 192) + 64 + 65_536) * 4 == 657_152
    assert c.prefill_flops(10) == 10 * 196_608 + 131_072 + 1024 * 55 == 2_153_472   # token i attends i keys
    assert c.decode_flops(7) == 196_608 + 131_072 + 7 * 1024
    assert c.decode_step_bytes(3, 5) == 657_152 + 3 * 5 * 1024


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_weight_bytes_are_the_checkpoints_less_an_untied_embedding(tiny_model: str, arch: str) -> None:
    cfg = ModelConfig.from_dir(tiny_model)
    p = mm.get_preset("tiny", cfg.architecture)
    read = [math.prod(s) for name, s, _ in mm.weight_specs(p, cfg.architecture)
            if p.tie_word_embeddings or name != "model.embed_tokens.weight"]
    assert rl.model_cost(cfg).weight_bytes == 4 * sum(read)


def test_workload_by_hand(tiny_qwen3: str) -> None:
    c = rl.model_cost(ModelConfig.from_dir(tiny_qwen3))
    w = rl.Workload(2, (4, 4), (3, 3))
    prefill, decode = rl.workload_flops(c, w)
    assert prefill == 2 * (4 * 196_608 + 131_072 + 1024 * (1 + 2 + 3 + 4))
    # Output token 1 comes from the prefill; tokens 2 and 3 are decode steps attending 5 and 6 keys.
    assert decode == 2 * (2 * (196_608 + 131_072) + 1024 * (5 + 6))
    assert rl.decode_bytes(c, w, batch=2) == 2 * (657_152 + 2 * 5.5 * 1024)   # 4 tokens, 2 steps
    # A range is its uniform mean: in 4:6 has the mean cost of 4, 5 and 6.
    ranged, _ = rl.workload_flops(c, rl.Workload(1, (4, 6), (3, 3)))
    assert ranged == pytest.approx(sum(c.prefill_flops(n) for n in (4, 5, 6)) / 3)
    f = rl.floors(c, w, peak_flops=1e9, bandwidth=1e9, batch=2)
    assert f["compute"] == pytest.approx(6 / ((prefill + decode) / 1e9))
    assert f["decode_memory"] == pytest.approx(6 / (rl.decode_bytes(c, w, 2) / 1e9))
    assert f["roofline"] == pytest.approx(6 / (prefill / 1e9 + max(decode / 1e9, rl.decode_bytes(c, w, 2) / 1e9)))
    # serial: the decode tokens' 2 * (5 + 6) keys read at the bandwidth instead of attended at the peak
    keys = 2 * (5 + 6)
    assert f["serial"] == pytest.approx(6 / ((prefill + decode - keys * 1024) / 1e9 + keys * 1024 / 1e9))
    with pytest.raises(ValueError, match="LO:HI"):
        rl.length_range("9:3")


def test_report_with_given_peaks_and_with_toy_measurements(tiny_qwen3: str, capsys) -> None:
    args = ["--model", tiny_qwen3, "--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--json"]
    assert rl.main(args + ["--peak-gflops", "1", "--bandwidth-gbs", "1", "--measured-tok-s", "0.5"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    c = rl.model_cost(ModelConfig.from_dir(tiny_qwen3))
    assert doc["floors_tok_s"] == rl.floors(c, rl.Workload(2, (4, 4), (3, 3)), 1e9, 1e9, 2) and doc["measured"] == {}
    assert "roofline floor (decode batch 2)" in out and "measured 0.5 is" in out
    assert rl.main(args + ["--gemm-tokens", "16", "--copy-mib", "1", "--reps", "1", "--min-time", "0.01"]) == 0
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["measured"]
    assert len(measured) == 2 and all(v > 0 for figures in measured.values() for v in figures.values())
