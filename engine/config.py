"""Engine configuration: one frozen-ish dataclass, validated on construction."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ROLES = ("both", "prefill", "decode")
SCHEDULE_POLICIES = ("prefill_first", "interleave", "mixed")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "w8a16")


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"                      # "auto": the checkpoint's torch_dtype (weights as loaded, KV cache)
    compute_dtype: str = "auto"              # activations and matmuls; "auto": on CPU, engine.cpu_features
                                             # decides from the CPU (bf16 checkpoints: bf16 with AMX or fast
                                             # bf16 GEMMs, else float32); elsewhere the checkpoint's dtype
    device: str = "auto"                     # "auto": cuda when available, else cpu
    max_num_batched_tokens: int = 2048       # token budget of one step (chunked prefill)
    max_num_seqs: int = 64
    max_model_len: int | None = None         # default: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None         # explicit pool size; overrides the memory budget
    kv_cache_memory_bytes: int = 1 << 30     # CPU pool budget
    gpu_memory_utilization: float = 0.85     # CUDA: fraction of free memory for the pool
    enable_prefix_caching: bool = True
    schedule_policy: str = "prefill_first"
    role: str = "both"
    num_threads: int | None = None           # torch intra-op threads; None leaves torch's choice
    enforce_eager: bool = False              # CUDA: skip graph capture for decode
    quantization: str | None = None          # "w8a16": int8 weights, per-output-channel scales
    seed: int = 0                            # for requests without their own seed

    def __post_init__(self) -> None:
        _check_choice("role", self.role, ROLES)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("compute_dtype", self.compute_dtype, DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model=model, **kwargs)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
