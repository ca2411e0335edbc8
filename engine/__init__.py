"""pdserve engine core: paged KV cache, prefix caching, chunked-prefill scheduler, model runner.

The public names are imported on first use, so that a process that needs only part of the
engine (a tensor-parallel rank, ``python -m engine.tp_rank``) does not import the tokenizer
and transformers with it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy_exports import lazy_getattr

_EXPORTS = {"EngineConfig": "engine.config", "LLM": "engine.llm", "CompletionOutput": "engine.llm",
            "LLMEngine": "engine.llm_engine", "NoCapacity": "engine.llm_engine", "RequestOutput": "engine.llm_engine",
            "SamplingParams": "engine.sampling_params"}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "NoCapacity", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM, CompletionOutput
    from engine.llm_engine import LLMEngine, NoCapacity, RequestOutput
    from engine.sampling_params import SamplingParams


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
