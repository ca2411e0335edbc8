"""A GGUF file turned into a checkpoint directory the engine loads (config.json, generation
config, safetensors weights, tokenizer files with the chat template).

The file is read and dequantized with the ``gguf`` package (every GGML quantization it knows:
Q4_0, Q4_1, Q5_*, Q8_0, the K-quants, F16, BF16); its tokenizer and chat template come from its
metadata through transformers' GGUF tokenizer conversion. Llama-family files hold q/k
projections permuted for llama.cpp's rotary layout: they are permuted back, so the weights are
those of the Hugging Face checkpoint the file was made from.

``w8a16``: a Q8_0 weight (int8 values, one float16 scale per 32 inputs) is written as int8 with
one scale per output channel (each row's block scales folded into its largest, the values
requantized to it) instead of being widened to bf16; the engine loads those straight into its
W8A16 path (``engine/layers/linear.py``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import torch

# GGUF architecture -> (HF architecture class, model_type); the engine runs these.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
MAX_METADATA_ITEMS = 1 << 20          # tokens, merges: a vocabulary larger than this is not a model's
_LAYER_TENSORS = {                     # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_IGNORED_TENSORS = ("rope_freqs.weight",)   # llama3 rope factors: recomputed from the config
CONVERTER_VERSION = 2   # part of every converted checkpoint's cache name: a change here converts again
W8A16_SCALE_SUFFIX = "_scale"                # <linear>.weight int8 + <linear>.weight_scale [out]


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint pdserve can convert (one line saying why)."""


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF file holds, read from its header."""

    architecture: str
    name: str
    quantization: str        # the most common tensor type among the weights, e.g. "Q4_1"
    tensors: int


def _reader(path: Path):
    import gguf
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, EOFError, OverflowError, MemoryError) as e:
        raise GGUFError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {str(e)[:120]})") from e


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    if len(f.data) > MAX_METADATA_ITEMS:
        raise GGUFError(f"GGUF metadata {key} has {len(f.data)} items (limit {MAX_METADATA_ITEMS})")
    return f.contents()


def _architecture(reader, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: unsupported GGUF architecture {str(arch)[:40]!r}; pdserve converts "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return arch


def summarize(path: str | Path) -> GGUFSummary:
    path = Path(path)
    reader = _reader(path)
    arch = _architecture(reader, path)
    kinds = [t.tensor_type.name for t in reader.tensors if len(t.shape) == 2]
    common = max(set(kinds), key=kinds.count) if kinds else "none"
    return GGUFSummary(arch, str(_field(reader, "general.name", path.stem)), common, len(reader.tensors))


def hf_config(reader, path: Path) -> dict[str, Any]:
    """config.json for the file's model, from its metadata (HF key names)."""
    arch = _architecture(reader, path)
    key = lambda k, default=None: _field(reader, f"{arch}.{k}", default)   # noqa: E731
    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size") or (len(tokens.data) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    cls, model_type = ARCHITECTURES[arch]
    cfg: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in names,
        "rope_theta": float(key("rope.freq_base", 10000.0)), "torch_dtype": "bfloat16",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{path.name}: rope scaling {str(scaling)[:20]!r} is not supported in GGUF files")
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (rotary pairs interleaved -> HF's two halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, path: Path) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _IGNORED_TENSORS:
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFError(f"{path.name}: unexpected tensor {name[:60]!r}")


def _q8_0_per_channel(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows ([rows, blocks * 34] bytes: float16 scale + 32 int8) -> int8 [rows, cols] and
    a float32 scale per row: each block's values requantized to the row's largest block scale."""
    import torch   # only while converting: resolving a model (a router, `pdserve ray up`) stays torch-free

    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)[:, :, 0]      # [rows, nb]
    q = blocks[:, :, 2:].copy().view(np.int8).astype(np.float32)                  # [rows, nb, 32]
    row_scale = np.maximum(np.abs(d).max(axis=1), 1e-12)                          # [rows]
    values = np.clip(np.rint(q * (d / row_scale[:, None])[:, :, None]), -127, 127).astype(np.int8)
    return torch.from_numpy(values.reshape(rows, -1)), torch.from_numpy(row_scale)


def convert(path: str | Path, out_dir: str | Path, w8a16: bool = False,
            report: Callable[[str], None] | None = None) -> Path:
    """Write the checkpoint of GGUF file ``path`` into ``out_dir`` (which must exist and be empty).

    Raises GGUFError for a file that is not GGUF, is truncated, or holds an architecture or a
    tensor pdserve does not run."""
    import gguf
    import torch   # only while converting: resolving a model (a router, `pdserve ray up`) stays torch-free
    from safetensors.torch import save_file

    path, out = Path(path), Path(out_dir)
    say = report or (lambda _text: None)
    reader = _reader(path)
    cfg = hf_config(reader, path)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = cfg["model_type"] == "llama"
    tensors: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = _hf_name(t.name, path)
        if name is None:
            continue
        rope_heads = (heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0) if permuted else 0
        if w8a16 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and name.endswith("proj.weight"):
            values, scale = _q8_0_per_channel(np.asarray(t.data))
            if rope_heads:   # a permutation of output rows: it commutes with per-row scales
                values = torch.from_numpy(_unpermute(values.numpy(), rope_heads).copy())
                scale = torch.from_numpy(_unpermute(scale.numpy(), rope_heads).copy())
            tensors[name], tensors[name + W8A16_SCALE_SUFFIX] = values, scale
            quantized.append(name)
        else:
            try:
                w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            except (NotImplementedError, ValueError) as e:
                raise GGUFError(f"{path.name}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from e
            w = np.asarray(w, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
            if rope_heads:
                w = _unpermute(w, rope_heads)
            tensors[name] = torch.from_numpy(np.require(w, requirements=("C", "W"))).to(torch.bfloat16)
        if (i + 1) % 64 == 0 or i + 1 == total:
            say(f"converted {i + 1}/{total} tensors of {path.name}")
    if w8a16 and quantized:
        cfg["quantization_config"] = {"quant_method": "pdserve_w8a16", "source": "gguf Q8_0",
                                      "modules": len(quantized)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name[:200]})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    say(f"reading the tokenizer and chat template of {path.name}")
    _write_tokenizer(path, out, _field(reader, "tokenizer.ggml.pre"))
    return out


def _write_tokenizer(path: Path, out: Path, pre: str | None = None) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, from the file's metadata."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise GGUFError(f"{path.name}: its tokenizer cannot be read ({str(e)[:160]})") from e
    if pre == "smollm":   # llama.cpp's: digits split off one by one, then GPT-2's byte-level split
        # (transformers knows no "smollm" and keeps GPT-2's alone: "  9" would be " ", " 9", not "  ", "9")
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.save_pretrained(str(out))
    if pre == "smollm":   # loaded as tokenizer.json says, not rebuilt by an architecture's class (Qwen2Tokenizer's
        config = out / "tokenizer_config.json"   # own split and NFC for a qwen file)
        fields = json.loads(config.read_text())
        fields["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.write_text(json.dumps(fields, indent=2) + "\n")
