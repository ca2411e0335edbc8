"""The step-level engine both worker roles drive.

role "both":    prompts are prefilled and decoded here (offline LLM, colocated worker).
role "prefill": a prompt is prefilled, its first token sampled, and its blocks stay pinned
                until release(); step outputs list blocks ready for export after each chunk.
role "decode":  reserve() blocks for a prompt whose KV arrives from elsewhere,
                write_kv_block() as blocks land, admit() to join continuous batching.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.block_manager import BlockManager, NoFreeBlocks
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, StepTrace
from engine.sequence import Sequence, SequenceStatus
from engine.validation import validate_request


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None       # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prefill_done: bool = False              # prefill role: KV complete, blocks pinned
    ready_blocks: list[int] = field(default_factory=list)   # prefill role: block indices exportable now
    queue_s: float | None = None            # on the first token: arrival -> first scheduled
    prefill_s: float | None = None          # on the first token: first scheduled -> first token


class NoCapacity(RuntimeError):
    """The decode pool cannot reserve blocks for this prompt now."""


@dataclass(slots=True)
class Reservation:
    seq: Sequence
    needed: set[int]
    expires_at: float


class LLMEngine:
    def __init__(self, config: EngineConfig, trace_limit: int = 10_000) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.eos_token_ids = set(self.model_config.eos_token_ids) | _generation_eos(config.model)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.runner = ModelRunner(config, self.model_config)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Sequence] = {}
        self.pinned: dict[str, Sequence] = {}
        self.reservations: dict[str, Reservation] = {}
        self.trace: deque[StepTrace] = deque(maxlen=trace_limit)
        self.num_steps = 0
        self._reservation_lock = threading.Lock()

    # ---- validation -------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        total = len(prompt_token_ids) + params.max_tokens
        need = self.block_manager.blocks_needed(total)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks, more than num_kv_blocks ({self.block_manager.num_blocks})")

    # ---- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.config.role == "decode":
            raise RuntimeError("a decode-role engine takes requests through reserve()/admit()")
        self._check_new_id(request_id)
        self.validate_request(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.pinned:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. Returns whether it was found."""
        with self._reservation_lock:   # no KV write may land in blocks being freed
            seq = self.requests.pop(request_id, None) or self.pinned.pop(request_id, None)
            if seq is None:
                return False
            self.reservations.pop(request_id, None)
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.expire_reservations()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        self.num_steps += 1
        self.trace.append(self.scheduler.trace(self.num_steps, batch))
        tokens = self.runner.run(batch)
        now = time.monotonic()
        outputs = []
        for seq, n, tok in zip(batch.seqs, batch.num_new_tokens, tokens):
            seq.num_computed_tokens += n
            self.block_manager.mark_computed(seq)
            if tok is None:
                if self.config.role == "prefill":
                    outputs.append(self._prefill_progress(seq))
                continue
            seq.token_ids.append(tok)
            reason = self._stop_reason(seq, tok)
            if self.config.role == "prefill":
                out = self._finish_prefill(seq, tok, reason)
            else:
                if reason is not None:
                    self._finish(seq, reason)
                out = RequestOutput(seq.request_id, [tok], reason is not None, reason,
                                    seq.num_prompt_tokens, seq.num_cached_tokens)
            if seq.first_token_time is None:
                seq.first_token_time = now
                out.queue_s = (seq.first_scheduled_time or now) - seq.arrival_time
                out.prefill_s = now - (seq.first_scheduled_time or now)
            outputs.append(out)
        return outputs

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.requests.pop(seq.request_id, None)

    # ---- prefill role -----------------------------------------------------------
    def _ready_blocks(self, seq: Sequence, final: bool) -> list[int]:
        bs = self.config.block_size
        done = -(-seq.num_computed_tokens // bs) if final else seq.num_computed_tokens // bs
        ready = list(range(seq.num_ready_blocks, done))
        seq.num_ready_blocks = done
        return ready

    def _prefill_progress(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, [], False, None, seq.num_prompt_tokens, seq.num_cached_tokens,
                             ready_blocks=self._ready_blocks(seq, final=False))

    def _finish_prefill(self, seq: Sequence, tok: int, reason: str | None) -> RequestOutput:
        """The prompt's KV is complete: pin its blocks for export until release()."""
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.pinned[seq.request_id] = seq
        return RequestOutput(seq.request_id, [tok], reason is not None, reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, prefill_done=True, ready_blocks=self._ready_blocks(seq, final=True))

    def block_ids(self, request_id: str) -> list[int]:
        seq = self.pinned.get(request_id) or self.requests[request_id]
        return list(seq.block_table)

    def block_hashes(self, request_id: str) -> list[int]:
        """Chain hashes of the request's full prompt blocks."""
        seq = self.pinned.get(request_id) or self.requests[request_id]
        return list(seq.block_hashes)

    def read_kv_blocks(self, request_id: str, block_indices: list[int]) -> torch.Tensor:
        table = self.block_ids(request_id)
        return self.runner.read_blocks([table[i] for i in block_indices])

    def release(self, request_id: str) -> bool:
        """Prefill role: the blocks were delivered; they fall back to the prefix cache."""
        seq = self.pinned.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    # ---- decode role ----------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                timeout_s: float = 30.0) -> list[int]:
        """Reserve blocks for the whole prompt. Returns the block indices that must be sent
        (those not already computed in this pool's prefix cache). Raises NoCapacity."""
        self._check_new_id(request_id)
        self.validate_request(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, status=SequenceStatus.RECEIVING)
        # Keep room for the decode tokens of sequences already running plus this one's first block.
        try:
            cached = self.block_manager.allocate(seq, max_cached_tokens=seq.num_tokens)
        except NoFreeBlocks as exc:
            raise NoCapacity(str(exc)) from exc
        seq.num_cached_tokens = cached
        seq.first_scheduled_time = time.monotonic()
        needed = set(range(cached // self.config.block_size, len(seq.block_table)))
        self.requests[request_id] = seq
        self.reservations[request_id] = Reservation(seq, needed, time.monotonic() + timeout_s)
        return sorted(needed)

    def write_kv_block(self, request_id: str, block_index: int, data: torch.Tensor) -> None:
        """Store one received block. Safe to call from a thread other than the one stepping the
        engine: reserved blocks belong to no running sequence, and the lock keeps the write and
        the reservation's release (abort, expiry, admission) apart. So arriving KV never waits
        for a step to end."""
        if tuple(data.shape) != self.runner.block_shape:
            raise ValueError(f"block shape {tuple(data.shape)} != expected {self.runner.block_shape}")
        with self._reservation_lock:
            res = self.reservations.get(request_id)
            if res is None:
                raise KeyError(f"no reservation for request {request_id!r}")
            if block_index not in res.needed:
                raise ValueError(f"block {block_index} of {request_id!r} was not requested or already written")
            self.runner.write_block(res.seq.block_table[block_index], data)
            res.needed.discard(block_index)

    def admit(self, request_id: str, first_token: int, params: SamplingParams | None = None) -> str | None:
        """All blocks arrived: the sequence joins the running batch with its first token.
        params (optional) replace the reservation's; returns a finish reason if the first
        token already ends the request (its blocks are then freed)."""
        with self._reservation_lock:
            res = self.reservations.get(request_id)
            if res is None:
                raise KeyError(f"no reservation for request {request_id!r}")
            if res.needed:
                raise ValueError(f"request {request_id!r} still misses blocks {sorted(res.needed)}")
            self._admit_checks(res, first_token, params)
            del self.reservations[request_id]
        seq = res.seq
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.mark_computed(seq)
        seq.token_ids.append(first_token)
        seq.first_token_time = time.monotonic()
        reason = self._stop_reason(seq, first_token)
        if reason is not None:
            self._finish(seq, reason)
            return reason
        self.scheduler.add_running(seq)
        return None

    def _admit_checks(self, res: Reservation, first_token: int, params: SamplingParams | None) -> None:
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} is outside the vocabulary")
        if params is not None:
            params.validate()
            if params.max_tokens > res.seq.params.max_tokens:
                raise ValueError(f"max_tokens {params.max_tokens} exceeds the reserved {res.seq.params.max_tokens}")
            res.seq.params = params

    def expire_reservations(self) -> list[str]:
        now = time.monotonic()
        expired = [rid for rid, r in self.reservations.items() if r.expires_at < now]
        for rid in expired:
            self.abort(rid)
        return expired

    # ---- introspection ----------------------------------------------------------
    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "num_total_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_reserved": len(self.reservations),
            "num_pinned": len(self.pinned),
            "num_queued_prompt_tokens": self.scheduler.num_queued_prompt_tokens,
        }


def _generation_eos(model_dir: str) -> set[int]:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}
