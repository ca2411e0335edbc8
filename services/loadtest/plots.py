"""The PNG plots of ``pdserve bench serve`` (matplotlib, the ``bench`` extra): latency CDFs, ITL
over time, latency against achieved throughput for a sweep."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pdserve.services.loadtest.metrics import METRIC_TITLES, METRICS, percentile_key


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if not len(values_ms):
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_latency_cdfs(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    ttft = [result["ttfts"][i] * 1e3 for i in ok]
    e2el = [result["e2els"][i] * 1e3 for i in ok]
    itl = [g * 1e3 for i in ok for g in result["itls"][i]]
    tpot = [(result["e2els"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1) * 1e3
            for i in ok if result["output_lens"][i] > 1]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, series, title in ((axes[0], [(ttft, "TTFT")], "TTFT"),
                              (axes[1], [(tpot, "TPOT"), (itl, "ITL")], "TPOT / ITL"),
                              (axes[2], [(e2el, "E2E latency")], "E2E latency")):
        for values, label in series:
            _cdf(ax, values, label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "TPOT / ITL" else "fraction")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"pdserve bench serve: {result['dataset_name']}, rate {result['request_rate']} req/s, "
                 f"{result['completed']} ok / {result['failed']} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_itl_over_time(result: dict[str, Any], path: Path, kinds: Sequence[str] = ()) -> Path:
    plt = _pyplot()
    times, gaps = [], []
    for i, err in enumerate(result["errors"]):
        if err:
            continue
        t = result["start_times"][i] + result["ttfts"][i]
        for g in result["itls"][i]:
            t += g
            times.append(t)
            gaps.append(g * 1e3)
    fig, ax = plt.subplots(figsize=(12, 4.2))
    ax.scatter(times, gaps, s=3, alpha=0.4, label="ITL gap")
    if times:
        order = np.argsort(times)
        t_sorted, g_sorted = np.asarray(times)[order], np.asarray(gaps)[order]
        width = max(0.25, (t_sorted[-1] - t_sorted[0]) / 60)
        edges = np.arange(t_sorted[0], t_sorted[-1] + width, width)
        idx = np.digitize(t_sorted, edges)
        centers, medians = [], []
        for b in np.unique(idx):
            sel = g_sorted[idx == b]
            centers.append(edges[b - 1] + width / 2)
            medians.append(float(np.median(sel)))
        ax.plot(centers, medians, color="black", linewidth=1.2, label=f"median per {width:.2f}s")
    longs = [result["start_times"][i] for i, k in enumerate(kinds) if k == "long"]
    for j, t in enumerate(longs):
        ax.axvline(t, color="red", alpha=0.35, linewidth=0.8, label="long prompt sent" if j == 0 else None)
    ax.set_xlabel("seconds since benchmark start")
    ax.set_ylabel("ITL (ms)")
    ax.set_title(f"Inter-token latency over time ({result['dataset_name']}, rate {result['request_rate']} req/s)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(rows: Sequence[dict[str, Any]], path: Path, percentiles: Sequence[float]) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    xs = [r["request_throughput"] for r in rows]
    for ax, m in zip(axes.flat, METRICS):
        for stat in ("median", *[percentile_key(p) for p in percentiles]):
            ax.plot(xs, [r[f"{stat}_{m}_ms"] for r in rows], marker="o", label=stat)
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['request_rate']}", (x, r[f"median_{m}_ms"]), textcoords="offset points",
                        xytext=(3, 3), fontsize=7)
        ax.set_title(METRIC_TITLES[m])
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency against achieved throughput (labels: offered request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

