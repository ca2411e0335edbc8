"""A request's state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # queued, holds no blocks
    RECEIVING = "receiving"    # decode role: blocks reserved, KV arriving from a prefill worker
    RUNNING = "running"        # holds blocks, prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids plus bookkeeping. KV exists for token_ids[:num_computed_tokens]."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0       # prompt tokens served by the prefix cache at admission
    num_hashed_blocks: int = 0       # leading blocks whose chain hash is known
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    in_flight: bool = False          # in the forward pass running now: its blocks are freed after it
    arrival_time: float = field(default_factory=time.monotonic)
    # Its place in the scheduler's waiting queue within its priority class (engine/scheduler.py):
    # 0 in arrival order; under prompt_order "shortest" its arrival plus its prompt's estimated
    # time alone; -inf once preempted (ahead of its class).
    queue_key: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Its prefix blocks' background read from the disk KV tier (engine/kv/tiers.py): None before
    # the scheduler first asked, a Future while it runs, True once done or not needed.
    tier_load: object = None
    # What a speculative proposer keeps of this sequence between steps, and its acceptance
    # estimate and counts (engine/spec_decode/depth.py DraftState).
    proposer_state: object = None
    draft_state: object = None
    # Its structured-output constraint's matcher (engine/structured/state.py GrammarState), advanced
    # by every token it keeps; None without a constraint.
    grammar: object = None
    # SamplingParams.prompt_logprobs: entry k is prompt token k's TokenLogprob (entry 0 None: nothing
    # precedes it), filled as the prompt is computed; None when not asked, or once reported
    prompt_logprobs: list | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def priority(self) -> int:
        """Its class: lower is served first, and may preempt a higher value (engine/scheduler.py)."""
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to be computed; 1 means the sequence is decoding."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def next_prompt_score(self) -> int | None:
        """The first position whose prompt logprob row is still to be computed (position p scores
        prompt token p + 1); None when no prompt token waits for one."""
        scores = self.prompt_logprobs
        return None if scores is None or len(scores) >= self.num_prompt_tokens else len(scores) - 1

    @property
    def is_prefilling(self) -> bool:
        """Computing tokens it was given, not one it sampled: more than one pending, or the last
        given one (a chunk that left one prompt token; a prompt cached but for one token) before
        its first token in this engine. Such a sequence belongs in the prefill part of a step:
        counted a decoder, prefill_first would starve it while other prompts keep coming."""
        return self.num_pending_tokens > 1 or (self.first_token_time is None and self.num_pending_tokens == 1)
