"""What the sampler needs beyond the logits for the rows of one step that process them: each
row's prompt and output so far (penalties, bad words, min_tokens) and the grammar bitmask of
constrained rows. A row verifying a draft sees the draft's earlier tokens as output: row j of a
sequence is sampled as if draft[:j] had been kept, which is exactly the case in which its token
is kept (engine/spec_decode/verify.py)."""
from __future__ import annotations

from typing import Collection

from pdserve.engine.layers.sampler import LogitsContext
from pdserve.engine.sequence import Sequence
from pdserve.engine.structured import bitmask


def logits_context(seqs: list[Sequence], offsets: list[int], drafts: list[list[int]],
                   stop_token_ids: Collection[int], vocab_size: int) -> LogitsContext | None:
    """seqs[r], offsets[r], drafts[r]: the sequence of sampled row r, the row's place in it (j) and
    its draft (a sequence's rows share one list). None when no row needs more than temperature
    and top-k/p/min-p: the common case costs one pass over the rows' params."""
    processed = [seq.params.processes_logits for seq in seqs]
    constrained = [seq.grammar is not None for seq in seqs]
    if not any(processed) and not any(constrained):
        return None
    prompt_ids: list[list[int]] = []
    output_ids: list[list[int]] = []
    for seq, j, draft, needed in zip(seqs, offsets, drafts, processed):
        if needed:
            prompt_ids.append(seq.token_ids[:seq.num_prompt_tokens])
            output_ids.append(seq.output_token_ids + list(draft[:j]))
        else:
            prompt_ids.append([])
            output_ids.append([])
    mask_rows = [r for r, c in enumerate(constrained) if c]
    mask = None
    if mask_rows:
        mask = bitmask.allocate(len(mask_rows), vocab_size)
        rows_of: dict[int, list[int]] = {}   # sequence (by id) -> its bitmask rows, in draft order
        first: dict[int, int] = {}
        for k, r in enumerate(mask_rows):
            rows_of.setdefault(id(seqs[r]), []).append(k)
            first.setdefault(id(seqs[r]), r)
        for key, rows in rows_of.items():
            r = first[key]
            seqs[r].grammar.fill(mask, rows, drafts[r][:len(rows) - 1])
    return LogitsContext(prompt_ids, output_ids, frozenset(stop_token_ids), mask, mask_rows)
