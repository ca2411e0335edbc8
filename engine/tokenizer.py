"""Tokenizer loading: the checkpoint's own Hugging Face tokenizer files.

A checkpoint with a ``tokenizer.json`` loads as transformers' ``PreTrainedTokenizerFast`` (the
``tokenizers`` library with the checkpoint's config, special tokens and chat template), which
needs no torch: a router, which only tokenizes, starts without it (about 2 s and 150 MB less per
router process). Anything else loads through ``AutoTokenizer``."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str) -> "PreTrainedTokenizerBase":
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)
