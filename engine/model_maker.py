"""Deterministic maker of small random-weight Hugging Face checkpoints.

``make_model(out_dir, preset, arch, seed)`` writes a directory that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load
directly: ``config.json``, ``generation_config.json``, ``model.safetensors`` and
a byte-level BPE tokenizer trained on the English corpus shipped in
``engine/data``, with a plain-text chat template (``CHAT_TEMPLATE``).  Same arguments always give byte-identical files.

The weights are random but scaled so that logits are well separated (greedy
decoding is stable between two float32 implementations) and greedy output is
varied.  Command line: ``python -m engine.model_maker OUT_DIR --preset small``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.settings import pdserve_home

Arch = Literal["qwen3", "llama"]
PresetName = Literal["tiny", "tiny-kv1", "tiny-kv4", "tiny-d64", "small", "qwen3-0.6b-kv"]

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN_ID = 0  # also the pad token
BOS_TOKEN_ID = 1
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)  # trainer assigns ids in this order
SPECIAL_ROW_SCALE = 0.05  # see make_weights
RESIDUAL_GAIN = 2.0  # see weight_specs

# Bump when the output of make_model changes, so cached default models are rebuilt.
# 2: a chat template.
MAKER_VERSION = 2
DEFAULT_PRESET: PresetName = "tiny"
DEFAULT_ARCH: Arch = "qwen3"
DEFAULT_SEED = 0

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"

# A plain-text chat template (the tokenizer has no chat special tokens): one "role: content"
# paragraph per message, then "assistant:" for the reply. Content may be a string or a list of
# OpenAI content parts ({"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] }}: "
    "{%- if message['content'] is string -%}{{ ' ' + message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ ' ' + part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant:' }}{%- endif -%}"
)

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Preset:
    """Model shape and numerics; field names follow the HF config keys."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    # Fast-test model. head_dim * heads != hidden on purpose.
    "tiny": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1024,
        dtype="float32",
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
    ),
    # Benchmark model (fixed by spec).
    "small": Preset(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=8192,
        dtype="bfloat16",
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    ),
}

# Tensor-parallel tests: the tiny shape with fewer (1) and more (4) KV heads than 2 ranks.
PRESETS["tiny-kv1"] = dataclasses.replace(PRESETS["tiny"], num_key_value_heads=1)
PRESETS["tiny-kv4"] = dataclasses.replace(PRESETS["tiny"], num_key_value_heads=4)
# Native prefill attention tests: the head dim its kernels take (64), four query heads per KV head.
PRESETS["tiny-d64"] = dataclasses.replace(PRESETS["tiny"], head_dim=64, num_key_value_heads=1)
# KV hand-off benchmarks: Qwen3-0.6B's KV shape (28 layers, 8 KV heads of 128, bf16: 112 KiB a
# token) around a narrow residual stream and MLP, so its prefill is cheap on a CPU.
PRESETS["qwen3-0.6b-kv"] = dataclasses.replace(
    PRESETS["small"], hidden_size=128, num_hidden_layers=28, num_attention_heads=8, num_key_value_heads=8,
    head_dim=128, intermediate_size=256, vocab_size=2048, max_position_embeddings=8192)

# Per-(preset, arch) deviations: tiny llama exercises the untied lm_head and a
# different rope base.
_ARCH_OVERRIDES: dict[tuple[str, str], dict[str, object]] = {
    (tiny, "llama"): {"tie_word_embeddings": False, "rope_theta": 10_000.0}
    for tiny in ("tiny", "tiny-kv1", "tiny-kv4", "tiny-d64")
}


def get_preset(preset: str, arch: str = DEFAULT_ARCH) -> Preset:
    """The resolved preset for ``arch`` (raises ValueError on unknown names)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(_ARCHITECTURES)}")
    return dataclasses.replace(PRESETS[preset], **_ARCH_OVERRIDES.get((preset, arch), {}))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    # Digits are split one per token (as Qwen does); ByteLevel maps every byte to a
    # symbol, so decode(encode(s)) == s for any string (no normalizer on purpose).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = CORPUS_PATH.read_text(encoding="utf-8").split("\n\n")
    tok.train_from_iterator(paragraphs, trainer=trainer)
    # If the corpus runs out of merges, pad with reserved specials so that every
    # model id decodes to something and len(tokenizer) == vocab_size.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID and tok.token_to_id(BOS_TOKEN) == BOS_TOKEN_ID
    return tok.to_str()


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained deterministically on the shipped corpus.

    Ids 0 and 1 are ``<|endoftext|>`` and ``<|bos|>``; vocab size is exactly
    ``vocab_size``. No BOS/EOS is added when encoding.
    """
    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


def _write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast  # lazy: transformers is slow to import

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    _write_json(out / "special_tokens_map.json", special)
    # Pin the class name so older transformers versions resolve it too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(special, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False, add_eos_token=False)
    _write_json(cfg_path, cfg)


# --------------------------------------------------------------------------- config


def _write_configs(out: Path, p: Preset, arch: str) -> None:
    from transformers import GenerationConfig, LlamaConfig, Qwen3Config

    common = dict(
        architectures=[_ARCHITECTURES[arch]],
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        hidden_act="silu",
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=p.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=p.tie_word_embeddings,
        attention_bias=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        dtype=p.dtype,
    )
    config = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    config.save_pretrained(str(out))
    # Also emit the legacy top-level keys that pre-v5 readers (and simple loaders) expect.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(torch_dtype=p.dtype, dtype=p.dtype, rope_theta=p.rope_theta)
    _write_json(cfg_path, cfg)

    gen = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, do_sample=False
    )
    gen.save_pretrained(str(out))


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- weights


def weight_specs(p: Preset, arch: str) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(HF tensor name, shape, init std) for every tensor; std 0 means ones (norms).

    Linears reading the residual stream use std 1/sqrt(fan_in) (unit-variance
    activations) and embeddings std 1, so logits have std ~sqrt(hidden) and are
    well separated.  The projections writing back into the residual stream
    (o_proj, down_proj) get an extra gain of RESIDUAL_GAIN * sqrt(hidden):
    otherwise the token's own embedding dominates the final hidden state and a
    tied lm_head keeps predicting the input token (pre-norm keeps this stable).
    """
    h, hd, inter = p.hidden_size, p.head_dim, p.intermediate_size
    q_out, kv_out = p.num_attention_heads * hd, p.num_key_value_heads * hd
    gain = RESIDUAL_GAIN * math.sqrt(h)
    yield "model.embed_tokens.weight", (p.vocab_size, h), 1.0
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (h,), 0.0
        yield pre + "self_attn.q_proj.weight", (q_out, h), h**-0.5
        yield pre + "self_attn.k_proj.weight", (kv_out, h), h**-0.5
        yield pre + "self_attn.v_proj.weight", (kv_out, h), h**-0.5
        yield pre + "self_attn.o_proj.weight", (h, q_out), gain * q_out**-0.5
        if arch == "qwen3":
            yield pre + "self_attn.q_norm.weight", (hd,), 0.0
            yield pre + "self_attn.k_norm.weight", (hd,), 0.0
        yield pre + "post_attention_layernorm.weight", (h,), 0.0
        yield pre + "mlp.gate_proj.weight", (inter, h), h**-0.5
        yield pre + "mlp.up_proj.weight", (inter, h), h**-0.5
        yield pre + "mlp.down_proj.weight", (h, inter), gain * inter**-0.5
    yield "model.norm.weight", (h,), 0.0
    if not p.tie_word_embeddings:
        yield "lm_head.weight", (p.vocab_size, h), 1.0


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"pdserve:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_weights(p: Preset, arch: str, seed: int) -> dict[str, torch.Tensor]:
    """Random weights; each tensor has its own generator seeded from (seed, name).

    The output rows of the special tokens are shrunk (logit ~0 while the top
    logit is ~3 sqrt(hidden)), so random models practically never emit EOS/BOS
    and generation length is set by max_tokens alone.
    """
    dtype = _DTYPES[p.dtype]
    out_name = "model.embed_tokens.weight" if p.tie_word_embeddings else "lm_head.weight"
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, std in weight_specs(p, arch):
        if std == 0.0:
            t = torch.ones(shape, dtype=torch.float32)
        else:
            gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if name == out_name:
            t[: len(SPECIAL_TOKENS)] *= SPECIAL_ROW_SCALE
        tensors[name] = t.to(dtype).contiguous()
    return tensors


# --------------------------------------------------------------------------- public API


def make_model(
    out_dir: str | os.PathLike[str],
    preset: PresetName | str = DEFAULT_PRESET,
    arch: Arch | str = DEFAULT_ARCH,
    seed: int = DEFAULT_SEED,
) -> Path:
    """Write a complete HF checkpoint directory to ``out_dir`` and return its path."""
    p = get_preset(preset, arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_configs(out, p, arch)
    _write_tokenizer(out, p.vocab_size, p.max_position_embeddings)
    weights_path = out / "model.safetensors"
    save_file(make_weights(p, arch, seed), str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors creates it 0600; match the other files
    return out




def cached_model_dir(preset: str = DEFAULT_PRESET, arch: str = DEFAULT_ARCH, seed: int = DEFAULT_SEED) -> Path:
    """Cache location of a preset's deterministic checkpoint."""
    return pdserve_home() / "models" / f"{preset}-{arch}-seed{seed}-v{MAKER_VERSION}"


def default_model_dir() -> Path:
    """Cache location of the default (tiny qwen3, seed 0) model."""
    return cached_model_dir()


def ensure_model(preset: str = DEFAULT_PRESET, arch: str = DEFAULT_ARCH, seed: int = DEFAULT_SEED) -> Path:
    """Make a preset's checkpoint in the cache on first use (atomically) and return its directory."""
    target = cached_model_dir(preset, arch, seed)
    if target.is_dir():  # only ever created by the rename below, so it is complete
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_model(tmp, preset, arch, seed)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # lost a race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_default_model() -> Path:
    """Make the default model on first use (atomically) and return its directory."""
    return ensure_model()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a deterministic random-weight HF checkpoint.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--arch", choices=sorted(_ARCHITECTURES), default=DEFAULT_ARCH)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    print(make_model(args.out_dir, args.preset, args.arch, args.seed))


if __name__ == "__main__":
    main()
