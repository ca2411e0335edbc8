"""Shared fixtures: tiny checkpoints made once per session, HF reference outputs."""
from __future__ import annotations

import os
import random
from pathlib import Path

# Ray reads its auth mode once, when first imported; whichever test module imports it first,
# the Ray tests' local cluster uses token authentication.
os.environ.setdefault("RAY_AUTH_MODE", "token")

import pytest

from engine.model_maker import make_model

ARCHS = ("qwen3", "llama")


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, model_root: Path) -> str:
    """A tiny checkpoint of each architecture (qwen3: tied embeddings, q/k norms; llama: untied)."""
    path = model_root / f"tiny-{request.param}"
    if not path.exists():
        make_model(path, preset="tiny", arch=request.param, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3(model_root: Path) -> str:
    path = model_root / "tiny-qwen3"
    if not path.exists():
        make_model(path, preset="tiny", arch="qwen3", seed=0)
    return str(path)


def random_prompts(n: int, min_len: int, max_len: int, vocab: int = 1024, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


_HF_CACHE: dict[tuple, list[list[int]]] = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers greedy continuations in float32: the correctness oracle."""
    key = (model_dir, tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # ignore_eos semantics: EOS may be generated but does not stop (min_new_tokens would ban it instead).
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        outs = []
        with torch.inference_mode():
            for p in prompts:
                ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
                outs.append(ids[0, len(p):].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


def assert_no_leak(llm_or_engine) -> None:
    stats = llm_or_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
