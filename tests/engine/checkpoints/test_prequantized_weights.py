"""Pre-quantized W8A16 checkpoints (int8 ``<linear>.weight`` + ``<linear>.weight_scale``, config
quant_method pdserve_w8a16) loaded by engine/loader.py: each linear takes the stored int8 rows
(packed q/k/v and gate/up, tensor-parallel row and column slices), no float weight is ever held
for them, and checkpoints that do not add up are refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, loader
from pdserve.engine.layers.linear import Linear
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import TPLayout, split_range
from tests.engine.checkpoints.gguf_files import Files

SCALE = "_scale"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("prequantized"))


def _model(model_dir: Path, group=None):
    cfg = ModelConfig.from_dir(model_dir)
    return MODEL_CLASSES[cfg.architecture](cfg, group), cfg


def _edited(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of checkpoint src with its tensors and/or config.json changed."""
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(str(src / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((src / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_int8_linears_drop_their_float_weights_before_any_is_read(tiny_model: str, files: Files) -> None:
    w8 = files.converted(tiny_model, "Q8_0", w8a16=True)
    model, cfg = _model(w8)
    held = loader.hold_int8_linears(model, w8)
    assert len(held) == 2 * 4 * cfg.num_layers   # qkv, o, gate_up, down: weight and scale each
    float_2d = {n for n, p in model.named_parameters() if p.dim() == 2}
    assert float_2d == {"model.embed_tokens.weight"} | (set() if cfg.tie_word_embeddings else {"lm_head.weight"})
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int8 and qkv.qweight.shape == (qkv.out_features, qkv.in_features)
    loader.load_weights(model, w8)   # (holding again is a no-op)
    stored = load_file(str(w8 / "model.safetensors"))
    names = [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up")]
    gate_up = model.model.layers[1].mlp.gate_up_proj
    assert torch.equal(gate_up.qweight, torch.cat([stored[n] for n in names]))
    assert torch.equal(gate_up.scale, torch.cat([stored[n + SCALE] for n in names]))


def test_tensor_parallel_ranks_take_their_int8_rows_and_columns(tiny_model: str, files: Files) -> None:
    w8 = files.converted(tiny_model, "Q8_0", w8a16=True)
    stored = load_file(str(w8 / "model.safetensors"))
    cfg = ModelConfig.from_dir(w8)
    d = cfg.head_dim
    for rank in (0, 1):
        model, _ = _model(w8, SimpleNamespace(rank=rank, size=2))
        loader.load_weights(model, w8)
        layout = TPLayout(rank, 2, cfg.num_heads, cfg.num_kv_heads)
        (h0, h1), (k0, k1) = layout.head_range, layout.kv_head_range
        layer = model.model.layers[1]
        attn = {p: f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"}
        rows = {"q": (h0 * d, h1 * d), "k": (k0 * d, k1 * d), "v": (k0 * d, k1 * d)}
        qkv = layer.self_attn.qkv_proj   # column-parallel: its rows of each shard, with their scales
        assert qkv.weight is None
        assert torch.equal(qkv.qweight, torch.cat([stored[attn[p]][a:b] for p, (a, b) in rows.items()]))
        assert torch.equal(qkv.scale, torch.cat([stored[attn[p] + SCALE][a:b] for p, (a, b) in rows.items()]))
        o = layer.self_attn.o_proj       # row-parallel: its columns, every row's whole scale
        assert torch.equal(o.qweight, stored[attn["o"]][:, h0 * d:h1 * d])
        assert torch.equal(o.scale, stored[attn["o"] + SCALE])
        start, end = split_range(cfg.intermediate_size, rank, 2)
        down = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(layer.mlp.down_proj.qweight, stored[down][:, start:end])
        assert torch.equal(layer.mlp.down_proj.scale, stored[down + SCALE])
        gate_up = layer.mlp.gate_up_proj
        assert torch.equal(gate_up.qweight[:end - start], stored["model.layers.1.mlp.gate_proj.weight"][start:end])


def test_a_float_shard_beside_int8_ones_is_quantized_by_its_rows(tiny_qwen3: str, files: Files,
                                                                 tmp_path: Path) -> None:
    w8 = files.converted(tiny_qwen3, "Q8_0", w8a16=True)
    v = "model.layers.0.self_attn.v_proj.weight"
    stored = load_file(str(w8 / "model.safetensors"))
    v_float = torch.randn(stored[v].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def v_as_bf16(tensors: dict) -> None:
        tensors[v] = v_float
        del tensors[v + SCALE]
    mixed = _edited(w8, tmp_path / "mixed", edit_tensors=v_as_bf16)
    model, cfg = _model(mixed)
    loader.load_weights(model, mixed)
    qkv = model.model.layers[0].self_attn.qkv_proj
    q_k = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(qkv.qweight[q_k - stored[k].shape[0]:q_k], stored[k])
    w = v_float.float()
    scale = w.abs().amax(dim=1) / 127.0
    assert torch.equal(qkv.scale[q_k:], scale)
    assert torch.equal(qkv.qweight[q_k:], torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))


def test_checkpoints_that_do_not_add_up_are_refused(tiny_qwen3: str, files: Files, tmp_path: Path) -> None:
    w8 = files.converted(tiny_qwen3, "Q8_0", w8a16=True)
    o = "model.layers.1.self_attn.o_proj.weight"
    no_scale = _edited(w8, tmp_path / "no-scale", edit_tensors=lambda t: t.pop(o + SCALE))
    with pytest.raises(ValueError, match="do not pair up: " + o):
        loader.load_weights(_model(no_scale)[0], no_scale)
    undeclared = _edited(w8, tmp_path / "undeclared", edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="holds int8 weights but its config.json does not declare"):
        loader.load_weights(_model(undeclared)[0], undeclared)
    gptq = _edited(files.converted(tiny_qwen3, "Q8_0"), tmp_path / "gptq",
                   edit_config=lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(ValueError, match="quantized with 'gptq', which pdserve does not load"):
        LLM(str(gptq), dtype="float32", num_kv_blocks=16)
    lin = Linear(32, 8)
    with pytest.raises(ValueError, match="not set up for it"):
        lin.load("weight", torch.zeros(8, 32, dtype=torch.int8), None)
    lin.hold_int8()
    with pytest.raises(ValueError, match="shape mismatch for weight_scale"):
        lin.load("weight_scale", torch.ones(9), None)
