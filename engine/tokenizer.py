"""Tokenizer loading: the checkpoint's own Hugging Face tokenizer files."""
from __future__ import annotations

from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)
