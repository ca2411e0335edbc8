"""pdserve engine core: paged KV cache, prefix caching, chunked-prefill scheduler, model runner.

The public names are imported on first use, so that a process that needs only part of the
engine (a tensor-parallel rank, ``python -m pdserve.engine.tp_rank``) does not import the tokenizer
and transformers with it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.lazy_exports import lazy_getattr

_EXPORTS = {"EngineConfig": "pdserve.engine.config", "LLM": "pdserve.engine.llm", "CompletionOutput": "pdserve.engine.llm",
            "LLMEngine": "pdserve.engine.llm_engine", "NoCapacity": "pdserve.engine.llm_engine", "RequestOutput": "pdserve.engine.llm_engine",
            "SamplingParams": "pdserve.engine.sampling_params", "StructuredOutputsParams": "pdserve.engine.sampling_params", "SpeculativeConfig": "pdserve.engine.spec_decode.config"}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "NoCapacity", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "SpeculativeConfig"]

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM, CompletionOutput
    from pdserve.engine.llm_engine import LLMEngine, NoCapacity, RequestOutput
    from pdserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from pdserve.engine.spec_decode.config import SpeculativeConfig


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
