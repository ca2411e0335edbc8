"""Fixtures the service tests share."""
from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_qwen3: str) -> LLMEngine:
    """A decode-role engine, the receiving end of the KV transport tests (tiny model, float32,
    64 blocks of 8); one per module."""
    return LLMEngine(EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8, num_kv_blocks=64))
