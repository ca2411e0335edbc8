"""Multi-turn sessions in the router (services/router/sessions.py): the table's TTL, bound and
off switch; the session's worker may prefill a turn under --disaggregation always, when the cost
model finds that cheaper, and the load policy tries it first; the session id's limits."""
from __future__ import annotations

import pytest

from pdserve.services.router.placement import Placement
from pdserve.services.router.prefix_index import request_keys
from pdserve.services.router.routes import SessionTable
from pdserve.services.router.slo import MAX_CLIENT_CHARS, ServiceClass
from tests.services.router.test_routing_unit import PROMPT, _pool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_turns_worker_is_remembered_for_the_ttl_then_forgotten() -> None:
    clock = Clock()
    table = SessionTable(ttl_s=10.0, max_sessions=8, clock=clock)
    assert table.worker("s") is None
    table.turn_ended("s", "127.0.0.1:21")
    clock.now += 9.9
    assert table.worker("s") == "127.0.0.1:21"
    table.turn_ended("s", "127.0.0.1:22")   # a later turn ended elsewhere: that worker, a fresh TTL
    clock.now += 9.9
    assert table.worker("s") == "127.0.0.1:22"
    clock.now += 0.2
    assert table.worker("s") is None and len(table) == 0
    table.turn_ended("", "127.0.0.1:21")     # no session key: nothing remembered
    assert len(table) == 0


def test_the_table_is_bounded_least_recently_used_first() -> None:
    table = SessionTable(ttl_s=60.0, max_sessions=2)
    for key in ("a", "b", "c"):
        table.turn_ended(key, f"w-{key}")
    assert len(table) == 2 and table.worker("a") is None and table.worker("c") == "w-c"


def test_ttl_zero_turns_sessions_off_and_bad_settings_are_refused() -> None:
    table = SessionTable(ttl_s=0, max_sessions=1)
    table.turn_ended("s", "w")
    assert not table.enabled and table.worker("s") is None
    for ttl, size in ((-1.0, 1), (1.0, 0)):
        with pytest.raises(ValueError):
            SessionTable(ttl, size)


def test_the_session_key_is_the_session_id_else_the_user_and_is_limited() -> None:
    assert ServiceClass(client="alice", session="chat-7").session_key == "chat-7"
    assert ServiceClass(client="alice").session_key == "alice"
    with pytest.raises(ValueError, match=f"session_id must be a string of at most {MAX_CLIENT_CHARS}"):
        ServiceClass(session="x" * (MAX_CLIENT_CHARS + 1))


def test_the_sessions_decode_worker_prefills_a_turn_it_mostly_holds_under_always() -> None:
    """Always mode: remote routes only, but the session's worker, holding the prompt's blocks
    but the last, prefills it itself (one block, against eight on the prefill worker)."""
    with _pool(["127.0.0.1:11"], ["127.0.0.1:21", "127.0.0.1:22"]) as pool:
        keys = request_keys(PROMPT, 8)
        holder = pool.of_role("decode")[1]
        holder.index.apply(False, keys[:-1], ())
        placement = Placement(pool, "kv-aware", "always")
        assert not any(r.local for r in placement.decode_routes(keys, len(PROMPT), 16))
        routes = placement.decode_routes(keys, len(PROMPT), 16, session_worker=holder.address)
        assert routes[0].decode is holder and routes[0].local and routes[0].local_ms < routes[0].remote_ms
        assert not routes[1].local   # another worker: still remote
        # the session's worker holding nothing of it: prefilling there costs what it costs on the
        # prefill worker plus the delay to its decoders, so the prompt stays remote
        other = pool.of_role("decode")[0]
        other.status.num_running = 8
        far = [r for r in placement.decode_routes(keys, len(PROMPT), 16, session_worker=other.address)
               if r.decode is other]
        assert far and not far[0].local


def test_the_load_policy_tries_the_sessions_worker_first() -> None:
    with _pool(["127.0.0.1:11"], ["127.0.0.1:21", "127.0.0.1:22"]) as pool:
        busy = pool.of_role("decode")[0]
        busy.inflight = 3
        placement = Placement(pool, "load", "always")
        assert placement.decode_routes([], len(PROMPT), 16)[0].decode is not busy
        assert placement.decode_routes([], len(PROMPT), 16, session_worker=busy.address)[0].decode is busy


def test_a_prefix_held_in_a_kv_tier_is_priced_as_a_load_not_a_recompute() -> None:
    """The prefill worker holding the prompt in its host tier beats one holding nothing, by the
    recompute it saves less the load it costs (its measured ms per block), and loses to one
    holding it in its pool."""
    with _pool(["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"], ["127.0.0.1:21"]) as pool:
        keys = request_keys(PROMPT, 8)
        pooled, tiered, empty = pool.of_role("prefill")
        pooled.index.apply(False, keys, ())
        tiered.index.apply(False, (), (), keys)
        for w in pool.workers:
            w.status.kv_tier_load_ms_per_block = 0.1   # 8 tokens recomputed: 0.4 ms and more
        assert tiered.index.matched_blocks(keys) == len(keys) and tiered.index.tiered_blocks(keys) == len(keys)
        placement = Placement(pool, "kv-aware")
        costs = {w.address: placement._prefill_cost(w, keys, len(PROMPT)) for w in (pooled, tiered, empty)}
        assert costs[pooled.address] < costs[tiered.address] < costs[empty.address], costs
        assert costs[tiered.address] - costs[pooled.address] == pytest.approx(0.1 * len(keys))
        assert placement.pick_prefill(keys, len(PROMPT))[0] is pooled
        pooled.index.apply(False, (), keys)                     # the pool copy is gone: the tier wins
        assert placement.pick_prefill(keys, len(PROMPT))[0] is tiered
        tiered.index.apply(False, keys, ())                     # back in its pool: no load to price
        assert tiered.index.tiered_blocks(keys) == 0 and placement.tier_load_ms(tiered, keys) == 0.0
