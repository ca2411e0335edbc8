"""The multi-turn load generator's pure parts (services/loadtest/multi_turn.py): session plans,
each turn's prompt from the previous prompt, answer and new tokens, a session's run against a
scripted backend, and the per-turn report arithmetic (no server)."""
from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.services.loadtest.datasets import MIN_TOKEN_ID, SampleRequest
from pdserve.services.loadtest.multi_turn import (MultiTurnOptions, SessionOutcome, SessionRun, TurnResult, next_prompt,
                                          per_turn, plan_sessions, request_fields, run_sessions, summarise)
from pdserve.services.loadtest.openai_backend import OpenAIBackend, cached_tokens
from pdserve.services.loadtest.results import RequestResult, Sampling

OPTS = MultiTurnOptions(turns=3, first_input_len=20, input_len=5, output_len=4, think_time_s=0.5)


def test_plans_are_deterministic_by_seed_with_exact_lengths_and_valid_ids() -> None:
    plans = plan_sessions(OPTS, 3, vocab_size=100, seed=7, eos_token_id=0)
    again = plan_sessions(OPTS, 3, vocab_size=100, seed=7, eos_token_id=0)
    other = plan_sessions(OPTS, 3, vocab_size=100, seed=8, eos_token_id=0)
    assert [(p.first_prompt, p.new_tokens, p.think_s) for p in plans] == \
        [(p.first_prompt, p.new_tokens, p.think_s) for p in again]
    assert plans[0].first_prompt != other[0].first_prompt
    assert plans[0].first_prompt != plans[1].first_prompt          # each session its own tokens
    # a session does not depend on how many there are
    assert plan_sessions(OPTS, 1, 100, seed=7)[0].first_prompt == plans[0].first_prompt
    for p in plans:
        assert p.turns == 3 and len(p.first_prompt) == 20 and [len(t) for t in p.new_tokens] == [5, 5]
        assert len(p.think_s) == 2 and all(t >= 0 for t in p.think_s)
        assert all(MIN_TOKEN_ID <= t < 100 for t in p.first_prompt + sum(p.new_tokens, []))
        assert [p.new_len(k) for k in (1, 2, 3)] == [20, 5, 5]
    no_think = plan_sessions(MultiTurnOptions(turns=3, think_time_s=0), 1, 100)[0]
    assert no_think.think_s == [0.0, 0.0]


def test_turn_k_prompt_is_the_previous_prompt_then_the_answer_ids_then_new_tokens() -> None:
    plan = plan_sessions(OPTS, 1, vocab_size=100, seed=1)[0]
    p1 = plan.prompt(1)
    assert p1 == plan.first_prompt and p1 is not plan.first_prompt
    a1 = [90, 91, 92, 93]
    p2 = plan.prompt(2, p1, a1)
    assert p2 == p1 + a1 + plan.new_tokens[0] and len(p2) == 20 + 4 + 5
    a2 = [80, 81]
    p3 = plan.prompt(3, p2, a2)
    assert p3[:len(p2)] == p2 and p3[len(p2):len(p2) + 2] == a2 and p3[len(p2) + 2:] == plan.new_tokens[1]
    assert next_prompt([1], [2], [3]) == [1, 2, 3]
    assert OPTS.max_total_len == 20 + 2 * (4 + 5) + 4


@pytest.mark.parametrize("kwargs", [{"turns": 0}, {"first_input_len": 0}, {"input_len": -1}, {"output_len": 0},
                                    {"think_time_s": -1.0}, {"think_time_s": math.nan}])
def test_options_refuse_impossible_sessions(kwargs) -> None:
    with pytest.raises(ValueError):
        MultiTurnOptions(**kwargs)


class _ScriptedBackend:
    """Answers every request with answer(req) as token ids; records what it was sent."""

    def __init__(self, answer, fail_turn: int | None = None) -> None:
        self.answer, self.fail_turn, self.sent = answer, fail_turn, []

    async def send(self, req: SampleRequest, request_id: str, sampling: Sampling, bench_start: float) -> RequestResult:
        self.sent.append((req, request_id))
        if req.kind == f"turn{self.fail_turn}":
            return RequestResult(prompt_len=req.prompt_len, error="UNAVAILABLE: gone")
        ids = self.answer(req)
        return RequestResult(success=True, prompt_len=req.prompt_len, output_len=len(ids), ttft=0.01, latency=0.02,
                             token_ids=ids, cached_tokens=req.prompt_len - 3)


def _run(backend, n: int = 2) -> SessionRun:
    plans = plan_sessions(MultiTurnOptions(turns=3, first_input_len=20, input_len=5, output_len=4, think_time_s=0),
                          n, vocab_size=100, seed=3)
    return asyncio.run(run_sessions("unused", plans, rate=math.inf, backend=backend))


def test_a_session_sends_its_answers_back_exactly_and_carries_its_id() -> None:
    backend = _ScriptedBackend(lambda req: [len(req.prompt) % 50 + 2] * 4)
    run = _run(backend)
    assert [s.error for s in run.sessions] == ["", ""] and [s.turns_done for s in run.sessions] == [3, 3]
    assert len(run.turns) == 6
    by_session: dict[str, list[SampleRequest]] = {}
    for req, rid in backend.sent:
        by_session.setdefault(req.session_id, []).append(req)
        assert rid.startswith(req.session_id) and rid.endswith(req.kind.replace("turn", "-t"))
    assert len(by_session) == 2
    for reqs in by_session.values():
        assert [r.kind for r in reqs] == ["turn1", "turn2", "turn3"]
        assert [r.prompt_len for r in reqs] == [20, 29, 38] and all(r.prompt_len == len(r.prompt) for r in reqs)
        for prev, cur in zip(reqs, reqs[1:]):
            answer = [len(prev.prompt) % 50 + 2] * 4
            assert cur.prompt[:len(prev.prompt) + 4] == prev.prompt + answer
    assert all(t.recomputed == 3 for t in run.turns) and [t.new_tokens for t in run.turns if t.turn == 1] == [20, 20]
    fields = request_fields(run.turns)
    assert sorted(fields["turns"]) == [1, 1, 2, 2, 3, 3] and len(set(fields["session_ids"])) == 2


def test_a_failed_turn_or_an_answer_without_ids_ends_its_session() -> None:
    run = _run(_ScriptedBackend(lambda req: [5, 6], fail_turn=2))
    assert all(s.turns_done == 1 and s.error.startswith("turn 2: UNAVAILABLE") for s in run.sessions)
    assert sorted(t.turn for t in run.turns) == [1, 1, 2, 2]
    run = _run(_ScriptedBackend(lambda req: []), n=1)
    assert run.sessions[0].turns_done == 1 and "no answer token ids" in run.sessions[0].error
    assert len(run.turns) == 1


def _turn(turn: int, ttft: float, prompt: int, cached: int | None, new: int, ok: bool = True) -> TurnResult:
    res = RequestResult(success=ok, prompt_len=prompt, output_len=4 if ok else 0, ttft=ttft, latency=ttft + 0.3,
                        cached_tokens=cached, error="" if ok else "x")
    return TurnResult("s", turn, new, res)


def test_per_turn_rows_and_the_summary_arithmetic() -> None:
    turns = [_turn(1, 0.1, 100, 0, 100), _turn(1, 0.3, 100, 16, 100),
             _turn(2, 0.2, 150, 144, 10), _turn(2, 0.4, 150, None, 10), _turn(2, 9.0, 150, 0, 10, ok=False),
             _turn(3, 0.5, 200, None, 10)]
    rows = {r["turn"]: r for r in per_turn(turns)}
    assert rows[1]["count"] == 2 and rows[1]["failed"] == 0
    assert rows[1]["ttft_p50_ms"] == pytest.approx(200.0) and rows[1]["ttft_p99_ms"] == pytest.approx(298.0)
    assert rows[1]["mean_prompt_tokens"] == 100 and rows[1]["mean_cached_tokens"] == 8
    assert rows[1]["mean_recomputed_tokens"] == 92 and rows[1]["mean_new_tokens"] == 100
    assert rows[2]["count"] == 2 and rows[2]["failed"] == 1 and rows[2]["cached_reported"] == 1
    assert rows[2]["ttft_p50_ms"] == pytest.approx(300.0)                 # the failed turn is left out
    assert rows[2]["mean_recomputed_tokens"] == 6 and rows[2]["mean_cached_tokens"] == 144
    assert rows[3]["mean_recomputed_tokens"] is None and rows[3]["mean_cached_tokens"] is None
    run = SessionRun(turns, [SessionOutcome("a", 3), SessionOutcome("b", 1, "turn 2: x")], duration=2.0)
    s = summarise(run)
    assert (s["sessions"], s["sessions_completed"], s["sessions_failed"]) == (2, 1, 1)
    assert s["completed"] == 5 and s["failed"] == 1 and s["session_errors"] == ["turn 2: x"]
    assert s["total_output_tokens"] == 20 and s["output_throughput"] == 10.0 and s["request_throughput"] == 2.5
    assert s["total_input_tokens"] == 700 and [r["turn"] for r in s["per_turn"]] == [1, 2, 3]


def test_openai_backend_asks_for_token_ids_and_sends_the_session_only_when_told() -> None:
    req = SampleRequest([5, 6], 2, 4, session_id="sess-1")
    plain = OpenAIBackend("http://127.0.0.1:1", model="m").payload(req, Sampling())
    assert "return_token_ids" not in plain and "session_id" not in plain
    body = OpenAIBackend("http://127.0.0.1:1", model="m", send_session_id=True,
                         return_token_ids=True).payload(req, Sampling())
    assert body["return_token_ids"] is True and body["session_id"] == "sess-1"
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 32}}) == 32
    assert cached_tokens({"prompt_tokens": 5}) is None and cached_tokens(None) is None
    assert cached_tokens({"prompt_tokens_details": None}) is None


def test_openai_stream_collects_answer_ids_and_cached_tokens() -> None:
    backend = OpenAIBackend("http://127.0.0.1:1", model="m", return_token_ids=True)

    async def events():
        yield 0.1, '{"choices": [{"text": "", "token_ids": [7]}]}'        # ids without text yet: a token
        yield 0.2, '{"choices": [{"text": "ab", "token_ids": [8, 9], "finish_reason": "length"}]}'
        yield 0.3, ('{"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, '
                    '"prompt_tokens_details": {"cached_tokens": 0}}}')
        yield 0.4, "[DONE]"

    res = RequestResult(prompt_len=2)
    done = asyncio.run(backend._read(res, SampleRequest([5, 6], 2, 3), events(), 0.0))
    assert done and res.token_ids == [7, 8, 9] and res.output_len == 3 and res.cached_tokens == 0
    assert res.ttft == pytest.approx(0.1) and len(res.itl) == 1


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
