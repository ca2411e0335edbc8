"""pdserve engine core: paged KV cache, prefix caching, chunked-prefill scheduler, model runner."""
from engine.config import EngineConfig
from engine.llm import LLM, CompletionOutput
from engine.llm_engine import LLMEngine, NoCapacity, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "NoCapacity", "RequestOutput", "SamplingParams"]
