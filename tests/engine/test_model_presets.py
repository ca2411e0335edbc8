"""The real-size presets (qwen3-0.6b, llama-3.2-1b) and the streamed weights writer: exact shapes
and parameter counts, a model vocabulary larger than the tokenizer's, Llama 3's rope scaling as
HF computes it, and chunked writing that gives save_file's bytes. No 1.2 GB checkpoint is written
here: the big presets are checked by their specs and config, the writing on small shapes."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import pytest
import torch

from pdserve.engine import model_maker as mm
from pdserve.engine.presets import PRESETS, PUBLIC_PRESETS, get_preset, resolve_arch


def _num_params(preset: str) -> int:
    return sum(math.prod(shape) for _, shape, _ in mm.weight_specs(get_preset(preset), resolve_arch(preset)))


def test_real_model_presets_have_their_shapes() -> None:
    q, ll = get_preset("qwen3-0.6b"), get_preset("llama-3.2-1b")
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads) == (1024, 28, 16, 8)
    assert (q.head_dim, q.intermediate_size, q.vocab_size, q.tie_word_embeddings) == (128, 3072, 151_936, True)
    assert (q.rope_theta, q.rms_norm_eps, q.max_position_embeddings, q.dtype) == (1e6, 1e-6, 40_960, "bfloat16")
    assert (ll.hidden_size, ll.num_hidden_layers, ll.num_attention_heads, ll.num_key_value_heads) == (2048, 16, 32, 8)
    assert (ll.head_dim, ll.intermediate_size, ll.vocab_size, ll.tie_word_embeddings) == (64, 8192, 128_256, True)
    assert (ll.rope_theta, ll.rms_norm_eps, ll.max_position_embeddings, ll.dtype) == (5e5, 1e-5, 131_072, "bfloat16")
    assert ll.rope_type == "llama3" and dict(ll.rope_scaling)["factor"] == 32.0
    # The parameter counts HF reports for Qwen/Qwen3-0.6B and meta-llama/Llama-3.2-1B.
    assert (_num_params("qwen3-0.6b"), _num_params("llama-3.2-1b")) == (596_049_920, 1_235_814_400)
    assert q.num_tokenizer_ids == ll.num_tokenizer_ids == 8192


def test_arch_follows_a_real_models_preset() -> None:
    assert [resolve_arch(p) for p in ("qwen3-0.6b", "llama-3.2-1b", "tiny")] == ["qwen3", "llama", "qwen3"]
    assert resolve_arch("tiny", "llama") == "llama"
    with pytest.raises(ValueError, match="arch 'qwen3' does not fit preset 'llama-3.2-1b'"):
        get_preset("llama-3.2-1b", "qwen3")
    assert set(PUBLIC_PRESETS) <= set(PRESETS) and "tiny-kv1" not in PUBLIC_PRESETS
    assert mm.cached_model_dir("llama-3.2-1b").name.startswith("llama-3.2-1b-llama-seed0")


def test_llama3_rope_scaling_as_hf_computes_it(tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pdserve.engine.layers.rotary import inv_frequencies
    from pdserve.engine.model_config import ModelConfig

    mm._write_configs(tmp_path, get_preset("llama-3.2-1b"), "llama")
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.rope_type, cfg.rope_theta, cfg.vocab_size) == ("llama3", 5e5, 128_256)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(tmp_path), "cpu")
    ours = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling)
    assert torch.equal(ours, hf_inv)
    assert not torch.equal(ours, inv_frequencies(cfg.head_dim, cfg.rope_theta, "default", {}))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_chunked_writing_gives_save_files_bytes(preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import save_file

    p, arch = get_preset(preset), "qwen3"
    monkeypatch.setattr(mm, "CHUNK_ELEMENTS", 3 * 16 * p.hidden_size + 16)   # a few rows, a ragged last chunk
    chunked = tmp_path / "chunked.safetensors"
    mm.write_weights(chunked, p, arch, seed=0)
    whole = {name: torch.cat(list(mm.weight_chunks(p, arch, 0, name, shape, std)))
             for name, shape, std in mm.weight_specs(p, arch)}
    big = [(n, s) for n, s, std in mm.weight_specs(p, arch) if std and s[0] > 48]
    assert big and all(len(list(mm._draw_rows(n, s, 1.0, 0))) > 1 for n, s in big)   # drawn in chunks
    save_file(whole, str(tmp_path / "whole.safetensors"), metadata={"format": "pt"})
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.iterdir()}
    assert digests["chunked.safetensors"] == digests["whole.safetensors"]
    monkeypatch.setattr(mm, "CHUNK_ELEMENTS", 1 << 30)   # one draw per tensor: the same values
    mm.write_weights(tmp_path / "one.safetensors", p, arch, seed=0)
    assert (tmp_path / "one.safetensors").read_bytes() == chunked.read_bytes()


def test_a_vocabulary_past_the_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real-size presets' situation at the tiny shape: 4096 model ids, 1024 tokenizer ids. HF
    loads it; greedy and sampled ids stay below 1024 (those rows are shrunk as EOS's are), so
    every token has text; prompts of ids past the tokenizer run in pdserve's offline LLM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    monkeypatch.setitem(PRESETS, "tiny-wide", dataclasses.replace(PRESETS["tiny"], vocab_size=4096,
                                                                  tokenizer_vocab_size=1024))
    d = mm.make_model(tmp_path / "m", "tiny-wide", seed=0)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    assert len(tok) == 1024 and model.config.vocab_size == 4096
    ids = tok("The lighthouse keeper", return_tensors="pt").input_ids
    with torch.no_grad():
        hf_out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=mm.EOS_TOKEN_ID)[0, ids.shape[1]:]
    assert 0 < int(hf_out.max()) < 1024
    llm = LLM(str(d), device="cpu")
    try:
        greedy, past, sampled = llm.generate(
            [ids[0].tolist(), [5, 1024, 3000, 4095, 7], "Hello"],
            [SamplingParams(max_tokens=16, temperature=0.0), SamplingParams(max_tokens=16, temperature=0.0),
             SamplingParams(max_tokens=16, temperature=1.0, seed=1)])
    finally:
        llm.close()
    assert greedy.token_ids == hf_out.tolist()
    for out in (greedy, past, sampled):
        assert len(out.token_ids) == 16 and max(out.token_ids) < 1024 and out.text


def test_greedy_equals_hf_at_qwen3_0_6b_width(tmp_path: Path) -> None:
    """pdserve's offline engine gives HF transformers' greedy tokens (float32) at Qwen3-0.6B's
    exact width: hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocabulary 151,936 (the
    LM head and sampling over every logit). Two of its 28 layers: the layers are identical in
    shape, so the other 26 would add 14 times the layer work and no shape (12 s as it is)."""
    from pdserve.engine import LLM, SamplingParams
    from tests.conftest import hf_greedy, random_prompts

    path = str(mm.make_model(tmp_path / "qwen3-0.6b-2l", preset="qwen3-0.6b-2l"))
    prompts = random_prompts(3, 5, 40, vocab=8192, seed=606)
    want = hf_greedy(path, prompts, 8)
    llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=64)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == want
