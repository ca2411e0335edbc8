"""pdserve: disaggregated (prefill/decode) LLM serving.

The public API, imported on first use (``import pdserve`` and the ``pdserve`` command stay light)::

    from pdserve import LLM, SamplingParams          # the engine, offline
    from pdserve import Client, AsyncClient          # a running deployment's router, over gRPC

The code lives in ``pdserve.engine`` (the engine core) and ``pdserve.services`` (router, workers,
KV transfer, deployment); ``pdserve.v1`` holds the generated gRPC stubs of ``proto/pdserve/v1``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.lazy_exports import lazy_getattr

_EXPORTS = {"LLM": "pdserve.engine.llm", "CompletionOutput": "pdserve.engine.llm",
            "SamplingParams": "pdserve.engine.sampling_params", "StructuredOutputsParams": "pdserve.engine.sampling_params", "EngineConfig": "pdserve.engine.config",
            "Client": "pdserve.services.client", "AsyncClient": "pdserve.services.client",
            "Completion": "pdserve.services.client"}

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "Client", "AsyncClient", "Completion", "CompletionOutput", "EngineConfig"]

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM, CompletionOutput
    from pdserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from pdserve.services.client import AsyncClient, Client, Completion

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
