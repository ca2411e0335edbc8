"""Incremental detokenization: text deltas in time linear in the output, that never split a
multi-byte character.

Each step decodes only a short window: the tokens from ``prefix_offset`` (a few tokens before
the last emitted text, for the context a tokenizer needs to place spaces) to the end, and
emits what that text adds to the window's already-emitted part. A delta ending in U+FFFD is
an incomplete UTF-8 sequence: it is held back until the next token completes it.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # window start: context for the tokenizer
        self.read_offset = 0     # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT) and not final):
            return ""   # nothing new yet, or an incomplete character: wait for more bytes
        delta = text[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta
