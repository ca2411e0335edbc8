"""Small GGUF files made from the tiny random-weight checkpoints, laid out as llama.cpp's
convert_hf_to_gguf.py writes them: its metadata keys, its tensor names, llama's q/k rows permuted
for its rotary layout, 2-D weights quantized with gguf-py's reference quantizers (the ones
llama.cpp's own quantizers match bit for bit for Q8_0 and Q4_1), norms kept float32."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file

from pdserve.engine.checkpoints.gguf_checkpoint import convert

QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1,
          "F16": gguf.GGMLQuantizationType.F16, "BF16": gguf.GGMLQuantizationType.BF16}
# HF name (below model.layers.N.) -> llama.cpp's name (below blk.N.)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",   # qwen2's
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script's q/k permutation (HF's rotary halves -> interleaved pairs)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def quantizable(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> bool:
    """A 2-D weight whose rows split into whole blocks (GGUF blocks run along a row)."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return len(shape) == 2 and shape[-1] % block == 0


def write_gguf(model_dir: str | Path, path: str | Path, qtype: str = "Q8_0", arch: str | None = None,
               pre: str = "smollm") -> Path:
    """The tiny checkpoint in model_dir as GGUF file path, its 2-D weights in qtype."""
    model_dir, path = Path(model_dir), Path(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    kind = QTYPES[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                     "F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16}[qtype])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)      # llama.cpp writes these where the config has a head_dim
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, model_dir, cfg, pre)
    for name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        tensor = tensor.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = permute(tensor, heads if "q_proj" in name else kv_heads)
        if quantizable(tensor.shape, kind):
            w.add_tensor(gguf_name(name), gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name), tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, cfg: dict, pre: str) -> None:
    """llama.cpp's byte-level BPE vocabulary: tokens by id (in the byte alphabet, as tokenizer.json
    spells them), their types, the merges as "a b" strings, the special ids, the chat template."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok["added_tokens"]}
    for t in added.values():
        vocab.setdefault(t["content"], t["id"])
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id[i] for i in range(cfg["vocab_size"])]
    types = [TOKEN_NORMAL if t not in added else TOKEN_CONTROL if added[t]["special"] else TOKEN_USER_DEFINED
             for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    template = model_dir / "chat_template.jinja"
    chat = template.read_text() if template.is_file() else tok_cfg.get("chat_template")
    if chat:
        w.add_chat_template(chat)


class Files:
    """The GGUF files, their conversions and transformers' models of them, made once and shared."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, object] = {}

    def _once(self, key: tuple, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def gguf(self, model: str, qtype: str) -> Path:
        def make() -> Path:
            folder = self.root / f"{Path(model).name}-{qtype}"
            folder.mkdir()
            return write_gguf(model, folder / f"tiny-{qtype}.gguf", qtype)
        return self._once(("gguf", model, qtype), make)

    def converted(self, model: str, qtype: str, w8a16: bool = False) -> Path:
        def make() -> Path:
            out = self.root / f"{Path(model).name}-{qtype}-{'w8a16' if w8a16 else 'bf16'}"
            out.mkdir()
            return convert(self.gguf(model, qtype), out, w8a16=w8a16)
        return self._once(("converted", model, qtype, w8a16), make)

    def hf(self, model: str, qtype: str):
        """transformers' model of the GGUF file (float32) and its dequantized tensors."""
        def make():
            import transformers
            from transformers import AutoConfig, AutoModelForCausalLM
            transformers.logging.set_verbosity_error()
            path = self.gguf(model, qtype)
            cfg = json.loads((Path(model) / "config.json").read_text())
            # transformers' GGUF config mappings for qwen2/qwen3 do not read attention.key_length: the
            # head_dim would stay the config class's default (hidden / heads for Qwen2, 128 for Qwen3:
            # released models'), not the tiny model's 32
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            config.head_dim = cfg["head_dim"]
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                      config=config).eval()
            assert hf.config.head_dim == cfg["head_dim"]
            hf.generation_config.eos_token_id = None
            hf.generation_config.pad_token_id = 0
            return hf, {k: v.clone() for k, v in hf.state_dict().items()}
        return self._once(("hf", model, qtype), make)
