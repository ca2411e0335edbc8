"""`pdserve plan --watch` (services/planner/watch.py): the router's metrics read as a window of
traffic, the split the simulator recommends for it, and when a change is made (hysteresis,
confirmations, dwell). The loop against a running deployment is in tests/e2e/test_membership.py."""
from __future__ import annotations

import dataclasses
import io
import math
from types import SimpleNamespace

import pytest

from pdserve.services.planner.plan import PlanConfig
from pdserve.services.planner.watch import Members, Planner, Scrape, Split, Traffic, WatchConfig, decide

SLOS = ("ttft:500", "tpot:60")


def metrics_text(success: int, prompt: int, generated: int, ttft: dict[str, int], failure: int = 0,
                 running: int = 0) -> str:
    """The router's /metrics as Prometheus text: two label sets per counter, a TTFT histogram."""
    lines = ["# HELP pdserve:request_success_total Requests finished normally"]
    for worker, share in (("router", 0.75), ("other", 0.25)):   # summed over labels
        lines += [f'pdserve:request_success_total{{model_name="m",role="router",worker="{worker}"}} {success * share}',
                  f'pdserve:prompt_tokens_total{{model_name="m",role="router",worker="{worker}"}} {prompt * share}',
                  f'pdserve:generation_tokens_total{{model_name="m",role="router",worker="{worker}"}} '
                  f'{generated * share}']
    lines.append(f'pdserve:request_failure_total{{model_name="m",role="router",worker="router"}} {failure}')
    lines.append(f'pdserve:num_requests_running{{model_name="m",role="router",worker="router"}} {running}')
    for le, count in ttft.items():
        lines.append(f'pdserve:time_to_first_token_seconds_bucket{{le="{le}",model_name="m",role="router",'
                     f'worker="router"}} {count}')
    return "\n".join(lines) + "\n"


def test_a_window_of_traffic_from_two_scrapes() -> None:
    old = Scrape.parse(metrics_text(10, 1000, 500, {"0.25": 5, "0.5": 8, "+Inf": 10}, running=1), at=100.0)
    new = Scrape.parse(metrics_text(40, 4000, 6500, {"0.25": 15, "0.5": 26, "+Inf": 40}, failure=2, running=9),
                       at=110.0)
    traffic = Traffic.between(old, new, {"ttft": 500.0, "tpot": 60.0})
    assert (traffic.seconds, traffic.requests, traffic.failures, traffic.backlog) == (10.0, 30.0, 2.0, 8.0)
    assert traffic.rate == 4.0   # arrivals: 30 finished, 2 failed, 8 more in flight than before
    assert "4.00 req/s arriving (3.00 finishing)" in traffic.describe()
    traffic.backlog = 0.0
    assert traffic.within["ttft"] == pytest.approx(18 / 30)    # buckets up to 0.5 s
    assert math.isnan(traffic.within["tpot"])                  # no TPOT observed in the window
    workload = traffic.workload(num_prompts=50, seed=3)
    assert (workload.rate, workload.input_len, workload.output_len, workload.num_prompts) == (3.2, 100, 200, 50)
    assert "2 failed" in traffic.describe()


def test_decode_heavy_traffic_moves_a_prefill_worker_to_decode(cost) -> None:
    plan = PlanConfig(profile="unused", num_prompts=100, slos=SLOS)
    heavy = Traffic(10.0, 300.0, 0.0, 300 * 16.0, 300 * 200.0)          # 30 req/s, 16 in / 200 out
    decision = decide(cost, plan, Split(2, 1), heavy, hysteresis=0.1)
    assert decision.best == Split(1, 2) and decision.change
    assert decision.predicted["1P2D"]["goodput"] > 1.1 * decision.predicted["2P1D"]["goodput"]
    assert "move to 1P2D" in decision.describe()
    same = decide(cost, plan, Split(1, 2), heavy, hysteresis=0.1)           # already there: keep
    assert same.best == Split(1, 2) and not same.change
    light = Traffic(10.0, 600.0, 0.0, 600 * 24.0, 600 * 10.0)             # short answers: a split barely matters
    assert not decide(cost, plan, Split(2, 1), light, hysteresis=0.1).change
    # --cores: the three workers share two cores, so every split is predicted slower than with a core each
    shared = decide(cost, dataclasses.replace(plan, cores=2), Split(2, 1), heavy, hysteresis=0.1)
    for split in ("1P2D", "2P1D"):
        assert shared.predicted[split]["ttft_p99_ms"] > decision.predicted[split]["ttft_p99_ms"]


def test_spares_size_the_deployment_to_the_fewest_workers_that_keep_the_target(cost) -> None:
    from tests.e2e.test_membership import decode_heavy
    plan = PlanConfig(profile="unused", num_prompts=60, slos=SLOS)
    busy = Traffic(20.0, 9.0, 0.0, 9 * 16.0, 9 * 100.0)                   # 0.45 req/s, 16 in / 100 out
    up = decide(decode_heavy(cost), plan, Split(1, 1), busy, hysteresis=0.1, spare=1)
    assert up.best == Split(1, 2) and up.change and up.describe().startswith("scale up to")
    assert set(up.predicted) == {"1P1D", "1P2D", "2P1D"}
    assert up.predicted["1P1D"]["attainment"] < 0.95 <= up.predicted["1P2D"]["attainment"]
    light = Traffic(10.0, 10.0, 0.0, 10 * 16.0, 10 * 8.0)                  # 1 req/s, 16 in / 8 out
    down = decide(cost, plan, Split(1, 2), light, hysteresis=0.1, removable=1)
    assert down.predicted["1P1D"]["attainment"] >= 0.95
    assert down.best == Split(1, 1) and down.change and down.describe().startswith("scale down to")
    # without spares nothing is sized: the same traffic only ever compares splits of the same workers
    assert decide(cost, plan, Split(1, 2), light, hysteresis=0.1).best.total == 3
    with pytest.raises(ValueError, match="spares"):
        WatchConfig(spares="127.0.0.1:1,nowhere")
    with pytest.raises(ValueError, match="target_attainment"):
        WatchConfig(target_attainment=1.5)
    assert WatchConfig(spares=" 127.0.0.1:1, [::1]:2 ").spare_addresses == ["127.0.0.1:1", "[::1]:2"]


def _members(prefill: int, decode: int) -> Members:
    def make(role: str, i: int) -> SimpleNamespace:
        return SimpleNamespace(address=f"127.0.0.1:{i + 1}", role=role, inflight=i, max_num_batched_tokens=2048)
    return Members([make("prefill", i) for i in range(prefill)], [make("decode", 10 + i) for i in range(decode)], 0)


def test_a_change_waits_for_its_confirmations_and_the_dwell_time(cost) -> None:
    now = [0.0]
    out = io.StringIO()
    watch = WatchConfig(interval_s=1, confirmations=2, min_dwell_s=30, apply=True, min_window_requests=5)
    planner = Planner(cost, PlanConfig(profile="unused", num_prompts=100, slos=SLOS), watch, None, out,
                      clock=lambda: now[0])
    applied: list[tuple[str, str]] = []
    planner.apply = lambda decision, members: applied.append((decision.current.name, decision.best.name))
    heavy = Traffic(10.0, 300.0, 0.0, 300 * 16.0, 300 * 200.0)
    assert planner.window(Traffic(10.0, 2.0, 0.0, 32.0, 400.0), _members(2, 1)) is None   # too few requests
    assert planner.window(heavy, _members(2, 1)).change and applied == []                  # confirmed 1 of 2
    planner.window(heavy, _members(2, 1))
    assert applied == [("2P1D", "1P2D")]
    now[0] = 10.0                                                                           # inside the dwell time
    planner.window(heavy, _members(3, 1))
    planner.window(heavy, _members(3, 1))
    assert len(applied) == 1 and "min dwell" in out.getvalue()
    now[0] = 45.0
    planner.window(heavy, _members(3, 1))
    assert len(applied) == 2
    assert planner.window(heavy, SimpleNamespace(colocated=2, prefill=[], decode=[],
                                                 split=Split(0, 0))) is None               # colocated: nothing to do
    assert '"applied": true' in out.getvalue()


def test_without_apply_the_planner_only_says_what_it_would_do(cost) -> None:
    out = io.StringIO()
    planner = Planner(cost, PlanConfig(profile="unused", num_prompts=100, slos=SLOS),
                      WatchConfig(confirmations=1, min_dwell_s=0), None, out)
    planner.apply = lambda *a: pytest.fail("applied without --apply")
    assert planner.window(Traffic(10.0, 300.0, 0.0, 300 * 16.0, 300 * 200.0), _members(2, 1)).change
    assert "not applied: --apply is off" in out.getvalue()


def test_watch_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="--router"):
        WatchConfig(watch=True)
    with pytest.raises(ValueError, match="interval_s"):
        WatchConfig(interval_s=0)
    with pytest.raises(ValueError, match="confirmations"):
        WatchConfig(confirmations=-1)
