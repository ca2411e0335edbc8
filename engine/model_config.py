"""The model's shape, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
# Architectures whose q/k/v projections always carry a bias and o_proj none (HF's Qwen2: its
# config has no attention_bias key). Elsewhere attention_bias puts a bias on all four.
QKV_BIAS_ARCHITECTURES = ("qwen2",)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str               # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_parameters: tuple[tuple[str, Any], ...]   # extra scaling parameters, hashable
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # a bias on o_proj (Llama's attention_bias: on q/k/v too, see qkv_bias)
    qkv_bias: bool                  # a bias on q_proj, k_proj and v_proj
    mlp_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def rope_scaling(self) -> dict[str, Any]:
        return dict(self.rope_parameters)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {model_dir!s} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu is supported")
        if _has_sliding_layers(cfg):
            raise ValueError("sliding-window attention layers are not supported (use_sliding_window / layer_types)")
        # transformers >= 5 nests rope settings in rope_parameters; older configs use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_parameters=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict)))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias and arch not in QKV_BIAS_ARCHITECTURES,
            qkv_bias=attention_bias or arch in QKV_BIAS_ARCHITECTURES,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _has_sliding_layers(cfg: dict[str, Any]) -> bool:
    """Whether a config asks for sliding-window attention in some layer (Qwen2/Qwen3 configs: the
    layers from max_window_layers on when use_sliding_window, or layer_types where written)."""
    if "sliding_attention" in (cfg.get("layer_types") or ()):
        return True
    return bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None and \
        cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]
