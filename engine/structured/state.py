"""One sequence's place in its grammar: which tokens may come next.

The matcher advances with every token the sequence keeps (LLMEngine), so a sequence rebuilt
from its tokens elsewhere (the decode side of a hand-off, a migrated or re-prefilled request:
``GrammarState.following``) is in the same state. A speculative draft is cut to its longest
prefix the grammar allows (``valid_prefix``); verification then samples row j of the sequence
under the mask that holds after the draft's first j tokens (``fill``), and the matcher is
rolled back to where it was: only the tokens the engine keeps advance it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    import xgrammar


class GrammarState:
    def __init__(self, compiled: "xgrammar.CompiledGrammar", keep: "torch.Tensor | None" = None) -> None:
        """keep: a bitmask row ANDed into every row this fills (the tokens this grammar must not
        emit whatever it says: grammars.special_tokens_cleared, control_tokens_cleared)."""
        import xgrammar as xgr
        self._matcher = xgr.GrammarMatcher(compiled)   # rollback is unbounded (xgrammar >= 0.2)
        self.keep = keep

    @classmethod
    def following(cls, compiled: "xgrammar.CompiledGrammar", tokens: Sequence[int],
                  keep: "torch.Tensor | None" = None) -> "GrammarState":
        """The state after tokens (a sequence's output so far); ValueError naming the first one the
        grammar does not allow."""
        state = cls(compiled, keep)
        for i, tok in enumerate(tokens):
            if not state.accept(tok):
                raise ValueError(f"output token {i} ({tok}) does not follow the request's structured_outputs")
        return state

    def accept(self, token: int) -> bool:
        """Advance by a token the sequence keeps; False (and no change) if the grammar forbids it."""
        return self._matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """It accepted a stop token at an accepting state: nothing may follow."""
        return self._matcher.is_terminated()

    def valid_prefix(self, draft: Sequence[int]) -> list[int]:
        """draft's longest prefix the grammar allows from here (the state is left as it was)."""
        n = 0
        for tok in draft:
            if self._matcher.is_terminated() or not self._matcher.accept_token(tok):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return list(draft[:n])

    def fill(self, bitmask: "torch.Tensor", rows: Sequence[int], draft: Sequence[int] = ()) -> None:
        """bitmask[rows[j]] for j = 0 .. len(draft): what may follow here after the draft's first j
        tokens (each must be allowed: valid_prefix cut the draft). The state is left as it was."""
        m = self._matcher
        for j, tok in enumerate(draft):
            m.fill_next_token_bitmask(bitmask, rows[j])
            if not m.accept_token(tok):
                if j:
                    m.rollback(j)
                raise ValueError(f"draft token {j} ({tok}) does not follow the grammar")
        m.fill_next_token_bitmask(bitmask, rows[len(draft)])
        if draft:
            m.rollback(len(draft))
        if self.keep is not None:   # this state's own: a JSON grammar keeps out more than others
            index = torch.tensor(rows, dtype=torch.long)
            bitmask[index] &= self.keep
