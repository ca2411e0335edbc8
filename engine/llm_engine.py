"""The step-level engine every worker role drives; it has no role of its own.

Prompts are prefilled and decoded here. What a role adds lives in the KV connector
(engine/kv/connector.py), which the engine calls at fixed points: a prefill worker's connector
exports each computed chunk and, once the first token is sampled, keeps the sequence's blocks
pinned until release(); on a decode worker reserve() allocates blocks for a sequence whose KV
arrives from elsewhere, the connector verifies and stores each block, and admit() joins the
sequence to continuous batching.

Concurrency: one lock guards the scheduler, the block pool and the hand-off state. step()
holds it while it schedules and while it applies the results, never during the forward
pass, so add_request, abort, reserve and KV writes from other threads take effect at once
and new work joins the next step. A request aborted while its step runs has its blocks
freed when that forward pass ends.

Speculative decoding (config.speculative_config, engine/spec_decode): a decode that verified a
draft gets the token sampled after each of its rows; the draft's tokens are accepted while they
equal those, then the model's own token follows, each token through the stop checks in turn
(nothing is emitted past a stop or max_tokens). Its computed tokens are then the accepted ones
only, and the blocks of the rejected slots go back to the pool: the prefix cache and the KV
hand-off only ever see verified tokens.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from typing import Sequence as Seq

from pdserve.engine.kv.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.parallel import RankFailure
from pdserve.engine.config import ROLES, EngineConfig
from pdserve.engine.kv.connector import KVConnector
from pdserve.engine.kv.handoff import LeasePolicy, Reservation
from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.kv.events import KVEventBatch, KVEventLog
from pdserve.engine.kv.tier_file import kv_fingerprint
from pdserve.engine.kv.tiers import WRITE_QUEUE_BYTES, DiskTier, KVTiers, no_tier_stats
from pdserve.engine.logprobs import TokenLogprob, logprob_of
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Claim, ScheduledBatch, Scheduler, StepTrace
from pdserve.engine.structured import Grammars
from pdserve.engine.step_cost import DECODE_FIT_DECAY, MIN_SPREAD_SEQS, StepCost
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.speculator import Speculator, request_counts
from pdserve.engine.spec_decode.verify import verify
from pdserve.engine.validation import validate_request

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None       # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prefill_done: bool = False              # prefill role: the sampled token is in; blocks pinned
    ready_blocks: list[int] = field(default_factory=list)   # prefill role: block indices exportable now
    queue_s: float | None = None            # on the first token: arrival -> first scheduled
    prefill_s: float | None = None          # on the first token: first scheduled -> first token
    logprobs: list[TokenLogprob] | None = None   # per new token, when the request asked (params.logprobs)
    # with the first token, when the request asked (params.prompt_logprobs) and this engine computed
    # its prompt: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # on the last output of a request when this engine speculates: its (drafts, draft tokens,
    # accepted tokens) here (engine/spec_decode/speculator.py request_counts)
    spec_counts: tuple[int, int, int] | None = None


class NoCapacity(RuntimeError):
    """The decode pool cannot reserve blocks for this sequence now."""


# A decode worker's prompt chunk (a local prefill) may lengthen a decode step by this share:
# the inter-token gaps it makes stay below the tail that decoding alone has (p99 ~2x p50 here).
PROMPT_CHUNK_STEP_SHARE = 0.5
CLAIM_S = 2.0        # a higher-class reservation's claim on a full pool lasts this long unless asked again
LOAD_WAIT_S = 0.05   # an idle step waits this long at most for a prompt's blocks read ahead from disk


class LLMEngine:
    def __init__(self, config: EngineConfig, trace_limit: int = 10_000, lease: LeasePolicy | None = None,
                 runner: ModelRunner | None = None, model_config: ModelConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """runner, model_config, clock: given by the planner's simulator (a runner that prices a
        step instead of computing it, a model known from a profile, the simulated time its steps
        take, which the step costs learn from); by default read from config.model, and the wall
        clock."""
        self.config = config
        self.model_config = model_config or ModelConfig.from_dir(config.model)
        self.eos_token_ids = set(self.model_config.eos_token_ids) | _generation_eos(config.model)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.runner = runner if runner is not None else ModelRunner(config, self.model_config)
        self._auto_step_tokens = config.max_num_batched_tokens is None
        self._resolve_step_tokens()
        self.grammars = Grammars(config.model, self.model_config.vocab_size, self.eos_token_ids)
        self.kv_events = KVEventLog()
        self.kv_tiers = tiers_for(config, self.runner)   # host RAM / disk under the prefix cache, or None
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          events=self.kv_events, tiers=self.kv_tiers)
        self.step_cost = StepCost()          # steps that compute prompt tokens, by tokens computed
        # decode-only steps, by sequences: a slope over a spread of a sequence or two needs more steps
        self.decode_step_cost = StepCost(decay=DECODE_FIT_DECAY, min_spread=MIN_SPREAD_SEQS)
        self.lock = threading.RLock()
        self.kv = KVConnector(KVBlockPool(self.block_manager, self.runner), self.lock, config.role, lease)
        spec = config.speculative_config
        self.speculator = Speculator(spec) if spec is not None else None
        self.scheduler = Scheduler(config, self.block_manager, held=self.kv.owns,   # blocks in hand-off: kept
                                   speculator=self.speculator, max_model_len=self.max_model_len)
        self._learn_prompt_chunk = config.prompt_tokens_with_decodes is None and self.kv.paces_local_prompts
        self.requests: dict[str, Sequence] = {}     # sequences the scheduler holds
        self.trace: deque[StepTrace] = deque(maxlen=trace_limit)
        self.num_steps = 0
        self.clock = clock

    # ---- validation -------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Seq[int], params: SamplingParams,
                         output_token_ids: Seq[int] = ()) -> None:
        validate_request(list(prompt_token_ids), params, self.model_config.vocab_size, self.max_model_len,
                         output_token_ids=list(output_token_ids))
        need = self.block_manager.blocks_needed(len(prompt_token_ids) + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks, more than num_kv_blocks ({self.block_manager.num_blocks})")

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                      output_token_ids: Seq[int]) -> Sequence:
        if request_id in self.requests or self.kv.owns(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params, output_token_ids)
        seq = Sequence(request_id, [*prompt_token_ids, *output_token_ids], params,
                       num_prompt_tokens=len(prompt_token_ids))
        if params.prompt_logprobs is not None and not output_token_ids:
            seq.prompt_logprobs = [None]   # a migrated request's prompt was scored where it began
        if params.structured_outputs is not None:   # compiled before, off the caller's loop: compile_grammar
            seq.grammar = self.grammars.state(params.structured_outputs, output_token_ids)
        return seq

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile params' structured-output constraint into the cache (StructuredError if it does
        not compile): a caller on an event loop runs this on a thread first, so that adding the
        request finds it compiled."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    # ---- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    output_token_ids: Seq[int] = ()) -> None:
        """Queue a request; it joins the next step. output_token_ids: tokens it already generated
        elsewhere (a migrated request): they are prefilled with the prompt and count towards max_tokens."""
        with self.lock:
            seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids)
            self.requests[request_id] = seq
            self.kv.on_add(seq)
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. Returns whether it was found."""
        with self.lock:
            seq = self.requests.get(request_id)
            if seq is not None:
                self._drop(seq, "abort")
                return True
            return self.kv.abort(request_id)

    def _fail_everything(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self.kv.fail_all("UNAVAILABLE", "a tensor-parallel rank of this worker died")

    def check_ranks(self) -> None:
        """Between steps: raise RankFailure, after failing every request and freeing its blocks, if a
        tensor-parallel rank process died (a step would raise it too; this notices it while idle)."""
        try:
            self.runner.check_ranks()
        except RankFailure:
            with self.lock:
                self._fail_everything()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel ranks this engine started and write out the blocks queued for
        the disk KV tier (idempotent)."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def _drop(self, seq: Sequence, reason: str) -> None:
        """End a sequence: out of the scheduler, blocks freed (after its forward pass, if one is running)."""
        self._end(seq, reason)
        self.kv.on_drop(seq.request_id)
        if not seq.in_flight:
            self.block_manager.free(seq)

    def _end(self, seq: Sequence, reason: str | None) -> None:
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if self.speculator is not None:
            self.speculator.finished(seq)

    def _resolve_step_tokens(self) -> None:
        """A step budget the config leaves to the engine (None), set for its role and device in
        the engine's config (where set_role writes the role too), which the scheduler reads."""
        if self._auto_step_tokens:
            device = getattr(self.runner, "device", None)   # the planner's simulated runner: a CPU
            self.config.max_num_batched_tokens = self.config.default_step_tokens(device is None or device.type == "cpu")

    def prompt_chunk_with_decodes(self) -> int:
        """A decode worker's prompt chunk while sequences decode (a prompt the router had it
        prefill locally): as many prompt tokens as take PROMPT_CHUNK_STEP_SHARE of a decode
        step's time, by its learned step costs, so a chunk lengthens the step each decoding
        sequence waits for by about that share. At least one block; one block until it has both
        decoded and computed a prompt."""
        bs = self.config.block_size
        if not (self.step_cost.fitted and self.decode_step_cost.fitted):
            return bs
        base_ms, ms_per_seq = self.decode_step_cost.coefficients()
        _, ms_per_token = self.step_cost.coefficients()
        decode_step_ms = base_ms + ms_per_seq * max(1, len(self.scheduler.running))
        return max(bs, round(PROMPT_CHUNK_STEP_SHARE * decode_step_ms / ms_per_token))

    def prompt_chunk_tokens(self) -> int:
        """Prompt tokens one step computes here (the router's estimate of a prompt's steps): the
        step budget, or less while sequences decode (a decode worker prefilling a prompt locally)."""
        budget = self.config.max_num_batched_tokens
        chunk = self.scheduler.prompt_tokens_with_decodes
        return budget if chunk is None or self.config.role != "decode" else min(budget, chunk)

    # ---- the step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = self.clock()
        with self.lock:
            self.kv.expire()
            if self._learn_prompt_chunk:
                self.scheduler.prompt_tokens_with_decodes = self.prompt_chunk_with_decodes()
            if self.config.prompt_order == "shortest" and self.step_cost.fitted:
                self.scheduler.prompt_s_per_token = self.step_cost.coefficients()[1] / 1e3
            batch = self.scheduler.schedule()
            if batch is not None:
                self.num_steps += 1
                self.trace.append(self.scheduler.trace(self.num_steps, batch))
                for seq in batch.seqs:
                    seq.in_flight = True
        if batch is None:   # nothing to run now; a prompt may wait for its blocks from disk
            if self.kv_tiers is not None:
                self.kv_tiers.wait_for_loads(LOAD_WAIT_S)
            return []
        try:
            result = self.runner.run(batch, self.eos_token_ids)
        except RankFailure:
            # A tensor-parallel rank died: this worker cannot step again. Free every request's
            # blocks (nothing waits on them) and let the caller fail or restart the worker.
            with self.lock:
                for seq in batch.seqs:
                    seq.in_flight = False
                self._fail_everything()
            raise
        finally:
            with self.lock:
                for seq in batch.seqs:
                    seq.in_flight = False
                    if seq.status is SequenceStatus.FINISHED:   # dropped while its step ran
                        self.block_manager.free(seq)
        with self.lock:
            outputs = self._apply(batch, result.tokens, result.prompt_logprobs)
            ms = (self.clock() - t0) * 1e3
            if batch.num_decode_seqs < len(batch.seqs):
                self.step_cost.observe(batch.num_tokens, ms)
            else:
                if not batch.num_draft_tokens:   # plain decodes: the marginal cost of a sequence
                    self.decode_step_cost.observe(batch.num_decode_seqs, ms)
                if self.speculator is not None:   # any decode step: the marginal cost of a row
                    self.speculator.observe_step(batch.num_tokens, ms)
            return outputs

    def _apply(self, batch: ScheduledBatch, tokens: list,
               prompt_logprobs: dict[int, list[TokenLogprob]]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for i, (seq, n, tok) in enumerate(zip(batch.seqs, batch.num_new_tokens, tokens)):
            if seq.status is SequenceStatus.FINISHED:
                continue
            if i in prompt_logprobs:
                seq.prompt_logprobs.extend(prompt_logprobs[i])
            draft = batch.draft(i)
            if draft:
                outputs.append(self._apply_verified(seq, draft, tok))
                continue
            seq.num_computed_tokens += n
            self.block_manager.mark_computed(seq)
            if tok is None:
                ready = self.kv.on_chunk(seq)
                if ready is not None:
                    outputs.append(RequestOutput(seq.request_id, [], False, None, seq.num_prompt_tokens,
                                                 seq.num_cached_tokens, ready_blocks=ready))
                continue
            logprob, tok = logprob_of(tok), int(tok)
            seq.token_ids.append(tok)
            reason = self._advance_grammar(seq, tok) or self._stop_reason(seq, tok)
            ready = self.kv.on_first_token(seq)
            if ready is not None:   # the connector holds the blocks now: the sequence ends here
                self._end(seq, reason)
                out = RequestOutput(seq.request_id, [tok], reason is not None, reason, seq.num_prompt_tokens,
                                    seq.num_cached_tokens, prefill_done=True, ready_blocks=ready)
            else:
                if reason is not None:
                    self._drop(seq, reason)
                out = RequestOutput(seq.request_id, [tok], reason is not None, reason,
                                    seq.num_prompt_tokens, seq.num_cached_tokens)
            if logprob is not None:
                out.logprobs = [logprob]
            if seq.prompt_logprobs is not None and seq.next_prompt_score is None:   # reported once
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            if seq.first_token_time is None:
                seq.first_token_time = now
                out.queue_s = (seq.first_scheduled_time or now) - seq.arrival_time
                out.prefill_s = now - (seq.first_scheduled_time or now)
            outputs.append(self._with_spec_counts(seq, out))
        return outputs

    def _with_spec_counts(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        if out.finished and self.speculator is not None:
            out.spec_counts = request_counts(seq)
        return out

    def _apply_verified(self, seq: Sequence, draft: list[int], targets: list[int]) -> RequestOutput:
        """A decode that verified draft: targets[j] is the token sampled after its row j. Emits the
        accepted draft tokens and the model's next one, stopping at the first stop token,
        max_tokens or max_model_len; KV stays for the emitted tokens but the last, the rest's
        blocks go back (BlockManager.trim)."""
        emitted = verify(draft, targets)
        self.speculator.verified(seq, len(draft), len(emitted) - 1)
        new: list[int] = []
        logprobs = []
        reason = None
        for tok in emitted:
            logprobs.append(logprob_of(tok))
            new.append(int(tok))
            seq.token_ids.append(new[-1])
            reason = self._advance_grammar(seq, new[-1]) or self._stop_reason(seq, new[-1])
            if reason is not None:
                break
        # KV is valid for every input row up to the last emitted token's predecessor: the last
        # token before the step and the accepted draft tokens
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.mark_computed(seq)
        self.block_manager.trim(seq)
        if reason is not None:
            self._drop(seq, reason)
        out = RequestOutput(seq.request_id, new, reason is not None, reason, seq.num_prompt_tokens,
                            seq.num_cached_tokens)
        if logprobs[0] is not None:
            out.logprobs = logprobs
        return self._with_spec_counts(seq, out)

    @staticmethod
    def _advance_grammar(seq: Sequence, tok: int) -> str | None:
        """Its grammar past tok. The sampler only picks allowed tokens; one that is not ends the
        request ("stop") rather than let it leave its grammar."""
        if seq.grammar is None or seq.grammar.accept(tok):
            return None
        log.error("request %s: token %d is outside its grammar; it ends here", seq.request_id, tok)
        return "stop"

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.terminated:   # its grammar took a stop token: complete
            return "stop"
        if seq.num_output_tokens >= p.min_tokens and (
                tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- the KV hand-off (engine/kv/connector.py) ------------------------------------------
    def release(self, request_id: str) -> bool:
        """Prefill role: the pinned blocks were delivered; they fall back to the prefix cache."""
        with self.lock:
            return self.kv.release(request_id)

    def reserve(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                output_token_ids: Seq[int] = (), lease_s: float | None = None) -> Reservation:
        """Reserve blocks for the sequence (prompt + tokens already generated) whose KV arrives
        from a prefill worker. Blocks this pool holds computed are shared and not shipped.
        Raises NoCapacity (keeping room for the running sequences to grow) or ValueError. A
        sequence of a higher class than some running ones that does not fit leaves a claim: the
        next steps preempt those (engine/scheduler.py), and the reservation asked again fits."""
        with self.lock:
            seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids)
            seq.prompt_logprobs = None   # its prompt is computed, and scored, where its KV comes from
            headroom = max(self.scheduler.watermark_blocks, len(self.scheduler.running))
            scheduler = self.scheduler
            try:
                reservation = self.kv.reserve(seq, lease_s, reserve_blocks=headroom)
            except NoFreeBlocks as exc:
                need = self.block_manager.blocks_needed(seq.num_tokens) + headroom
                if scheduler.lower_class_blocks(seq.priority) + self.block_manager.num_free_blocks >= need \
                        and (scheduler.claim is None or seq.priority <= scheduler.claim.priority):
                    scheduler.claim = Claim(seq.priority, need, time.monotonic() + CLAIM_S)
                    raise NoCapacity(f"{exc}; sequences of lower classes are being preempted for it") from exc
                raise NoCapacity(f"{exc} (keeping {headroom} for running sequences)") from exc
            if scheduler.claim is not None and seq.priority <= scheduler.claim.priority:
                scheduler.claim = None   # the room was for this class: it is taken
            return reservation

    def admit(self, request_id: str, first_token: int) -> str | None:
        """Every block arrived and verified: the sequence joins the running batch with the token
        the prefill side sampled. Returns a finish reason if that token already ends the request
        (its blocks are then freed). Raises HandoffError if the KV is not ready or failed."""
        with self.lock:
            if not 0 <= first_token < self.model_config.vocab_size:
                self.kv.fail(request_id, "INVALID_ARGUMENT", f"first token {first_token} is outside the vocabulary")
                raise ValueError(f"first_token_id {first_token} is outside the vocabulary [0, "
                                 f"{self.model_config.vocab_size})")
            seq = self.kv.take_ready(request_id)
            seq.num_computed_tokens = seq.num_tokens
            self.block_manager.mark_computed(seq)   # verified blocks join the prefix cache now
            seq.token_ids.append(first_token)
            seq.first_token_time = time.monotonic()
            reason = self._advance_grammar(seq, first_token) or self._stop_reason(seq, first_token)
            if reason is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.block_manager.free(seq)
                return reason
            self.requests[request_id] = seq
            self.scheduler.add_running(seq)
            return None

    # ---- role --------------------------------------------------------------------
    def busy_reasons(self) -> list[str]:
        """What keeps this engine from switching roles, as "N what" phrases ([]: it is idle):
        sequences queued or computing, KV reserved or being received, blocks pinned for sending."""
        with self.lock:
            kv = self.kv.stats()
            counts = (("waiting", len(self.scheduler.waiting)), ("running", len(self.scheduler.running)),
                      ("reserved/receiving KV", kv["num_reserved"]), ("pinned for sending", kv["num_pinned"]))
            return [f"{n} {what}" for what, n in counts if n]

    def set_role(self, role: str) -> None:
        """Switch this engine's role in place, the model and the KV pool (its prefix cache too)
        kept: the KV connector's side, and the step policy where the config leaves it to the role
        (schedule_policy "auto": prefill_first on prefill, mixed elsewhere; one set explicitly
        stays). Only while idle: raises ValueError naming what is still here, or the bad role."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        with self.lock:
            busy = self.busy_reasons()
            if busy:
                raise ValueError(f"cannot switch role {self.config.role!r} -> {role!r} while requests are here: "
                                 f"{', '.join(busy)}")
            self.kv.set_role(role)
            self.config.role = role
            self._resolve_step_tokens()
            self._learn_prompt_chunk = self.config.prompt_tokens_with_decodes is None and self.kv.paces_local_prompts
            self.scheduler.prompt_tokens_with_decodes = self.config.prompt_tokens_with_decodes
            self.scheduler.last_kind = None

    # ---- introspection ----------------------------------------------------------
    def read_kv_events(self, cursor: int | None) -> KVEventBatch:
        """Prefix-cache keys stored / tiered / removed since cursor (None: a snapshot of every key)."""
        with self.lock:
            return self.kv_events.read(cursor, self.block_manager.computed_keys, self.block_manager.tiered_keys)

    def stats(self) -> dict[str, int]:
        with self.lock:
            bm = self.block_manager
            return {
                "num_total_blocks": bm.num_blocks,
                "num_free_blocks": bm.num_free_blocks,
                "prefix_cache_queries": bm.prefix_cache_queries,
                "prefix_cache_hits": bm.prefix_cache_hits,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_priority_preemptions": self.scheduler.num_priority_preemptions,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                **self.kv.stats(),
                "num_queued_prompt_tokens": self.scheduler.num_queued_prompt_tokens,
                **(self.kv_tiers.stats() if self.kv_tiers is not None else no_tier_stats()),
                **(self.speculator.stats if self.speculator is not None else SpecDecodeStats()).as_dict(),
            }


def _generation_eos(model_dir: str) -> set[int]:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def tiers_for(config: EngineConfig, runner: ModelRunner) -> KVTiers | None:
    """The tiers config asks for, over runner's pool; None when there are none (or no prefix cache)."""
    if not config.enable_prefix_caching or not (config.kv_host_cache_bytes or config.kv_disk_cache_dir):
        return None
    disk = None
    if config.kv_disk_cache_dir:
        shape = tuple(runner.block_shape)
        compute = str(runner.compute_dtype).removeprefix("torch.")
        kernels = f"{runner.device.type}|{runner.backend.name}|batch-invariant={runner.batch_invariant}"
        fingerprint = kv_fingerprint(config.model, runner.kv_dtype_name, compute, config.quantization, shape, kernels)
        disk = DiskTier(config.kv_disk_cache_dir, config.kv_disk_cache_bytes, fingerprint, shape, runner.dtype,
                        queue_blocks=WRITE_QUEUE_BYTES // max(1, runner.kv_bytes_per_block))
    return KVTiers(runner.read_blocks, runner.write_blocks, config.kv_host_cache_bytes, disk)
