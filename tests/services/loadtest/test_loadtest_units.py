"""The load generator's pure parts: the arrival schedule, the summary statistics, goodput counting,
SLO parsing, the classification of a request's outcome and the failures counted by kind (no server)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.services.loadtest.arrivals import arrival_offsets
from pdserve.services.loadtest.metrics import calculate_metrics, parse_goodput, parse_slo, percentile_key, server_breakdown
from pdserve.services.loadtest.report import print_errors
from pdserve.services.loadtest.results import MAX_ERROR_KIND_CHARS, RequestResult, error_counts, settle


def _ok(ttft: float, latency: float, n_out: int, prompt_len: int = 10, itl: list[float] | None = None) -> RequestResult:
    gaps = itl if itl is not None else [(latency - ttft) / max(n_out - 1, 1)] * (n_out - 1)
    return RequestResult(success=True, prompt_len=prompt_len, output_len=n_out, ttft=ttft, latency=latency, itl=gaps)


def test_arrivals_start_at_zero_rise_and_repeat_for_a_seed() -> None:
    a = arrival_offsets(200, rate=4.0, seed=3)
    assert a[0] == 0.0 and len(a) == 200 and all(x <= y for x, y in zip(a, a[1:]))
    assert a == arrival_offsets(200, rate=4.0, seed=3) and a != arrival_offsets(200, rate=4.0, seed=4)
    assert arrival_offsets(5, math.inf) == [0.0] * 5 and arrival_offsets(0, 2.0) == []


def test_arrival_gaps_have_mean_one_over_rate_and_burstiness_sets_their_spread() -> None:
    n, rate = 20_000, 5.0
    poisson = np.diff(arrival_offsets(n, rate, burstiness=1.0, seed=0))
    bursty = np.diff(arrival_offsets(n, rate, burstiness=0.25, seed=0))
    smooth = np.diff(arrival_offsets(n, rate, burstiness=4.0, seed=0))
    for gaps in (poisson, bursty, smooth):
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # gamma(k, 1/(rate k)): coefficient of variation 1/sqrt(k)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (2.0, 0.0)])
def test_arrivals_refuse_a_rate_or_burstiness_not_above_zero(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)


def test_summary_statistics_are_numpys_over_successful_requests_in_ms() -> None:
    results = [_ok(0.1, 1.0, 10), _ok(0.2, 2.0, 10), _ok(0.3, 3.1, 5), _ok(0.4, 0.4, 1),
               RequestResult(success=False, prompt_len=7, error="x")]
    m = calculate_metrics(results, duration=4.0, percentiles=(50, 90, 99.9))
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 26
    ttfts = np.array([0.1, 0.2, 0.3, 0.4]) * 1e3
    assert m["mean_ttft_ms"] == pytest.approx(ttfts.mean()) and m["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert m["std_ttft_ms"] == pytest.approx(ttfts.std())
    for p in (50, 90, 99.9):
        assert m[f"{percentile_key(p)}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p))
    tpots = np.array([0.9 / 9, 1.8 / 9, 2.8 / 4]) * 1e3          # the 1-token request has no TPOT
    assert m["mean_tpot_ms"] == pytest.approx(tpots.mean())
    itls = np.array([0.1] * 9 + [0.2] * 9 + [0.7] * 4) * 1e3      # every gap of every request
    assert m["mean_itl_ms"] == pytest.approx(itls.mean()) and m["p90_itl_ms"] == pytest.approx(np.percentile(itls, 90))
    assert m["median_e2el_ms"] == pytest.approx(np.median([1000, 2000, 3100, 400]))
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 6.5
    assert m["total_token_throughput"] == pytest.approx((40 + 26) / 4) and m["request_goodput"] is None


def test_no_successful_request_summarises_as_zeros() -> None:
    m = calculate_metrics([RequestResult(error="x")], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    with pytest.raises(ValueError):
        calculate_metrics([], duration=0.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    results = [_ok(0.1, 1.0, 10),     # ttft 100, tpot 100, e2el 1000
               _ok(0.6, 1.5, 10),     # ttft 600: misses ttft:500
               _ok(0.1, 3.0, 10),     # tpot 322: misses tpot:200
               _ok(0.2, 0.2, 1),      # one token: TPOT 0 for goodput
               RequestResult(success=False, error="x")]
    assert calculate_metrics(results, 2.0, goodput={"ttft": 500, "tpot": 200})["request_goodput"] == 1.0
    assert calculate_metrics(results, 2.0, goodput={"ttft": 500})["request_goodput"] == 1.5
    assert calculate_metrics(results, 2.0, goodput={"e2el": 1000})["request_goodput"] == 1.0   # 1000 <= 1000 counts
    assert calculate_metrics(results, 2.0, goodput={"tpot": 0})["request_goodput"] == 0.5


def test_slo_parsing_for_goodput_and_the_planner() -> None:
    assert parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    assert parse_goodput([]) is None and parse_slo("tpot:0") == ("tpot", 0.0)
    assert parse_slo(" TTFT:5", "--slo", allow_zero=False) == ("ttft", 5.0)
    for bad in ("itl:5", "ttft", "ttft:x", "ttft:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slo(bad)
    with pytest.raises(ValueError, match="--slo 'tpot:0': the limit must be > 0 ms"):
        parse_slo("tpot:0", "--slo", allow_zero=False)


def test_a_request_outcome_is_classified_in_one_place() -> None:
    assert settle(RequestResult(output_len=3, finish_reason="length"), True, "cut").success
    cut = settle(RequestResult(output_len=3), False, "stream ended early")
    assert not cut.success and cut.error == "stream ended early"
    assert settle(RequestResult(output_len=3, finish_reason="abort"), True, "").error == "finish_reason=abort"
    assert settle(RequestResult(finish_reason="stop"), True, "").error == "no output tokens"


def test_server_breakdown_is_the_mean_over_successful_requests() -> None:
    keys = ("queue_ms", "prefill_ms", "kv_transfer_ms", "first_decode_step_ms", "ttft_ms", "e2e_ms")
    a, b = _ok(0.1, 1, 2), _ok(0.1, 1, 2)
    a.server_timings, b.server_timings = dict.fromkeys(keys, 1.0), dict.fromkeys(keys, 3.0)
    failed = RequestResult(server_timings=dict.fromkeys(keys, 100.0))
    assert server_breakdown([a, b, failed]) == dict.fromkeys(keys, 2.0)
    assert server_breakdown([failed]) == {}


def test_failures_are_counted_by_kind_of_error_most_frequent_first(capsys) -> None:
    """Every failure counts, grouped by status and message: numbers its requests differ in read N,
    numbers they share stay, request ids go; the report prints one line per kind and the metrics
    (the JSON result) hold the same counts."""
    capacity = "HTTP 429: no decode capacity for 1024 tokens within {}s"
    full = ("RESOURCE_EXHAUSTED: admission queue is full: 4096 requests wait for decode capacity "
            "(max_queued_requests=4096, set by --max-queued-requests); retry later")
    failed_on_workers = "HTTP 500: the request failed on its workers (request id cmpl-{}; the router's log has the details)"
    errors = ([capacity.format(t) for t in (60, 60.2, 61.5)] * 3 + [full] * 2
              + [failed_on_workers.format(i) for i in ("3f2a9b1c44d0", "deadbeef1234")] + ["timeout: no [DONE] within 600s"])
    results = [RequestResult(error=e) for e in errors] + [_ok(0.1, 1.0, 4)]
    counts = calculate_metrics(results, duration=1.0)["error_counts"]
    assert counts == {"HTTP 429: no decode capacity for 1024 tokens within Ns": 9, full: 2,
                      "HTTP 500: the request failed on its workers": 2, "timeout: no [DONE] within 600s": 1}
    assert list(counts.values()) == [9, 2, 2, 1] and sum(counts.values()) == len(errors)
    assert error_counts(["", ""]) == {} and calculate_metrics([_ok(0.1, 1.0, 4)], 1.0)["error_counts"] == {}
    long = error_counts(["x" * 500 + "a", "x" * 500 + "b"])   # long messages that agree on their start: one kind
    assert list(long.values()) == [2] and len(next(iter(long))) == MAX_ERROR_KIND_CHARS
    print_errors(counts)
    assert capsys.readouterr().out.splitlines() == [
        "errors: 9 x HTTP 429: no decode capacity for 1024 tokens within Ns",
        f"        2 x {full}",
        "        2 x HTTP 500: the request failed on its workers",
        "        1 x timeout: no [DONE] within 600s"]
    print_errors({})
    assert capsys.readouterr().out == ""
