"""Incremental detokenization: text deltas in time linear in the output, that never split a
multi-byte character, and whose concatenation is exactly ``tokenizer.decode`` of the output.

Each step decodes only a short window: the tokens from ``prefix_offset`` (a few tokens before
the last emitted text, for the context a tokenizer needs to place spaces) to the end, and
emits what that text adds to the window's already-emitted part.

What keeps the window short (it runs on the router's event loop, for every stream):

- Skipped special tokens never enter it (the tokenizer drops them before decoding anyway), and
  tokens that add no text (ids the tokenizer does not know) move the offsets like any other.
- A window ending in U+FFFD may be an incomplete UTF-8 sequence, held back until the next token
  completes it. With a byte-level decoder (GPT-2, Qwen, Llama 3) an incomplete character decodes
  to one U+FFFD and its bytes (at most 3) span at most ``HOLD_TOKENS`` tokens: at most
  ``HOLD_CHARS`` are held, and past ``HOLD_TOKENS`` pending tokens the text before the last ones
  is final, so it is emitted and the offsets advance to it. A stream of invalid byte sequences
  costs a bounded decode per token, not its whole tail, and the text is exactly the full decode.
- A ``ByteFallback`` decoder (SentencePiece byte tokens, Llama 2) decodes a whole run of byte
  tokens as one unit, all of it U+FFFD when any of it is invalid: its trailing U+FFFD are all
  held, up to ``HOLD_TOKENS_BYTE_RUN`` pending tokens. Valid UTF-8 comes out exactly; a longer
  run holding an invalid byte is cut there (its later bytes decode on their own).

Stop strings (the OpenAI API's ``stop``) are matched in the streamed text, across token
boundaries, by ``StopMatcher``.
"""
from __future__ import annotations

import weakref

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"
HOLD_TOKENS = 3   # tokens an incomplete character's bytes can span (each token decodes to >= 1 byte)
HOLD_CHARS = 3    # trailing U+FFFD held back (a byte-level decoder renders an incomplete character as one)
CUT_TRIES = 4     # token boundaries tried for a clean cut of a window that ends in U+FFFD
HOLD_TOKENS_BYTE_RUN = 32   # the same bound for a ByteFallback decoder (whose byte runs decode as one)

_traits: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[frozenset[int], bool]]" = \
    weakref.WeakKeyDictionary()


def tokenizer_traits(tokenizer: PreTrainedTokenizerBase) -> tuple[frozenset[int], bool]:
    """(the ids decode(skip_special_tokens=True) drops, whether its decoder has ByteFallback)."""
    traits = _traits.get(tokenizer)
    if traits is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:   # what the Rust tokenizer itself skips, and how it decodes
            skipped = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
            decoder = backend.decoder
            byte_runs = decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
        else:                     # a slow (Python) tokenizer: assume the least
            skipped, byte_runs = frozenset(tokenizer.all_special_ids), True
        traits = _traits[tokenizer] = (skipped, byte_runs)
    return traits


def _trailing_replacements(text: str, limit: int | None) -> int:
    n = 0
    while (limit is None or n < limit) and n < len(text) and text[-1 - n] == REPLACEMENT:
        n += 1
    return n


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        skipped, byte_runs = tokenizer_traits(tokenizer)
        self._skipped = skipped if skip_special_tokens else frozenset()
        self._hold_chars = None if byte_runs else HOLD_CHARS
        self._hold_tokens = HOLD_TOKENS_BYTE_RUN if byte_runs else HOLD_TOKENS
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # window start: context for the tokenizer
        self.read_offset = 0     # tokens whose text has been emitted
        self._prefix_text = ""   # decode of token_ids[prefix_offset:read_offset]
        self._extra = 0          # characters emitted beyond _prefix_text (a held-back tail's final part)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, cut: int, cut_text: str, emitted: int) -> None:
        """Tokens before cut are emitted as cut_text (the window's text up to cut); emitted
        characters of the window so far. The window now starts at the old read offset."""
        new_prefix = self.token_ids[self.read_offset:cut]
        self.prefix_offset, self.read_offset = self.read_offset, cut
        self._prefix_text = self._decode(new_prefix) if new_prefix else ""
        self._extra = max(0, emitted - len(cut_text))   # characters already emitted past cut

    def add(self, token_ids: list[int], final: bool = False) -> str:
        skipped = self._skipped
        self.token_ids.extend([t for t in token_ids if t not in skipped] if skipped else token_ids)
        n = len(self.token_ids)
        if n == self.read_offset:
            return ""
        text = self._decode(self.token_ids[self.prefix_offset:])
        start = len(self._prefix_text) + self._extra   # what of the window's text is emitted
        held = 0 if final else _trailing_replacements(text, self._hold_chars)
        delta = text[start:len(text) - held] if len(text) - held > start else ""
        emitted = start + len(delta)
        if not held:
            self._advance(n, text, emitted)
        elif n - self.read_offset > self._hold_tokens:
            # The trailing U+FFFD may be an incomplete character, but only the last tokens can
            # hold one: advance to a token boundary before them that splits nothing (the text
            # of the tokens before it and after it make the window's).
            for cut in range(n - HOLD_TOKENS, max(self.read_offset, n - HOLD_TOKENS - CUT_TRIES), -1):
                head = self._decode(self.token_ids[self.prefix_offset:cut])
                if text.startswith(head) and text[len(head):] == self._decode(self.token_ids[cut:]):
                    if len(head) > emitted:
                        delta += text[emitted:len(head)]
                        emitted = len(head)
                    self._advance(cut, head, emitted)
                    break
            else:
                self._extra = emitted - len(self._prefix_text)
        else:
            self._extra = emitted - len(self._prefix_text)
        return delta


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries. Text that could be the
    start of a stop string is held back until it is known not to be one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""

    def _held(self, buf: str) -> int:
        """Length of the longest end of buf that begins a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), held, -1):
                if buf.endswith(s[:k]):
                    held = k
                    break
        return held

    def add(self, text: str, final: bool, check: bool = True) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended it). check=False: no stop yet (min_tokens)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        if check:
            hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.pending = ""
                return buf[:min(hits)], True
        if final:
            self.pending = ""
            return buf, False
        cut = len(buf) - self._held(buf)
        self.pending = buf[cut:]
        return buf[:cut], False
