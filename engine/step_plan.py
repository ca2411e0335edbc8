"""One step's model inputs as plain integers: what the driver computes from the scheduler's
batch and what it broadcasts to the other tensor-parallel ranks (one fixed-size int64 header,
then one int64 payload; nothing pickled).

Rows are decodes first (shortest context first), then prefill segments. Every rank builds its
attention metadata from a plan, so all ranks attend over the same blocks.

A decode that verifies a speculative draft (engine/spec_decode) is one decode row per token it
computes: its last token, then each draft token, each at its position, attending over the
context up to itself (SeqView(position, its block table)), and every one sampled. All of a
step's K/V are stored before any row attends, so each row reads the draft tokens before it;
and each row runs the very path a plain decode at that position runs (the decode attention
kernel, the fused decode call, CUDA graphs), so its logits are those plain decoding computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_LEN = 8
# Header word 0: what the ranks do next.
OP_STEP = 1        # [op, tokens, sample_rows, seqs, table_entries, num_decode]: run the model
OP_STOP = 2        # leave the loop and exit
OP_WRITE_KV = 3    # [op, entries, elements]: write received KV heads into the pool (engine/tp_rank.py)
OP_READ_KV = 4     # [op, blocks]: all-gather these blocks' KV heads to the driver
OP_PING = 5        # nothing (keeps an idle group's sockets checked)


@dataclass(slots=True)
class SeqView:
    """What attention metadata needs of a sequence (a rank has no Sequence objects)."""

    num_computed_tokens: int
    block_table: list[int]


@dataclass(slots=True)
class StepPlan:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    # rows whose logits are computed: those sampled, in row order, then prompt rows scored for
    # their next prompt token (SamplingParams.prompt_logprobs)
    sample_rows: list[int]
    seqs: list                      # Sequence or SeqView per decode row, then per prefill segment
    num_new_tokens: list[int]       # per entry of seqs (1 for each decode row)
    num_decode: int                 # the leading entries: decode rows
    sample_seqs: list[int] | None = None   # driver only: the batch index of each sampled row
    # driver only: (batch index, first position, rows) of each prefill segment's scored prompt rows,
    # which follow the sampled rows in sample_rows in this order
    scored: list[tuple[int, int, int]] | None = None

    @classmethod
    def from_batch(cls, batch, block_size: int) -> "StepPlan":
        bs = block_size
        seqs, counts, nd = batch.seqs, batch.num_new_tokens, batch.num_decode_seqs
        # Decode rows go shortest context first (any row order is valid: results map back through
        # sample_seqs, a sequence's rows in position order), so that rows of similar length form
        # contiguous groups for attention.
        rows = [(i, j) for i in range(nd) for j in range(counts[i])]
        if len(rows) > 1:
            rows.sort(key=lambda r: seqs[r[0]].num_computed_tokens + r[1])
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        views: list = []
        for i, j in rows:
            seq = seqs[i]
            p = seq.num_computed_tokens + j
            ids.append(batch.draft(i)[j - 1] if j else seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            views.append(seq if counts[i] == 1 else SeqView(p, seq.block_table))
        sample_rows: list[int] = list(range(len(rows)))
        sample_seqs: list[int] = [i for i, _ in rows]
        scored_rows: list[int] = []
        scored: list[tuple[int, int, int]] = []
        for i in range(nd, len(seqs)):
            seq, n = seqs[i], counts[i]
            start = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:
                ids.append(seq.token_ids[start])
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:start + n])
                pos.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            first = seq.next_prompt_score
            if first is not None:   # positions up to the last but one prompt token score the next one
                end = min(start + n, seq.num_prompt_tokens - 1)
                if end > max(first, start):
                    row0 = len(ids) - n
                    scored_rows.extend(range(row0 + max(first, start) - start, row0 + end - start))
                    scored.append((i, max(first, start), end - max(first, start)))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(i)
        return cls(ids, pos, slots, sample_rows + scored_rows, views + seqs[nd:], [1] * len(rows) + counts[nd:],
                   len(rows), sample_seqs, scored)

    # ---- wire form ----------------------------------------------------------------------
    def encode(self) -> tuple[list[int], torch.Tensor]:
        """(header words, int64 payload)."""
        tables = [b for s in self.seqs for b in s.block_table]
        header = [OP_STEP, len(self.input_ids), len(self.sample_rows), len(self.seqs), len(tables), self.num_decode]
        payload = torch.tensor([*self.input_ids, *self.positions, *self.slots, *self.sample_rows,
                                *(s.num_computed_tokens for s in self.seqs), *self.num_new_tokens,
                                *(len(s.block_table) for s in self.seqs), *tables], dtype=torch.int64)
        return header, payload

    @staticmethod
    def payload_len(header: list[int]) -> int:
        _, t, s, b, entries = header[:5]
        return 3 * t + s + 3 * b + entries

    @classmethod
    def decode(cls, header: list[int], payload: torch.Tensor) -> "StepPlan":
        _, t, s, b, _, nd = header[:6]
        values = payload.tolist()
        cut = iter((t, t, t, s, b, b, b))
        parts = []
        at = 0
        for n in cut:
            parts.append(values[at:at + n])
            at += n
        ids, pos, slots, sample_rows, computed, counts, lens = parts
        seqs = []
        for c, n in zip(computed, lens):
            seqs.append(SeqView(c, values[at:at + n]))
            at += n
        return cls(ids, pos, slots, sample_rows, seqs, counts, nd)
