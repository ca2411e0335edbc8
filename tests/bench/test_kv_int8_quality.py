"""bench/kv_int8_quality.py's converter on a tiny random llama2.c checkpoint written here: transformers'
logits on the converted checkpoint equal the reference forward over the .bin's own layout."""
from __future__ import annotations

import numpy as np
import pytest

from bench import kv_int8_quality as q


def _random_checkpoint(path, shared: bool, seed: int = 0) -> q.L2CConfig:
    cfg = q.L2CConfig(dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, seq_len=32,
                      shared_classifier=shared)
    rng = np.random.default_rng(seed)
    w = {name: rng.normal(0, 0.5, shape).astype(np.float32) for name, shape in cfg.shapes()}
    for norm in ("rms_att", "rms_ffn", "rms_final"):
        w[norm] = (1 + 0.1 * rng.normal(size=w[norm].shape)).astype(np.float32)
    w["freq_cis_real"], w["freq_cis_imag"] = q.rope_tables(cfg.seq_len, cfg.head_size)
    q.write_llama2c(path, cfg, w)
    return cfg


@pytest.mark.parametrize("shared", [True, False], ids=["shared-classifier", "own-classifier"])
def test_converted_checkpoint_matches_the_reference_forward(tmp_path, shared: bool) -> None:
    cfg = _random_checkpoint(tmp_path / "m.bin", shared)
    read_cfg, w = q.read_llama2c(tmp_path / "m.bin")
    assert read_cfg == cfg
    model_dir = q.convert(tmp_path / "m.bin", tmp_path / "hf")
    ids = [1, 5, 39, 7, 7, 12, 3, 30, 2, 17, 8, 0, 25, 11, 9, 33, 4, 21, 6, 1]
    ref = q.reference_logits(cfg, w, ids)
    hf = q.transformers_logits(model_dir, ids)
    assert hf.shape == ref.shape == (len(ids), cfg.vocab_size)
    assert np.abs(ref).max() > 1.0                      # the logits are not trivially small
    assert np.abs(hf - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_without_the_rope_permutation_the_logits_differ(tmp_path) -> None:
    """The wq/wk permutation is what makes HF's rotate-half RoPE equal llama2.c's interleaved pairs."""
    cfg = _random_checkpoint(tmp_path / "m.bin", True, seed=1)
    _, w = q.read_llama2c(tmp_path / "m.bin")
    sd = q.hf_state_dict(cfg, w)
    assert not np.array_equal(sd["model.layers.0.self_attn.q_proj.weight"], w["wq"][0])
    assert sorted(sd["model.layers.0.self_attn.k_proj.weight"].ravel().tolist()) == \
        sorted(w["wk"][0].ravel().tolist())           # a permutation of rows' entries, nothing lost


def test_a_truncated_or_inconsistent_file_is_refused(tmp_path) -> None:
    _random_checkpoint(tmp_path / "m.bin", True)
    raw = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match="weight bytes"):
        q.read_llama2c(tmp_path / "short.bin")
    (tmp_path / "tiny.bin").write_bytes(raw[:12])
    with pytest.raises(ValueError, match="header"):
        q.read_llama2c(tmp_path / "tiny.bin")
