"""The console output of ``pdserve bench serve``: vLLM's summary table, the router's timing
breakdown, the sweep table."""
from __future__ import annotations

from typing import Any, Sequence

from services.loadtest.metrics import METRIC_TITLES, METRICS, percentile_key


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


def print_server_breakdown(breakdown: dict[str, float]) -> None:
    if not breakdown:
        return
    print("{s:{c}^{n}}".format(s="Router timings (mean ms)", n=50, c="-"))
    print("  ".join(f"{k.removesuffix('_ms')}={v:.1f}" for k, v in breakdown.items()))


def print_sweep_table(rows: Sequence[dict[str, Any]], percentiles: Sequence[float]) -> None:
    pk = percentile_key(percentiles[-1])
    head = (f"{'rate':>6} {'req/s':>7} {'tok/s':>8} {'ok':>5} {'fail':>4} "
            + " ".join(f"{m + ' p50/' + pk:>17}" for m in METRICS))
    print("{s:{c}^{n}}".format(s=" Sweep ", n=len(head), c="="))
    print(head)
    for r in rows:
        cells = " ".join(f"{r[f'median_{m}_ms']:>8.1f}/{r[f'{pk}_{m}_ms']:<8.1f}" for m in METRICS)
        print(f"{str(r['request_rate']):>6} {r['request_throughput']:>7.2f} {r['output_throughput']:>8.1f} "
              f"{r['completed']:>5} {r['failed']:>4} {cells}")
    print("(latencies in ms)", flush=True)

