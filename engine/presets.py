"""The model maker's presets: shapes, vocabulary sizes and numerics by name (torch-free, so the
command line lists them without importing torch).

Field names follow the HF config keys. ``PUBLIC_PRESETS`` are the ones ``pdserve make-model``
offers; the others serve tests and benchmarks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Arch = Literal["qwen3", "qwen2", "llama"]
PresetName = Literal["tiny", "tiny-kv1", "tiny-kv4", "tiny-d64", "small", "qwen3-0.6b-kv", "qwen3-0.6b",
                     "qwen3-0.6b-2l", "llama-3.2-1b"]
DEFAULT_PRESET: PresetName = "tiny"
DEFAULT_ARCH: Arch = "qwen3"
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}  # HF classes


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
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float | int], ...] = ()  # rope_parameters besides type and theta
    tokenizer_vocab_size: int | None = None  # the trained tokenizer's size; None: vocab_size
    arch: Arch | None = None  # the architecture a real model's preset has; None: either

    @property
    def num_tokenizer_ids(self) -> int:
        return self.tokenizer_vocab_size or self.vocab_size


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

# Real models' shapes, vocabulary sizes and numerics (their config.json), random weights and
# pdserve's small trained tokenizer (8192 ids: the corpus has merges for that many).
PRESETS["qwen3-0.6b"] = Preset(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151_936, dtype="bfloat16", tie_word_embeddings=True,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40_960, tokenizer_vocab_size=8192,
    arch="qwen3")
# Llama 3's rope scaling is reproduced (pdserve's rotary.inv_frequencies implements "llama3" as HF does).
PRESETS["llama-3.2-1b"] = Preset(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    intermediate_size=8192, vocab_size=128_256, dtype="bfloat16", tie_word_embeddings=True,
    rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=131_072, rope_type="llama3",
    rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                  ("original_max_position_embeddings", 8192)),
    tokenizer_vocab_size=8192, arch="llama")

# HF parity at Qwen3-0.6B's exact width in the test suite: 2 of its 28 (identical) layers.
PRESETS["qwen3-0.6b-2l"] = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=2)

# What `pdserve make-model --preset` offers (the others are for tests and benchmarks).
PUBLIC_PRESETS: dict[str, str] = {
    "tiny": "2 layers, hidden 64, vocab 1024, float32 (0.17M parameters; the tests' model, `--model tiny`)",
    "small": "8 layers, hidden 512, vocab 8192, bf16 (29M parameters; the benchmarks' small model)",
    "qwen3-0.6b": "Qwen3-0.6B's shape: 28 layers, hidden 1024, vocab 151936, bf16 (0.6B parameters, 1.2 GB)",
    "llama-3.2-1b": "Llama-3.2-1B's shape: 16 layers, hidden 2048, vocab 128256, bf16 (1.2B parameters, 2.5 GB)",
}

# Per-(preset, arch) deviations: tiny llama exercises the untied lm_head and a
# different rope base.
_ARCH_OVERRIDES: dict[tuple[str, str], dict[str, object]] = {
    (tiny, "llama"): {"tie_word_embeddings": False, "rope_theta": 10_000.0}
    for tiny in ("tiny", "tiny-kv1", "tiny-kv4", "tiny-d64")
}


def resolve_arch(preset: str, arch: str | None = None) -> str:
    """``arch``, or the preset's own (a real model's), or the default; ValueError on unknown
    names and on an arch that is not a real model's preset's."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    own = PRESETS[preset].arch
    arch = arch or own or DEFAULT_ARCH
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHITECTURES)}")
    if own is not None and arch != own:
        raise ValueError(f"arch {arch!r} does not fit preset {preset!r}, a {own} model's shape")
    return arch


def get_preset(preset: str, arch: str | None = None) -> Preset:
    """The resolved preset for ``arch`` (raises ValueError on unknown names)."""
    arch = resolve_arch(preset, arch)
    return dataclasses.replace(PRESETS[preset], **_ARCH_OVERRIDES.get((preset, arch), {}))  # type: ignore[arg-type]
