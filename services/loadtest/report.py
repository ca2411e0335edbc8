"""The console output of ``pdserve bench serve``: vLLM's summary table, the failed requests by kind
of error, the router's timing breakdown, the sweep table, the multi-turn table by turn number."""
from __future__ import annotations

from typing import Any, Sequence

from pdserve.services.loadtest.metrics import METRIC_TITLES, METRICS, percentile_key


def print_summary(metrics: dict[str, Any], *, max_concurrency: int | None, percentile_metrics: Sequence[str],
                  percentiles: Sequence[float], title: str = " Serving Benchmark Result ") -> None:
    print("{s:{c}^{n}}".format(s=title, n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", metrics["completed"]))
    print("{:<40} {:<10}".format("Failed requests:", metrics["failed"]))
    print("{:<40} {:<10}".format("Maximum request concurrency:", str(max_concurrency)))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", metrics["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", metrics["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", metrics["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", metrics["request_throughput"]))
    if metrics.get("request_goodput") is not None:
        print("{:<40} {:<10.2f}".format("Request goodput (req/s):", metrics["request_goodput"]))
        print("{:<40} {:<10.1%}".format("SLO attainment (of requests sent):", metrics["slo_attainment"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", metrics["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", metrics["total_token_throughput"]))
    for m in percentile_metrics:
        name = m.upper() if m != "e2el" else "E2EL"
        print("{s:{c}^{n}}".format(s=METRIC_TITLES[m], n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {name} (ms):", metrics[f"mean_{m}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {name} (ms):", metrics[f"median_{m}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Std {name} (ms):", metrics[f"std_{m}_ms"]))
        for p in percentiles:
            key = percentile_key(p)
            print("{:<40} {:<10.2f}".format(f"{key.upper()} {name} (ms):", metrics[f"{key}_{m}_ms"]))
    print("=" * 50, flush=True)


def error_lines(counts: dict[str, int]) -> list[str]:
    """``errors: 944 x HTTP 429: ...``, then one line per further kind, counts aligned."""
    width = max((len(str(n)) for n in counts.values()), default=0)
    return [f"{'errors:' if i == 0 else '':<8}{n:>{width}} x {kind}" for i, (kind, n) in enumerate(counts.items())]


def print_errors(counts: dict[str, int]) -> None:
    """Failed requests by kind of error (results.error_counts); nothing when none failed."""
    if counts:
        print("\n".join(error_lines(counts)), flush=True)


def print_server_breakdown(breakdown: dict[str, float]) -> None:
    if not breakdown:
        return
    print("{s:{c}^{n}}".format(s="Router timings (mean ms)", n=50, c="-"))
    print("  ".join(f"{k.removesuffix('_ms')}={v:.1f}" for k, v in breakdown.items()))


def print_sweep_table(rows: Sequence[dict[str, Any]], percentiles: Sequence[float]) -> None:
    pk = percentile_key(percentiles[-1])
    slo = any(r.get("slo_attainment") is not None for r in rows)
    head = (f"{'rate':>6} {'req/s':>7} {'tok/s':>8} {'ok':>5} {'fail':>4} " + ("  SLO% goodput " if slo else "")
            + " ".join(f"{m + ' p50/' + pk:>17}" for m in METRICS))
    print("{s:{c}^{n}}".format(s=" Sweep ", n=len(head), c="="))
    print(head)
    for r in rows:
        cells = " ".join(f"{r[f'median_{m}_ms']:>8.1f}/{r[f'{pk}_{m}_ms']:<8.1f}" for m in METRICS)
        attained = f"{100 * (r.get('slo_attainment') or 0):>6.1f} {r.get('request_goodput') or 0:>7.2f} " if slo else ""
        print(f"{str(r['request_rate']):>6} {r['request_throughput']:>7.2f} {r['output_throughput']:>8.1f} "
              f"{r['completed']:>5} {r['failed']:>4} {attained}{cells}")
    print("(latencies in ms)", flush=True)



def _cell(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def print_turn_table(summary: dict[str, Any]) -> None:
    """Sessions and, per turn number, TTFT and tokens (services/loadtest/multi_turn.py's summary);
    cached and recomputed show '-' where the server did not report cached tokens."""
    head = (f"{'turn':>4} {'ok':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'prompt':>8} {'cached':>8} "
            f"{'recomputed':>10} {'new':>6}")
    print("{s:{c}^{n}}".format(s=" Multi-turn sessions ", n=len(head), c="="))
    print(f"sessions: {summary['sessions_completed']} completed, {summary['sessions_failed']} failed of "
          f"{summary['sessions']}; {summary['completed']} turns ok, {summary['failed']} failed; "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s")
    print(head)
    for r in summary["per_turn"]:
        print(f"{r['turn']:>4} {r['count']:>5} {r['failed']:>4} {_cell(r['ttft_p50_ms']):>9} "
              f"{_cell(r['ttft_p99_ms']):>9} {_cell(r['mean_prompt_tokens']):>8} {_cell(r['mean_cached_tokens']):>8} "
              f"{_cell(r['mean_recomputed_tokens']):>10} {_cell(r['mean_new_tokens']):>6}")
    print("(TTFT in ms; tokens are means over the successful turns; new: what an ideal server computes)")
    for err in summary["session_errors"][:3]:
        print(f"  session ended: {err}")
    print("=" * len(head), flush=True)
