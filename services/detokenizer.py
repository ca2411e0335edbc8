"""Incremental detokenization: text deltas that never split a multi-byte character."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.emitted = 0   # characters of the decoded text already sent

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if not final and text.endswith("\ufffd"):   # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta
