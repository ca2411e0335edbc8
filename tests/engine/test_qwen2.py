"""Qwen2 (HF ``Qwen2ForCausalLM``): Llama's shape with a bias on q/k/v and none on o_proj, and no
``attention_bias`` key in its config. The tiny checkpoint has random non-zero q/k/v biases (each
changes most greedy tokens), and the engine's float32 greedy equals HF transformers'.

The arch-parametrized parity tests of test_engine_correctness and test_cpu_kernels run here again
on the qwen2 checkpoint: this module's ``tiny_model`` overrides the suite's (whose params stay
qwen3 and llama: bench/roofline's weight bytes leave biases out)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader import load_weights
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_maker import make_model
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import TPLayout
from tests.conftest import assert_no_leak, hf_greedy, random_prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(6, 3, 60, seed=21)
ATTN = "model.layers.0.self_attn."


def _tiny(model_root: Path, preset: str) -> str:
    path = model_root / f"{preset}-qwen2"
    if not path.exists():
        make_model(path, preset=preset, arch="qwen2", seed=0)
    return str(path)


@pytest.fixture(scope="module")
def tiny_qwen2(model_root: Path) -> str:
    """The tiny Qwen2 checkpoint (tied embeddings, rope theta 1e6); the arch-parametrized parity
    tests (tests/conftest.py ARCHS) run on it too."""
    return _tiny(model_root, "tiny")


def test_checkpoint_has_qkv_bias_and_no_o_proj_bias(tiny_qwen2: str) -> None:
    from transformers import AutoModelForCausalLM

    weights = load_file(str(Path(tiny_qwen2) / "model.safetensors"))
    assert ATTN + "o_proj.bias" not in weights and not any("norm" in n for n in weights if "self_attn" in n)
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = weights[ATTN + proj + ".bias"]
        assert bias.abs().min() > 0 and bias.std() > 0.1, proj
    config = (Path(tiny_qwen2) / "config.json").read_text()
    assert '"attention_bias"' not in config and '"model_type": "qwen2"' in config

    hf, info = AutoModelForCausalLM.from_pretrained(tiny_qwen2, output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.model.layers[0].self_attn.o_proj.bias is None
    assert torch.equal(hf.model.layers[0].self_attn.k_proj.bias, weights[ATTN + "k_proj.bias"])


def test_config_and_engine_model_carry_the_biases(tiny_qwen2: str) -> None:
    cfg = ModelConfig.from_dir(tiny_qwen2)
    assert (cfg.architecture, cfg.qkv_bias, cfg.attention_bias, cfg.qk_norm) == ("qwen2", True, False, False)
    assert cfg.tie_word_embeddings
    model = MODEL_CLASSES[cfg.architecture](cfg, None)
    load_weights(model, tiny_qwen2)
    weights = load_file(str(Path(tiny_qwen2) / "model.safetensors"))
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.bias is None and attn.q_norm is None
    want = torch.cat([weights[ATTN + p + ".bias"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.bias.data, want)


def test_tensor_parallel_ranks_hold_their_bias_rows(model_root: Path) -> None:
    """One KV head over 2 ranks: each rank's q bias is its half, its k/v bias the replicated head."""
    model_dir = _tiny(model_root, "tiny-kv1")
    cfg = ModelConfig.from_dir(model_dir)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    d = cfg.head_dim
    for rank in (0, 1):
        model = MODEL_CLASSES[cfg.architecture](cfg, SimpleNamespace(rank=rank, size=2))
        load_weights(model, model_dir)
        layout = TPLayout(rank, 2, cfg.num_heads, cfg.num_kv_heads)
        (h0, h1), (k0, k1) = layout.head_range, layout.kv_head_range
        attn = model.model.layers[0].self_attn
        want = torch.cat([weights[ATTN + "q_proj.bias"][h0 * d:h1 * d], weights[ATTN + "k_proj.bias"][k0 * d:k1 * d],
                          weights[ATTN + "v_proj.bias"][k0 * d:k1 * d]])
        assert torch.equal(attn.qkv_proj.bias.data, want)
        assert attn.o_proj.bias is None


@pytest.mark.parametrize("cfg,qkv_bias,o_bias", [
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, True, False),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 32768,
      "max_window_layers": 21}, True, False),   # Qwen2.5's: the window off
    ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, True, True),
    ({"architectures": ["LlamaForCausalLM"]}, False, False),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": False}, False, False),
])
def test_model_config_bias_flags(cfg: dict, qkv_bias: bool, o_bias: bool) -> None:
    shape = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64}
    got = ModelConfig.from_dict({**shape, **cfg})
    assert (got.qkv_bias, got.attention_bias) == (qkv_bias, o_bias)


@pytest.mark.parametrize("sliding", [{"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
                                     {"layer_types": ["full_attention", "sliding_attention"]}])
def test_model_config_refuses_sliding_window_layers(sliding: dict) -> None:
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 64, **sliding}
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_dict(cfg)


def test_tp2_matches_hf(model_root: Path) -> None:
    """TP=2 in rank processes (tiny-kv1: the k/v bias rows replicated on both ranks)."""
    model_dir = _tiny(model_root, "tiny-kv1")
    want = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    threads = torch.get_num_threads()   # a TP driver runs on one torch thread (process-wide)
    try:
        with LLM(model_dir, dtype="float32", block_size=8, num_kv_blocks=128, tensor_parallel_size=2) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
            assert_no_leak(llm)
    finally:
        torch.set_num_threads(threads)
