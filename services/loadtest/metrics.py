"""The benchmark's numbers from per-request results, as vLLM's calculate_metrics: TTFT, TPOT, ITL and
e2el statistics (mean, median, std, numpy linear-interpolation percentiles, in ms), request / token
throughput and goodput (requests meeting every SLO / duration). Shared by ``pdserve bench serve``
and the planner, so that predictions and measurements are summarised by the same code."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pdserve.services.loadtest.results import RequestResult, error_counts

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
SERVER_TIMINGS = ("queue_ms", "prefill_ms", "kv_transfer_ms", "first_decode_step_ms", "ttft_ms", "e2e_ms")


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p) == int(p) else f"p{p}"


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1e3
    out = {"mean": float(np.mean(arr)), "median": float(np.median(arr)), "std": float(np.std(arr))}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float] = (99,),
                      goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's calculate_metrics: aggregate per-request results into the benchmark's numbers.
    goodput maps ttft/tpot/e2el to SLOs in milliseconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ttfts, tpots, itls, e2els, all_tpots = [], [], [], [], []
    completed = failed = total_input = total_output = 0
    for r in results:
        if not r.success:
            failed += 1
            continue
        completed += 1
        total_input += max(r.prompt_len, 0)
        total_output += r.output_len
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        tpot = r.tpot
        if tpot is not None:
            tpots.append(tpot)
        all_tpots.append(tpot or 0.0)
    good = 0
    if goodput:
        series = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(completed):
            if all(series[k][i] * 1e3 <= slo for k, slo in goodput.items()):
                good += 1
    metrics: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "error_counts": error_counts(r.error or "unknown error" for r in results if not r.success),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": good / duration if goodput else None,
        # the share of all requests sent (failed ones included) that met every SLO
        "slo_attainment": good / len(results) if goodput and results else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def server_breakdown(results: Sequence[RequestResult]) -> dict[str, float]:
    """Mean of the router's per-request Timings over successful requests (ms)."""
    ok = [r.server_timings for r in results if r.success and r.server_timings]
    return {k: float(np.mean([t[k] for t in ok])) for k in SERVER_TIMINGS} if ok else {}


def parse_slo(item: str, flag: str = "--goodput", allow_zero: bool = True) -> tuple[str, float]:
    """"ttft:500" -> ("ttft", 500.0): one SLO in milliseconds on ttft, tpot or e2el (flag names the
    option in the error; allow_zero: a 0 ms limit is accepted, as vLLM's --goodput does)."""
    key, sep, value = item.partition(":")
    key = key.strip().lower()
    if not sep or key not in GOODPUT_METRICS:
        raise ValueError(f"{flag} takes METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}, got {item!r}")
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"{flag} {item!r}: {value!r} is not a number of milliseconds") from None
    if ms < 0 or (ms == 0 and not allow_zero):
        raise ValueError(f"{flag} {item!r}: the limit must be {'>=' if allow_zero else '>'} 0 ms")
    return key, ms


def parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    return dict(parse_slo(item) for item in items) if items else None
