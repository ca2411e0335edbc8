"""Tests for engine.model_maker: determinism, HF loadability, tokenizer, output quality."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pdserve.engine import model_maker as mm

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
}


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: mm.make_model(root / arch, "tiny", arch, seed=0) for arch in ("qwen3", "llama")}


def test_presets() -> None:
    small = mm.get_preset("small", "qwen3")
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads) == (512, 8, 8)
    assert (small.num_key_value_heads, small.head_dim, small.intermediate_size) == (4, 64, 1536)
    assert (small.vocab_size, small.dtype, small.tie_word_embeddings) == (8192, "bfloat16", True)
    assert (small.rope_theta, small.rms_norm_eps, small.max_position_embeddings) == (1e6, 1e-6, 4096)
    assert mm.get_preset("small", "llama") == small
    tq, tl = mm.get_preset("tiny", "qwen3"), mm.get_preset("tiny", "llama")
    assert tq.head_dim * tq.num_attention_heads != tq.hidden_size
    assert tq.tie_word_embeddings and not tl.tie_word_embeddings
    assert tl.rope_theta == 10_000.0
    with pytest.raises(ValueError):
        mm.get_preset("huge")
    with pytest.raises(ValueError):
        mm.get_preset("tiny", "gpt2")


def test_files_and_determinism(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    ref = tiny_dirs["qwen3"]
    assert {p.name for p in ref.iterdir()} == EXPECTED_FILES
    same = mm.make_model(tmp_path / "same", "tiny", "qwen3", seed=0)
    assert _digests(same) == _digests(ref)
    other = mm.make_model(tmp_path / "other", "tiny", "qwen3", seed=1)
    d_ref, d_other = _digests(ref), _digests(other)
    assert d_other["model.safetensors"] != d_ref["model.safetensors"]
    assert d_other["tokenizer.json"] == d_ref["tokenizer.json"]  # tokenizer is seed-independent


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hf_loads_without_missing_keys(tiny_dirs: dict[str, Path], arch: str) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tiny_dirs[arch]
    p = mm.get_preset("tiny", arch)
    config = AutoConfig.from_pretrained(d)
    assert config.model_type == arch
    assert (config.head_dim, config.num_key_value_heads) == (p.head_dim, p.num_key_value_heads)
    assert (config.bos_token_id, config.eos_token_id) == (mm.BOS_TOKEN_ID, mm.EOS_TOKEN_ID)
    assert config.rope_parameters["rope_theta"] == p.rope_theta

    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.float32

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {name for name, _, _ in mm.weight_specs(p, arch)}
    assert ("lm_head.weight" in names) == (not p.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    hf_names = set(model.state_dict())
    if p.tie_word_embeddings:
        hf_names.discard("lm_head.weight")
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert names == hf_names


def test_tokenizer_roundtrip(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    assert tok.is_fast
    assert len(tok) == mm.get_preset("tiny").vocab_size
    assert (tok.eos_token, tok.eos_token_id) == (mm.EOS_TOKEN, mm.EOS_TOKEN_ID)
    assert (tok.bos_token, tok.bos_token_id) == (mm.BOS_TOKEN, mm.BOS_TOKEN_ID)
    assert tok.pad_token_id == mm.EOS_TOKEN_ID
    samples = [
        "",
        "Hello, world!",
        "  leading and trailing spaces  ",
        "The lighthouse keeper lit the lamp at 7:45 pm, 12,345 times.",
        "tabs\tand\nnew\r\nlines \n\n",
        "naïve café — ß, 日本語のテキスト, Ελληνικά, עברית, 🙂🚀👩‍👩‍👧",
        "def f(x):\n    return {'a': x ** 2}  # comment",
        "\x00\x7f odd bytes \u200b\ufeff",
        "<|endoftext|> inside text",
    ]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=True)
        assert tok.decode(ids) == s
        if "<|" not in s:
            assert mm.BOS_TOKEN_ID not in ids and mm.EOS_TOKEN_ID not in ids  # no auto BOS/EOS
    # Plain English compresses well, so the BPE actually learned merges.
    text = "The teacher explained the answer to the students after lunch."
    assert len(tok.encode(text)) < len(text) / 2.5
    # The raw tokenizers object matches the HF one.
    assert mm.build_tokenizer(1024).encode(text).ids == tok.encode(text)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_output_is_varied_and_well_separated(tiny_dirs: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_dirs[arch]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    prompts = ["The lighthouse keeper", "Hello, my name is", "def mean(values):", "Warm water makes yeast"]
    gaps: list[float] = []
    distinct: list[int] = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=32,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=mm.EOS_TOKEN_ID,
            )
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert len(new) == 32  # no EOS emitted
        assert mm.BOS_TOKEN_ID not in new
        distinct.append(len(set(new)))
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    assert min(distinct) >= 3 and sum(distinct) / len(distinct) >= 8, distinct
    gap = torch.tensor(gaps)
    assert (gap > 1e-3).float().mean() >= 0.98, gap.sort().values[:10]
    assert gap.median() > 0.1


def test_ensure_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    target = mm.cached_model_dir("tiny")
    assert target.is_relative_to(tmp_path / "home")
    assert not target.exists()
    path = mm.ensure_model("tiny")
    assert path == target
    assert {p.name for p in path.iterdir()} == EXPECTED_FILES
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name]  # temp dir cleaned up
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert mm.ensure_model("tiny") == path  # second call reuses it
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_default_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_HOME", raising=False)
    assert mm.pdserve_home() == Path.home() / ".cache" / "pdserve"
