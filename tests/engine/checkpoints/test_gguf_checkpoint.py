"""GGUF files turned into checkpoints (engine/checkpoints/gguf_checkpoint.py), checked against
Hugging Face transformers reading the very same files: the tiny random-weight models written as
llama.cpp writes GGUF (tests/engine/checkpoints/gguf_files.py), in Q8_0 and Q4_1, llama (q/k
permuted) and qwen3 (tied embeddings, q/k norms)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoints.gguf_checkpoint import W8A16_SCALE_SUFFIX, GGUFError, convert
from pdserve.engine.layers.linear import Linear
from pdserve.engine.tokenizer import load_tokenizer
from tests.conftest import random_prompts
from tests.engine.checkpoints.gguf_files import Files

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(4, 3, 30, seed=11)
KW = dict(dtype="float32", compute_dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=256,
          max_num_seqs=8)
TEXTS = ["Hello world", "The year 2024 had 366 days.", "a  9 and  12 apples", "naïve café — 日本語 🙂",
         " leading  spaces\n\n\ttabs", "<|endoftext|>x<|bos|>"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("gguf"))


def hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def last_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """The logits of each prompt's last position (float32), as the engine computes them."""
    model = llm.engine.runner.model
    captured: list[torch.Tensor] = []
    real = model.compute_logits
    model.compute_logits = lambda h: captured.append(real(h).float()) or captured[-1]
    try:
        for p in prompts:   # one at a time: each row is its own prompt's
            llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    finally:
        model.compute_logits = real
    return torch.cat(captured)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_converted_gguf_runs_as_transformers_reads_it(tiny_model: str, files: Files, qtype: str) -> None:
    """The converted tensors are exactly bf16 of transformers' dequantization of the same file (q/k
    unpermuted alike), and the engine's greedy tokens equal transformers' with those bf16 weights."""
    hf, dequantized = files.hf(tiny_model, qtype)
    out = files.converted(tiny_model, qtype)
    converted = load_file(str(out / "model.safetensors"))
    tied = json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert set(converted) == {k for k in dequantized if not (tied and k == "lm_head.weight")}
    for name, tensor in converted.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, dequantized[name].to(torch.bfloat16)), name
    assert not torch.equal(dequantized["model.layers.0.mlp.up_proj.weight"],
                           load_file(str(Path(tiny_model) / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"])
    with torch.no_grad():
        for param in hf.parameters():   # the converted checkpoint stores bf16
            param.copy_(param.to(torch.bfloat16).float())
    try:
        want = hf_greedy(hf, PROMPTS)
    finally:
        hf.load_state_dict(dequantized)
    outs = LLM(str(out), **KW).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want


def test_tokenizer_and_chat_template_survive(tiny_model: str, files: Files) -> None:
    out = files.converted(tiny_model, "Q4_1")
    mine, theirs = load_tokenizer(str(out)), load_tokenizer(tiny_model)
    for text in TEXTS:
        assert mine.encode(text) == theirs.encode(text), text
        assert mine.decode(mine.encode(text)) == text
    assert mine.bos_token == theirs.bos_token and mine.eos_token == theirs.eos_token
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "Und 3 + 3?"}]
    assert mine.chat_template == theirs.chat_template
    assert (mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_q8_0_as_int8_weights(tiny_model: str, files: Files) -> None:
    """A Q8_0 file converted with w8a16: the engine holds its linears' int8 values as stored (no float
    weight beside them) and computes exactly the model those int8 values and scales make; it stays
    as close to the bf16 conversion as that conversion quantized at load (quantization="w8a16").

    Not equal to the latter by construction: the stored per-row scale is the row's largest Q8_0
    block scale d (each block's values requantized to it), while quantizing at load takes
    bf16(d_b * q_b)'s row maximum / 127, a bf16-rounded value. Both move each weight by at most half
    a step of its row's int8 scale (checked below for the stored values), so their logits are about
    equally far from the bf16 conversion's: the stored path must be no more than twice as far."""
    w8_dir, bf16_dir = files.converted(tiny_model, "Q8_0", w8a16=True), files.converted(tiny_model, "Q8_0")
    cfg = json.loads((w8_dir / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "pdserve_w8a16"
    stored = load_file(str(w8_dir / "model.safetensors"))
    bf16 = load_file(str(bf16_dir / "model.safetensors"))
    int8 = [n for n, t in stored.items() if t.dtype == torch.int8]
    assert len(int8) == 7 * cfg["num_hidden_layers"] and all(n.endswith("proj.weight") for n in int8)
    for name in int8:   # each value within half a step of its row's scale (plus bf16's rounding)
        scale = stored[name + W8A16_SCALE_SUFFIX]
        w = bf16[name].float()
        err = (stored[name].float() * scale[:, None] - w).abs()
        assert bool((err <= scale[:, None] / 2 + w.abs() * 2 ** -8 + 1e-12).all()), name

    llm = LLM(str(w8_dir), **KW)
    assert llm.engine.runner.quantization == "w8a16" and llm.config.quantization is None
    model = llm.engine.runner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m is not model.lm_head}
    assert len(linears) == 4 * cfg["num_hidden_layers"]
    for name, lin in linears.items():   # int8 only: one byte a weight, no float copy of it
        assert lin.weight is None and lin.qweight.dtype == torch.int8, name
        assert lin.qweight.shape == (lin.out_features, lin.in_features) and lin.scale.shape == (lin.out_features,)
        assert all(p.dim() == 1 for p in lin.parameters()), name   # at most a bias
    layer = "model.layers.0"
    qkv = model.model.layers[0].self_attn.qkv_proj
    parts = [f"{layer}.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(qkv.qweight, torch.cat([stored[p] for p in parts]))
    assert torch.equal(qkv.scale, torch.cat([stored[p + W8A16_SCALE_SUFFIX] for p in parts]))
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.qweight, stored[f"{layer}.mlp.down_proj.weight"])

    prompts = random_prompts(5, 4, 40, seed=12)
    got = last_logits(llm, prompts)
    # exactly the model of int8 x scale in float32: transformers with those weights, to float32 rounding
    hf, dequantized = files.hf(tiny_model, "Q8_0")
    state = {k: (stored[k].float() * stored[k + W8A16_SCALE_SUFFIX][:, None]) if k in int8
             else stored[k].float() for k in stored if not k.endswith(W8A16_SCALE_SUFFIX)}
    hf.load_state_dict(state, strict=False)
    try:
        with torch.inference_mode():
            want = torch.cat([hf(torch.tensor([p])).logits[:, -1].float() for p in prompts])
    finally:
        hf.load_state_dict(dequantized)
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())

    to_bf16 = (got - last_logits(LLM(str(bf16_dir), **KW), prompts)).abs().max().item()
    bf16_quantized = LLM(str(bf16_dir), quantization="w8a16", **KW)
    at_load = (last_logits(bf16_quantized, prompts) - last_logits(LLM(str(bf16_dir), **KW), prompts)).abs().max()
    assert 0 < to_bf16 <= 2 * at_load.item(), (to_bf16, at_load.item())

    # quantization="w8a16" on a pre-quantized checkpoint: its int8 linears stay exactly as stored
    both = LLM(str(w8_dir), quantization="w8a16", **KW)
    assert torch.equal(both.engine.runner.model.model.layers[0].self_attn.qkv_proj.qweight, qkv.qweight)
    assert torch.equal(last_logits(both, prompts), got)


# ---- files pdserve refuses ------------------------------------------------------------------
def _refused(folder: Path, blob: bytes) -> str:
    folder.mkdir()
    path = folder / "bad.gguf"
    path.write_bytes(blob)
    out = folder / "out"
    out.mkdir()
    with pytest.raises(GGUFError) as err:
        convert(path, out)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message and "bad.gguf" in message
    assert not (out / "model.safetensors").exists()
    return message


def test_a_truncated_file_is_refused(tiny_qwen3: str, files: Files, tmp_path: Path) -> None:
    path = files.gguf(tiny_qwen3, "Q8_0")
    data = path.read_bytes()
    start = gguf.GGUFReader(str(path)).data_offset
    assert "not a readable GGUF file" in _refused(tmp_path / "cut", data[:start + (len(data) - start) // 2])


def test_a_corrupted_header_is_refused(tiny_qwen3: str, files: Files, tmp_path: Path) -> None:
    data = files.gguf(tiny_qwen3, "Q8_0").read_bytes()
    garbage = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes()
    assert "not a readable GGUF file" in _refused(tmp_path / "counts", data[:8] + garbage + data[72:])
    assert "not a readable GGUF file" in _refused(tmp_path / "magic", garbage * 64)


def test_an_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _refused(tmp_path / "mamba", (tmp_path / "mamba.gguf").read_bytes())
    assert "unsupported GGUF architecture 'mamba'" in message
