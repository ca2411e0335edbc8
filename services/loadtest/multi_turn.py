"""``pdserve bench serve --dataset-name multi-turn``: conversations of several turns whose shared
history grows, each sent as a session.

A session is ``turns`` requests in sequence. Turn 1's prompt is ``first_input_len`` random tokens;
turn k's is turn k-1's prompt, then turn k-1's answer as the server generated it (its exact token
ids, so a server that kept the answer's KV can reuse it), then ``input_len`` new random tokens.
Every answer asks for ``output_len`` tokens. Turn k is sent when turn k-1 has ended plus a think
time (exponential with mean ``think_time_s``; 0: none). Sessions arrive at the request rate
(sessions/s; gamma gaps of shape burstiness, Poisson at 1, as ``run_load``'s requests do);
``max_concurrency`` caps the sessions in flight. Every request carries its session id
(SampleRequest.session_id). A failed turn ends its session, and so does an answer without token
ids (the server did not return them: the next prompt could not be exact); either counts the
session as failed.

The random tokens (TokenSource, as the random dataset's) and think times come from one generator
per session, seeded by (seed, session index): the same seed gives the same sessions against every
server, up to the answers, which are the server's (greedy decoding with ignore_eos makes their
lengths equal).

Per turn number the summary gives the successful turns, TTFT p50/p99, mean prompt tokens, mean
cached prompt tokens as the server reported them (None when it did not), mean tokens recomputed
(prompt - cached) and mean new tokens, what an ideal server computes: all of turn 1, the
``input_len`` new user tokens of a later turn (the answer's KV was made while it was decoded;
strictly its last token's KV never is, and a cache of whole blocks rounds down, so a real server
computes a little more). Overall: sessions completed / failed, requests, output tokens, and
request and output token throughput over the run (first session's arrival to the last turn's end).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pdserve.services.loadtest.arrivals import arrival_offsets
from pdserve.services.loadtest.datasets import SampleRequest, TokenSource
from pdserve.services.loadtest.grpc_backend import GrpcBackend
from pdserve.services.loadtest.results import RequestResult, Sampling
from pdserve.services.loadtest.run import LoadProgress, not_closed


@dataclass(slots=True)
class MultiTurnOptions:
    turns: int = 4
    first_input_len: int = 256    # tokens of turn 1's prompt
    input_len: int = 64           # new user tokens of each later turn
    output_len: int = 128         # tokens of every answer
    think_time_s: float = 1.0     # mean pause between an answer and the next turn; 0: none

    def __post_init__(self) -> None:
        if self.turns < 1 or self.first_input_len < 1 or self.input_len < 0 or self.output_len < 1:
            raise ValueError(f"multi-turn needs turns >= 1, first input >= 1, input >= 0 and output >= 1 tokens, "
                             f"got {self.turns}, {self.first_input_len}, {self.input_len}, {self.output_len}")
        if not self.think_time_s >= 0:
            raise ValueError(f"multi-turn think time must be >= 0 s, got {self.think_time_s}")

    @property
    def max_total_len(self) -> int:
        """Prompt + answer tokens of the last turn when every answer is full length."""
        return self.first_input_len + (self.turns - 1) * (self.output_len + self.input_len) + self.output_len


@dataclass(slots=True)
class SessionPlan:
    """One conversation's own tokens and pauses, drawn before the run; the answers are the server's."""

    index: int
    first_prompt: list[int]
    new_tokens: list[list[int]]     # the user's tokens of turns 2, 3, ...
    think_s: list[float]            # the pause before turns 2, 3, ...
    output_len: int

    @property
    def turns(self) -> int:
        return 1 + len(self.new_tokens)

    def new_len(self, turn: int) -> int:
        """Tokens of turn (1-based) an ideal server computes: its prompt's tokens not seen before."""
        return len(self.first_prompt) if turn == 1 else len(self.new_tokens[turn - 2])

    def prompt(self, turn: int, previous_prompt: Sequence[int] = (), answer: Sequence[int] = ()) -> list[int]:
        """Turn 1's prompt, or turn k's from turn k-1's prompt and answer."""
        if turn == 1:
            return list(self.first_prompt)
        return next_prompt(previous_prompt, answer, self.new_tokens[turn - 2])


def next_prompt(previous_prompt: Sequence[int], answer: Sequence[int], new_tokens: Sequence[int]) -> list[int]:
    """The next turn's prompt: the history so far, the answer's exact ids, the user's new tokens."""
    return [*previous_prompt, *answer, *new_tokens]


def plan_sessions(opts: MultiTurnOptions, num_sessions: int, vocab_size: int, seed: int = 0,
                  eos_token_id: int | None = 0) -> list[SessionPlan]:
    """num_sessions plans, each from its own generator (seed, index): deterministic for a seed."""
    if num_sessions < 1:
        raise ValueError("multi-turn needs at least one session (--num-prompts)")
    plans = []
    for i in range(num_sessions):
        src = TokenSource(np.random.default_rng((seed, i)), vocab_size, eos_token_id)
        first = src.tokens(opts.first_input_len)
        new = [src.tokens(opts.input_len) for _ in range(opts.turns - 1)]
        think = (src.rng.exponential(opts.think_time_s, size=opts.turns - 1).tolist() if opts.think_time_s > 0
                 else [0.0] * (opts.turns - 1))
        plans.append(SessionPlan(i, first, new, think, opts.output_len))
    return plans


@dataclass(slots=True)
class TurnResult:
    """One request of a session, as the client saw it."""

    session_id: str
    turn: int                       # 1-based
    new_tokens: int                 # what an ideal server computes of this prompt
    result: RequestResult

    @property
    def recomputed(self) -> int | None:
        """Prompt tokens the server computed (prompt - cached); None when it did not report cached."""
        cached = self.result.cached_tokens
        return None if cached is None else self.result.prompt_len - cached


@dataclass(slots=True)
class SessionOutcome:
    session_id: str
    turns_done: int                 # successful turns
    error: str = ""                 # why it ended early; "" when every turn succeeded


@dataclass(slots=True)
class SessionRun:
    turns: list[TurnResult] = field(default_factory=list)          # in the order they were sent
    sessions: list[SessionOutcome] = field(default_factory=list)   # in plan order
    duration: float = 0.0


async def run_sessions(address: str, plans: Sequence[SessionPlan], *, rate: float, burstiness: float = 1.0,
                       max_concurrency: int | None = None, seed: int = 0, sampling: Sampling | None = None,
                       timeout: float | None = 600.0, tag: str = "mt", progress: LoadProgress | None = None,
                       backend=None) -> SessionRun:
    """Run every session at its arrival time through backend (an OpenAIBackend; None: the router's
    gRPC API at address). progress: told as each session ends."""
    sampling = sampling or Sampling()
    offsets = arrival_offsets(len(plans), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    run_id = uuid.uuid4().hex[:8]
    run = SessionRun()
    async with (GrpcBackend(address, timeout) if backend is None else not_closed(backend)) as client:
        start = time.perf_counter()

        async def session(plan: SessionPlan) -> SessionOutcome:
            delay = start + offsets[plan.index] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                out = await _converse(client, plan, f"{tag}-{run_id}-s{plan.index}", sampling, start, run)
            if progress is not None:
                progress.update(not out.error)
            return out

        try:
            run.sessions = list(await asyncio.gather(*(session(p) for p in plans)))
        finally:
            if progress is not None:
                progress.close()
        run.duration = time.perf_counter() - start
    run.turns.sort(key=lambda t: t.result.start_time)
    return run


async def _converse(client, plan: SessionPlan, session_id: str, sampling: Sampling, start: float,
                    run: SessionRun) -> SessionOutcome:
    prompt: list[int] = []
    answer: list[int] = []
    for turn in range(1, plan.turns + 1):
        if turn > 1 and plan.think_s[turn - 2] > 0:
            await asyncio.sleep(plan.think_s[turn - 2])
        prompt = plan.prompt(turn, prompt, answer)
        req = SampleRequest(prompt, len(prompt), plan.output_len, f"turn{turn}", session_id=session_id)
        res = await client.send(req, f"{session_id}-t{turn}", sampling, start)
        run.turns.append(TurnResult(session_id, turn, plan.new_len(turn), res))
        if not res.success:
            return SessionOutcome(session_id, turn - 1, f"turn {turn}: {res.error}")
        answer = list(res.token_ids)
        if not answer and turn < plan.turns:
            return SessionOutcome(session_id, turn, f"turn {turn}: the server returned no answer token ids, so "
                                                    f"the next prompt cannot extend the history exactly")
    return SessionOutcome(session_id, plan.turns)


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _pct(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if len(values) else None


def per_turn(turns: Sequence[TurnResult]) -> list[dict[str, Any]]:
    """One row per turn number: successful and failed turns, TTFT p50/p99 (ms), and the means of
    prompt, cached, recomputed and new tokens over the successful ones (cached and recomputed over
    those whose cached count the server reported; None when none did)."""
    rows = []
    for k in sorted({t.turn for t in turns}):
        these = [t for t in turns if t.turn == k]
        ok = [t for t in these if t.result.success]
        known = [t for t in ok if t.result.cached_tokens is not None]
        ttfts = [t.result.ttft * 1e3 for t in ok]
        rows.append({"turn": k, "count": len(ok), "failed": len(these) - len(ok),
                     "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
                     "mean_prompt_tokens": _mean([t.result.prompt_len for t in ok]),
                     "mean_cached_tokens": _mean([t.result.cached_tokens for t in known]),
                     "mean_recomputed_tokens": _mean([t.recomputed for t in known]),
                     "mean_new_tokens": _mean([t.new_tokens for t in ok]),
                     "cached_reported": len(known)})
    return rows


def summarise(run: SessionRun) -> dict[str, Any]:
    """Sessions, requests, throughput and the per-turn rows of one run."""
    ok = [t.result for t in run.turns if t.result.success]
    failed = [s for s in run.sessions if s.error]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    duration = run.duration or float("nan")
    return {"sessions": len(run.sessions), "sessions_completed": len(run.sessions) - len(failed),
            "sessions_failed": len(failed), "session_errors": [s.error for s in failed][:5],
            "completed": len(ok), "failed": len(run.turns) - len(ok), "duration": run.duration,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration, "per_turn": per_turn(run.turns)}


def request_fields(turns: Sequence[TurnResult]) -> dict[str, list]:
    """Per-request arrays for the saved JSON, in the order of the results."""
    return {"session_ids": [t.session_id for t in turns], "turns": [t.turn for t in turns],
            "cached_tokens": [t.result.cached_tokens for t in turns],
            "new_tokens": [t.new_tokens for t in turns]}
