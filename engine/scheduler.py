"""Continuous batching with chunked prefill, three step policies and recompute preemption.

Every scheduled sequence computes the KV of token_ids[num_computed : num_computed + n]; when
that reaches the end of its tokens, the step also samples its next token. A decode is the
special case n == 1, so prefill chunks and decodes share one batch format.

Priority (SamplingParams.priority, lower first as vLLM's): the waiting queue is ordered by it,
and within a class by the prompt order (fcfs: arrival; shortest: arrival plus the prompt's time
to compute alone, a prompt already under way by the tokens it has left, so short prompts pass a
long one mid-prefill: _schedule_prefills). When the first waiting sequence
does not fit in the pool, running sequences of a lower class (a higher value) are preempted
for it, the lowest class and the latest arrival first, until it fits; a decode that finds the
pool empty preempts the lowest class too, the last admitted first. Preemption is by recompute:
the victim's blocks are freed (its computed ones stay in the prefix cache, and with KV tiers
go on to host RAM / disk when the pool hands them out, so resuming is mostly prefix hits) and
it waits ahead of its class to be prefilled again over its prompt and the tokens it generated,
which gives the tokens a run without preemption gives. A sequence whose blocks the KV
connector holds (sent or received) is never a victim.

A decode worker's pool fills with sequences whose KV arrived from elsewhere: a reservation of
a higher class that does not fit leaves a ``Claim`` (its class and the free blocks it needs,
for a moment); the next steps preempt running sequences of lower classes until the pool has
them, and admit no waiting sequence of a lower class meanwhile, so the reservation, asked again,
fits.

A waiting sequence whose cached prefix is being read from the disk KV tier in the background
(BlockManager.ready) is passed over until its blocks are in; the sequences behind it are
admitted meanwhile.

Speculative decoding (engine/spec_decode): once every decode has its token, the step's budget
left goes to drafts: the speculator drafts for each decode as deep as it finds it pays
(engine/spec_decode/depth.py; fewer where the budget, its max_tokens, the model length or the
pool's free blocks above the watermark run out; drafts never preempt), scheduled as 1 + k new tokens, its last
token and the draft at their positions, with blocks for them until the step's results are
applied (BlockManager.trim). Prompt chunks get what the drafts leave.
"""
from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from pdserve.engine.kv.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.speculator import Speculator


class StepKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(slots=True)
class ScheduledBatch:
    kind: StepKind
    seqs: list[Sequence]
    num_new_tokens: list[int]   # tokens computed per sequence this step
    num_decode_seqs: int        # the first num_decode_seqs entries are decodes
    # Per decode (the first entries; missing ones: none): the draft tokens it verifies this step.
    # Such a decode computes 1 + len(draft) tokens: its last token, then the draft.
    drafts: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))

    def draft(self, i: int) -> list[int]:
        """The draft tokens seqs[i] verifies this step ([]: none)."""
        return self.drafts[i] if i < len(self.drafts) else []


@dataclass(slots=True)
class StepTrace:
    """What one step did: read by tests and benchmarks."""

    step: int
    kind: StepKind
    request_ids: list[str]
    num_tokens: list[int]
    num_prefill_tokens: int
    num_decode_seqs: int
    blocks_in_use: int
    num_preemptions: int
    preempted: list[str] = field(default_factory=list)
    num_draft_tokens: int = 0   # speculative tokens verified (in num_tokens, not prompt tokens)


POLICIES = ("prefill_first", "interleave", "mixed")


def _order(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.queue_key


DEFAULT_PROMPT_S_PER_TOKEN = 1e-3   # prompt_order "shortest" before the engine has learned its prefill speed


@dataclass(slots=True)
class Claim:
    """A reservation of class priority that found the pool full: free blocks it needs, until expires."""

    priority: int
    blocks: int
    expires: float


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 held: Callable[[str], bool] | None = None, speculator: Speculator | None = None,
                 max_model_len: int | None = None) -> None:
        """held(request_id): the KV connector holds the request's blocks (never preempted).
        speculator: drafts for decoding sequences (speculative decoding; None: off); max_model_len:
        the longest sequence (drafts stop short of it)."""
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()   # by (priority, queue_key); FIFO within equal keys
        self.running: list[Sequence] = []     # admission order: the last is the youngest
        self.last_kind: StepKind | None = None
        self.num_preemptions = 0
        self.num_priority_preemptions = 0     # of those, to admit a waiting sequence of a higher class
        self.claim: Claim | None = None       # a higher-class reservation waiting for room
        self.held = held or (lambda request_id: False)
        self.speculator = speculator
        self.max_model_len = max_model_len or config.max_model_len or 1 << 62
        self._preempted_this_step: list[str] = []
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        # Prompt tokens a step that also decodes may hold (None: the step budget). The engine
        # updates it from its learned step costs where the config leaves it to the role.
        self.prompt_tokens_with_decodes = config.prompt_tokens_with_decodes
        # Seconds one prompt token takes to compute (prompt_order "shortest"; the engine updates it
        # from its learned step costs).
        self.prompt_s_per_token = DEFAULT_PROMPT_S_PER_TOKEN

    # ---- queue management -------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue seq behind the waiting sequences of higher classes, and in its own class behind
        those that came first (fcfs) or that would finish alone before it would (shortest)."""
        seq.queue_key = (seq.arrival_time + seq.num_pending_tokens * self.prompt_s_per_token
                         if self.config.prompt_order == "shortest" else 0.0)
        self.waiting.insert(bisect_right(self.waiting, _order(seq), key=_order), seq)

    def add_running(self, seq: Sequence) -> None:
        """Decode role: a sequence whose KV arrived from elsewhere joins the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued_prompt_tokens(self) -> int:
        return sum(s.num_pending_tokens for s in self.waiting) + sum(
            s.num_pending_tokens for s in self.running if s.is_prefilling)

    # ---- scheduling -------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._preempted_this_step = []
        prefill_pending = bool(self.waiting) or any(s.is_prefilling for s in self.running)
        decoders = [s for s in self.running if not s.is_prefilling]
        policy = self.config.policy
        if policy == "mixed":
            batch = self._build(decode=True, prefill=True)
        elif (policy == "interleave" and self.last_kind is StepKind.PREFILL
              and prefill_pending and decoders):
            batch = self._build(decode=True, prefill=False)
        elif prefill_pending:
            batch = self._build(decode=False, prefill=True)
            if batch is None and decoders:   # prompts could not be admitted: keep decoders moving
                batch = self._build(decode=True, prefill=False)
        else:
            batch = self._build(decode=True, prefill=False)
        if batch is not None:
            self.last_kind = batch.kind
        return batch

    def _build(self, decode: bool, prefill: bool) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        drafts: list[list[int]] = []
        self._preempt_for_claim()
        if prefill:
            self._preempt_for_waiting()
        if decode:
            budget = self._schedule_decodes(seqs, counts, budget)
            if self.speculator is not None:
                budget = self._schedule_drafts(seqs, counts, drafts, budget)
        n_decode = len(seqs)
        if prefill:
            if n_decode and self.prompt_tokens_with_decodes is not None:
                budget = min(budget, self.prompt_tokens_with_decodes)
            self._schedule_prefills(seqs, counts, budget)
        if not seqs:
            return None
        if n_decode == len(seqs):
            kind = StepKind.DECODE
        elif n_decode == 0:
            kind = StepKind.PREFILL
        else:
            kind = StepKind.MIXED
        return ScheduledBatch(kind, seqs, counts, n_decode, drafts)

    def _schedule_decodes(self, seqs: list[Sequence], counts: list[int], budget: int) -> int:
        """Schedule each running decoder (seqs comes empty); returns the budget left."""
        for seq in list(self.running):
            if len(seqs) >= budget:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            if not self._make_room_for(seq, seqs, counts):
                continue   # seq itself was preempted
            seqs.append(seq)
            counts.append(1)
        return budget - len(seqs)

    def _schedule_drafts(self, seqs: list[Sequence], counts: list[int], drafts: list[list[int]],
                         budget: int) -> int:
        """A draft for each scheduled decode, as deep as the speculator finds it pays, while the
        budget lasts (drafts: filled, one entry per decode); returns the budget left."""
        bm = self.block_manager
        # tokens each may still emit, less the one a verification always emits
        rooms = [min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
                 for seq in seqs]
        for i, (seq, draft) in enumerate(zip(seqs, self.speculator.drafts(seqs, rooms, budget))):
            if draft:
                draft = draft[:bm.append_lookahead(seq, len(draft), keep_free=self.watermark_blocks)]
            drafts.append(draft)
            counts[i] += len(draft)
            budget -= len(draft)
        return budget

    def _make_room_for(self, seq: Sequence, seqs: list[Sequence], counts: list[int]) -> bool:
        """Ensure seq has a slot for its next token, preempting others if needed (_growth_victim),
        a victim already in this step's decodes taken out of them. False: seq itself was preempted."""
        bm = self.block_manager
        while True:
            try:
                bm.append_slot(seq)
                return True
            except NoFreeBlocks:
                victim = self._growth_victim(seq)
                if victim in seqs:
                    i = seqs.index(victim)
                    del seqs[i], counts[i]
                self._preempt(victim)
                if victim is seq:
                    return False

    def _growth_victim(self, seq: Sequence) -> Sequence:
        """Whom a decode that finds the pool empty preempts: the lowest class (the highest priority
        value), and within it the last admitted; seq itself, possibly. All classes equal: the youngest."""
        candidates = [(s.priority, i) for i, s in enumerate(self.running) if s is seq or not self.held(s.request_id)]
        return self.running[max(candidates)[1]]

    def _preempt_for_waiting(self) -> None:
        """The first waiting sequence, if the pool cannot hold it, takes the blocks of running
        sequences of a lower class: the lowest class and the latest arrival first, until it fits.
        None is preempted when all of them together would not make room; a sequence of its own
        class or a higher one never is."""
        if not self.waiting or self._fits(self.waiting[0]):
            return
        head = self.waiting[0]
        victims = sorted((s for s in self.running if s.priority > head.priority and not self.held(s.request_id)),
                         key=lambda s: (s.priority, s.arrival_time), reverse=True)
        if not victims or not self._fits(head, self._blocks_freed_by(victims), len(self.running) - len(victims)):
            return
        for victim in victims:
            self._preempt(victim)
            self.num_priority_preemptions += 1
            if self._fits(head):
                return

    def lower_class_blocks(self, priority: int) -> int:
        """Blocks that preempting every running sequence of a class below priority would free."""
        return self._blocks_freed_by([s for s in self.running if s.priority > priority and not self.held(s.request_id)])

    def _preempt_for_claim(self) -> None:
        """Make room for a claim: preempt running sequences of lower classes (the lowest class and
        the latest arrival first) until the pool has its free blocks; an expired claim is dropped."""
        claim = self.claim
        if claim is None:
            return
        if time.monotonic() >= claim.expires:
            self.claim = None
            return
        victims = sorted((s for s in self.running if s.priority > claim.priority and not self.held(s.request_id)),
                         key=lambda s: (s.priority, s.arrival_time), reverse=True)
        for victim in victims:
            if self.block_manager.num_free_blocks >= claim.blocks:
                return
            self._preempt(victim)
            self.num_priority_preemptions += 1

    def _fits(self, seq: Sequence, freed: int = 0, num_running: int | None = None) -> bool:
        """Whether admission (_schedule_prefills) finds blocks for seq, with freed more blocks free
        and num_running sequences running (default: the pool and the batch as they are)."""
        bm = self.block_manager
        num_running = len(self.running) if num_running is None else num_running
        reserve = self.watermark_blocks if num_running else 0
        return bm.num_free_blocks + freed - bm.blocks_needed(seq.num_tokens) >= reserve

    def _blocks_freed_by(self, seqs: list[Sequence]) -> int:
        """Blocks that freeing all of seqs returns to the pool (those no other sequence shares)."""
        refs = Counter(b for s in seqs for b in s.block_table)
        return sum(1 for b, n in refs.items() if self.block_manager.blocks[b].ref_count == n)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: blocks freed, seq waits ahead of its class to be prefilled again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.queue_key = float("-inf")
        self.waiting.insert(bisect_left(self.waiting, _order(seq), key=_order), seq)
        self.num_preemptions += 1
        self._preempted_this_step.append(seq.request_id)

    def _schedule_prefills(self, seqs: list[Sequence], counts: list[int], budget: int) -> None:
        """Continue prompts mid-prefill and admit waiting ones while tokens, sequence slots and
        blocks last. fcfs: those under way first, oldest first, then the waiting queue. shortest:
        both by their key, a started prompt's from the tokens it has left (_remaining_order), so a
        burst's short prompts pass a long one already under way instead of waiting for its last
        chunk; it is passed only by prompts that came before it would have finished alone."""
        started = [s for s in self.running if s.is_prefilling]   # seqs holds decodes only so far
        shortest = self.config.prompt_order == "shortest"
        if shortest:
            started.sort(key=self._remaining_order)
        i = 0   # the first waiting sequence not passed over (its blocks on their way from disk)
        admitting = True
        while budget > 0:
            head = None
            if admitting:
                i = self._next_admissible(i)
                admitting = i is not None
                head = self.waiting[i] if admitting else None
            if started and (head is None or not shortest or self._remaining_order(started[0]) <= _order(head)):
                seq = started.pop(0)
            elif head is not None:
                if not self._admit(head):
                    admitting = False
                    continue
                del self.waiting[i]
                seq = head
            else:
                return
            n = min(seq.num_pending_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n

    def _remaining_order(self, seq: Sequence) -> tuple[int, float]:
        """A started prompt's place among waiting ones under prompt_order "shortest": its arrival
        plus the time its remaining tokens take alone (a waiting prompt's queue_key, for what is left)."""
        return seq.priority, seq.arrival_time + seq.num_pending_tokens * self.prompt_s_per_token

    def _next_admissible(self, i: int) -> int | None:
        """The index of the first waiting sequence from i on that may be admitted now, passing over
        those whose cached blocks are on their way from disk; None when admission stops here (no
        sequence slot, a higher-class claim's room, the blocks running decoders grow into)."""
        bm = self.block_manager
        while i < len(self.waiting):
            seq = self.waiting[i]
            if not bm.ready(seq):
                i += 1   # its cached blocks are on their way from disk: the next ones go first
                continue
            if len(self.running) >= self.config.max_num_seqs:
                return None
            if self.claim is not None and seq.priority > self.claim.priority:
                return None      # the room made for a higher-class reservation stays free for it
            # Leave a little room for running decoders to grow, or admission and preemption thrash.
            if self.running and bm.num_free_blocks - bm.blocks_needed(seq.num_tokens) < self.watermark_blocks:
                return None
            return i
        return None

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence its blocks and make it running (the caller takes it out of the
        waiting queue); False if the pool cannot hold it."""
        try:
            # a prompt being scored is computed from its first unscored position on
            seq.num_computed_tokens = self.block_manager.allocate(seq, seq.next_prompt_score)
        except NoFreeBlocks:
            return False
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    # ---- after the step ---------------------------------------------------------
    def trace(self, step: int, batch: ScheduledBatch) -> StepTrace:
        n_decode = batch.num_decode_seqs
        return StepTrace(
            step=step,
            kind=batch.kind,
            request_ids=[s.request_id for s in batch.seqs],
            num_tokens=list(batch.num_new_tokens),
            num_prefill_tokens=batch.num_tokens - n_decode - batch.num_draft_tokens,
            num_decode_seqs=n_decode,
            blocks_in_use=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
            num_preemptions=len(self._preempted_this_step),
            preempted=list(self._preempted_this_step),
            num_draft_tokens=batch.num_draft_tokens,
        )
