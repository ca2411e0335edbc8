"""N-gram prompt lookup (vLLM's ``ngram`` method): the draft is what followed the most recent
earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down to
prompt_lookup_min, over its own tokens (prompt and output). No model: a text that copies its
prompt (an edit, a quotation, code) drafts the copy. Each sequence keeps its tokens mirrored in
a numpy array (``TokenMirror``, on ``Sequence.proposer_state``) that takes only the new tokens
each step, so a lookup costs one vectorised pass, not a conversion of the whole sequence."""
from __future__ import annotations

import numpy as np

from pdserve.engine.sequence import Sequence


class TokenMirror:
    """A growing int64 copy of a token list that is only ever appended to."""

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The mirror of token_ids (rebuilt whole if they are not its continuation)."""
        n = self.size
        if n > len(token_ids) or (n and token_ids[n - 1] != self.buf[n - 1]):
            n = 0
        if len(token_ids) > self.buf.size:
            grown = np.empty(max(2 * self.buf.size, len(token_ids)), dtype=np.int64)
            grown[:n] = self.buf[:n]
            self.buf = grown
        if len(token_ids) > n:
            self.buf[n:len(token_ids)] = token_ids[n:]
        self.size = len(token_ids)
        return self.buf[:self.size]


class NgramProposer:
    """Drafts up to num_speculative_tokens tokens per call."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most min(k, max_tokens) draft tokens to follow seq's tokens ([]: no match)."""
        k = min(self.k, max_tokens)
        if k <= 0 or seq.num_tokens <= self.min_n:
            return []
        if not isinstance(seq.proposer_state, TokenMirror):
            seq.proposer_state = TokenMirror()
        return ngram_lookup(seq.proposer_state.sync(seq.token_ids), self.min_n, self.max_n, k)

    def finished(self, seq: Sequence) -> None:
        """Prompt lookup keeps nothing across requests."""


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of tokens' last n, for the largest n in
    [min_n, max_n] that occurs earlier; [] when none does. Where fewer than k follow it, the
    period it reveals continues the draft ([a b c a b] drafts [c a b c ...]).

    One vectorised pass finds where the last token occurred before (each an occurrence's end),
    then each candidate's match is extended backwards up to max_n tokens."""
    length = len(tokens)
    if length <= min_n:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])   # an earlier occurrence's last token
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)   # tokens each candidate matches, backwards from its end
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, min(max_n, length - 1)):
        before = ends - m
        alive &= before >= 0
        if not alive.any():
            break
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - m]
        matched += alive
    for n in range(max_n, min_n - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            start = int(hits[-1]) + 1
            draft = tokens[start:start + k].tolist()
            # A match this recent has fewer than k tokens after it: the text repeats with period
            # length - start from there, and the draft goes on repeating it (as k lookups would,
            # each after appending the token before).
            period = length - start
            while len(draft) < k:
                draft.append(draft[len(draft) - period])
            return draft
    return []
