"""Offline batch generation: LLM(model).generate(prompts, params)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence as Seq

from pdserve.engine.checkpoints.resolve import resolve_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]          # generated ids only
    text: str
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None   # per generated token, when params.logprobs is set
    # per prompt token (the first None), when params.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """model: a checkpoint directory, a .gguf file, a Hub id, `tiny`, or None (the default
        model), as the CLI's --model (engine/checkpoints/resolve.py)."""
        model = resolve_model(None if model is None else str(model))
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        if self.config.role != "both":
            raise ValueError(f"LLM runs the 'both' role, got role={self.config.role!r}")
        self.engine = LLMEngine(self.config)
        self.tokenizer = load_tokenizer(str(model))
        self._ids = itertools.count()

    def generate(self, prompts: Seq[str] | Seq[list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[CompletionOutput]:
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(token_lists, params):   # every request is checked before any is queued
            self.engine.validate_request(ids, p)
            self.engine.compile_grammar(p)
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, ids, p in zip(rids, token_lists, params):
            self.engine.add_request(rid, ids, p)
        generated: dict[str, list[int]] = {rid: [] for rid in rids}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid, p in zip(rids, params) if p.logprobs is not None}
        prompt_logprobs: dict[str, list] = {}
        reasons: dict[str, str] = {}
        cached: dict[str, int] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                generated[out.request_id].extend(out.new_token_ids)
                if out.logprobs:
                    logprobs[out.request_id].extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                cached[out.request_id] = out.num_cached_tokens
                if out.finished:
                    reasons[out.request_id] = out.finish_reason or "stop"
        return [CompletionOutput(rid, ids, generated[rid], self.tokenizer.decode(generated[rid], skip_special_tokens=True),
                                 reasons[rid], cached.get(rid, 0), logprobs.get(rid), prompt_logprobs.get(rid))
                for rid, ids in zip(rids, token_lists)]

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any (also done when the LLM is collected)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
