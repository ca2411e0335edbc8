#!/usr/bin/env python
"""``pdserve bench serve``: a load generator and latency benchmark against a running router.

Flags, metrics and JSON keys follow ``vllm bench serve`` wherever they mean the same thing::

    pdserve bench serve --router 127.0.0.1:50051 --dataset-name random \\
        --random-input-len 256 --random-output-len 128 --num-prompts 100 --request-rate 4 \\
        --ignore-eos --save-result --result-dir results/

Metrics (per successful request; times measured on this client with ``time.perf_counter``):

* TTFT: request sent -> first stream message that carries tokens.
* ITL: every gap between two consecutive token-carrying stream messages. A message that carries
  k > 1 tokens contributes ONE gap (vLLM's convention for multi-token chunks); pdserve's
  router sends one token per message today, so gaps and tokens coincide.
* E2E latency (e2el): request sent -> the final (``finished``) message.
* TPOT: (e2el - TTFT) / (output tokens - 1), for requests with more than one output token.
  For goodput a request with a single output token has TPOT 0, as in vLLM.
* Aggregates: mean, median, std and the ``--metric-percentiles`` of each metric (numpy's
  linear-interpolation percentile), over requests (TTFT, TPOT, e2el) or over all gaps of all
  requests (ITL). Request throughput = completed / duration, output throughput = output
  tokens / duration, total token throughput = (input + output tokens) / duration, goodput =
  requests meeting every ``--goodput`` SLO / duration. duration runs from the first benchmark
  request (warmups excluded) to the end of the last one.
* A request fails when its RPC raised (its gRPC status and details are recorded in
  ``errors``), when the stream ended without a final message, or when it finished with reason
  ``abort``. Failed requests count in ``failed`` and are left out of every latency metric.

The JSON result (``--save-result``) has vLLM's keys: ``completed``, ``failed``, ``duration``,
``total_input_tokens``, ``total_output_tokens``, ``request_throughput``, ``request_goodput``
(null without ``--goodput``), ``output_throughput``, ``total_token_throughput``,
``{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`` (all four metrics are always in the JSON;
``--percentile-metrics`` picks what the console shows, default ttft,tpot,itl), and
per-request arrays over all prompts in order (failed ones hold 0 / empty): ``input_lens``,
``output_lens``, ``ttfts``, ``itls`` (list of gaps), ``e2els`` (these in seconds, as vLLM),
``errors`` ("" on success), plus ``start_times`` (seconds after the benchmark start),
``finish_reasons``, and the router's own per-request breakdown from the final message
(``server_timings``: queue, prefill, exposed KV transfer, first decode step, TTFT and e2e as the
router measured them, ms) with its mean over requests (``server_timings_mean_ms``).

Plots (PNG, matplotlib; made with ``--save-result`` unless ``--no-plot``, or with ``--plot``):
``<stem>_latency_cdf.png`` (CDFs of TTFT, TPOT and ITL, E2E) and ``<stem>_itl_over_time.png``
(every ITL gap at the time its token arrived, long-prompt arrivals marked for ``mixed``). With
``--sweep RATE,RATE,...`` one benchmark runs per rate (fresh prompts each, seed + index, so the
prefix cache does not carry over) and ``<stem>_sweep.png`` plots latency percentiles against
the achieved request throughput; ``<stem>_sweep.json`` holds the summary rows.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.datasets import DATASETS, DatasetOptions, SampleRequest, sample_requests  # noqa: E402
from bench.openai_backend import BACKENDS, OpenAIBackend, prepare_chat_prompts, server_info  # noqa: E402
from bench.request_result import RequestResult, Sampling  # noqa: E402

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
SERVER_TIMINGS = ("queue_ms", "prefill_ms", "kv_transfer_ms", "first_decode_step_ms", "ttft_ms", "e2e_ms")
WARMUP_SEED_OFFSET = 1_000_003


# ---------------------------------------------------------------- per-request results


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
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


# ---------------------------------------------------------------- load generation


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds after the start): gamma-distributed gaps with mean 1/rate and shape
    burstiness (1 = Poisson), the first request at 0; every request at 0 for rate inf."""
    if rate == math.inf:
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    theta = 1.0 / (rate * burstiness)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


async def send_request(client, req: SampleRequest, request_id: str, sampling: Sampling, bench_start: float
                       ) -> RequestResult:
    import grpc

    res = RequestResult(prompt_len=max(req.prompt_len, 0), kind=req.kind)
    st = time.perf_counter()
    res.start_time = st - bench_start
    last_token = st
    finished = False
    try:
        async for msg in client.generate_stream(req.prompt, request_id=request_id,
                                                max_tokens=req.expected_output_len, **sampling.kwargs()):
            now = time.perf_counter()
            if finished:     # nothing follows the final message; ignore anything that would
                continue
            if msg.token_ids:
                if res.output_len == 0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last_token)
                last_token = now
                res.output_len += len(msg.token_ids)
                res.token_ids.extend(msg.token_ids)
            if msg.finished:
                finished = True
                res.latency = now - st
                res.finish_reason = msg.finish_reason
                t = msg.timings
                res.server_timings = {k: getattr(t, k) for k in SERVER_TIMINGS}
                res.prefill_route, res.decode_cached_tokens, res.kv_bytes = (t.prefill_route, t.decode_cached_tokens,
                                                                             t.kv_bytes)
                if req.prompt_len < 0:
                    res.prompt_len = msg.usage.prompt_tokens
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
        return res
    except Exception as exc:  # noqa: BLE001 - a benchmark records, it does not crash
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not finished:
        res.error = "stream ended without a finished message"
    elif res.finish_reason == "abort":
        res.error = "finish_reason=abort"
    elif res.output_len == 0:
        res.error = "no output tokens"
    else:
        res.success = True
    return res


class LoadProgress:
    """Requests done so far: a tqdm bar on a terminal; elsewhere (logs, pipes) a plain line at every
    10% and at the end, so that a file gets a few readable lines, not a stream of carriage returns."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None, stream=None) -> None:
        self.total, self.desc, self.done, self.failed = total, desc, 0, 0
        self.stream = stream or sys.stderr
        tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False
        self.lines = enabled is not False and not tty      # plain lines instead of a bar
        self.bar = None
        self.t0 = time.perf_counter()
        self._next_line = 0.1
        if enabled is not False and tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="req", file=self.stream, dynamic_ncols=True)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed, refresh=False)
        elif self.lines and (self.done >= self._next_line * self.total or self.done == self.total):
            while self._next_line * self.total <= self.done:
                self._next_line += 0.1
            print(f"{self.desc}: {self.done}/{self.total} requests done ({self.failed} failed, "
                  f"{time.perf_counter() - self.t0:.1f}s)", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _GrpcBackend:
    """The router's gRPC API, as the OpenAI backend's interface: send(req, id, sampling, start)."""

    def __init__(self, address: str, timeout: float | None) -> None:
        from services.client import AsyncClient
        self.client = AsyncClient(address, timeout=timeout)

    async def send(self, req: SampleRequest, request_id: str, sampling: Sampling, bench_start: float):
        return await send_request(self.client, req, request_id, sampling, bench_start)

    async def __aenter__(self) -> "_GrpcBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()


@contextlib.asynccontextmanager
async def _no_close(backend):
    yield backend


async def run_load(address: str, requests: Sequence[SampleRequest], *, rate: float, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, sampling: Sampling | None = None,
                   timeout: float | None = 600.0, tag: str = "bench",
                   progress: LoadProgress | None = None, backend=None) -> tuple[list[RequestResult], float]:
    """Send requests at the arrival schedule; returns (results in request order, duration s).
    progress: told as each request ends. backend: an OpenAIBackend (bench/openai_backend.py);
    None: the router's gRPC API at address."""
    sampling = sampling or Sampling()
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_id = uuid.uuid4().hex[:8]
    async with (_GrpcBackend(address, timeout) if backend is None else _no_close(backend)) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rid = f"{tag}-{run_id}-{i}"
            if sem is None:
                res = await client.send(requests[i], rid, sampling, start)
            else:
                async with sem:
                    res = await client.send(requests[i], rid, sampling, start)
            if progress is not None:
                progress.update(res.success)
            return res

        try:
            results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        finally:
            if progress is not None:
                progress.close()
        duration = time.perf_counter() - start
    return list(results), duration


# ---------------------------------------------------------------- output


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


def build_result(args: argparse.Namespace, info, rate: float, metrics: dict[str, Any],
                 results: Sequence[RequestResult]) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "router": args.router if args.backend == "pdserve" else None,
        "base_url": args.base_url if args.backend != "pdserve" else None,
        "model_id": info.model_name,
        "dataset_name": args.dataset_name,
        "num_prompts": len(results),
        "request_rate": rate if rate < math.inf else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "percentile_metrics": list(args.percentile_metrics),
        "metric_percentiles": list(args.metric_percentiles),
        "goodput_config": args.goodput,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [list(r.itl) if r.success else [] for r in results],
        "e2els": [r.latency if r.success else 0.0 for r in results],
        "start_times": [r.start_time for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "errors": [r.error for r in results],
        "server_timings_mean_ms": server_breakdown(results),
        "server_timings": [r.server_timings for r in results],
    }


def server_breakdown(results: Sequence[RequestResult]) -> dict[str, float]:
    """Mean of the router's per-request Timings over successful requests (ms)."""
    ok = [r.server_timings for r in results if r.success and r.server_timings]
    return {k: float(np.mean([t[k] for t in ok])) for k in SERVER_TIMINGS} if ok else {}


def print_server_breakdown(breakdown: dict[str, float]) -> None:
    if not breakdown:
        return
    print("{s:{c}^{n}}".format(s="Router timings (mean ms)", n=50, c="-"))
    print("  ".join(f"{k.removesuffix('_ms')}={v:.1f}" for k, v in breakdown.items()))


def _rate_name(rate: float) -> str:
    return "inf" if rate == math.inf else (f"{rate:g}")


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


# ---------------------------------------------------------------- command line


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return value


def _rates(text: str) -> list[float]:
    try:
        rates = [_rate(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--sweep takes RATE,RATE,...: {exc}") from exc
    if not rates:
        raise argparse.ArgumentTypeError("--sweep needs at least one rate")
    return rates


def _metric_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--percentile-metrics takes a subset of {','.join(METRICS)}, got {text!r}")
    return names


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--metric-percentiles: {exc}") from exc
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"--metric-percentiles takes numbers in [0, 100], got {text!r}")
    return ps


def parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        out[key] = ms
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve",
                                description="Load-test a running pdserve router over gRPC, or any OpenAI-compatible "
                                            "HTTP API (pdserve's, vLLM's, SGLang's) with --backend openai or "
                                            "openai-chat (flags as vllm bench serve).")
    p.add_argument("--backend", default="pdserve", choices=BACKENDS,
                   help="pdserve: the router's gRPC API at --router; openai: streaming /v1/completions at --base-url; "
                        "openai-chat: streaming /v1/chat/completions (default: pdserve)")
    p.add_argument("--router", default="127.0.0.1:50051", help="router address HOST:PORT (--backend pdserve)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="--backend openai/openai-chat: the server, http(s)://HOST:PORT, with or without /v1 "
                        "(default: http://127.0.0.1:8000, where `pdserve serve` and `vllm serve` listen)")
    p.add_argument("--model", default=None,
                   help="--backend openai/openai-chat: the model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="--backend openai/openai-chat: the tokenizer that makes random prompts (default: --model, "
                        "when it is a local directory)")
    p.add_argument("--api-key", default=None,
                   help="--backend openai/openai-chat: sent as Bearer (default: $OPENAI_API_KEY, else "
                        "$PDSERVE_API_KEY)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=DATASETS)
    d.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\" | \"prompt_token_ids\", "
                                                       "\"output_len\"?} per line")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=None,
                   help="shared prefix tokens (random: default 0; shared-prefix: default 256)")
    d.add_argument("--shared-prefix-num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct prefixes, each request drawing one uniformly")
    d.add_argument("--mixed-short-input-len", type=int, default=64)
    d.add_argument("--mixed-long-input-len", type=int, default=1024)
    d.add_argument("--mixed-long-output-len", type=int, default=16)
    d.add_argument("--mixed-long-fraction", type=float, default=0.125)
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s; inf sends all at once")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--num-warmups", type=int, default=0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sweep", type=_rates, default=None, help="RATE,RATE,...: one run per request rate")
    t.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline (s)")
    s = p.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    r = p.add_argument_group("results")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    r.add_argument("--percentile-metrics", type=_metric_list, default=["ttft", "tpot", "itl"])
    r.add_argument("--metric-percentiles", type=_percentiles, default=[99.0])
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--result-dir", default=".")
    r.add_argument("--result-filename", default=None)
    r.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                   help="write PNG plots (default: with --save-result)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="requests done so far, on stderr: a bar on a terminal, a line per 10%% elsewhere "
                        "(default: on)")
    return p


def _dataset_options(args: argparse.Namespace) -> DatasetOptions:
    return DatasetOptions(name=args.dataset_name, path=args.dataset_path, input_len=args.random_input_len,
                          output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                          prefix_len=args.random_prefix_len, mixed_short_input_len=args.mixed_short_input_len,
                          mixed_long_input_len=args.mixed_long_input_len,
                          mixed_long_output_len=args.mixed_long_output_len,
                          mixed_long_fraction=args.mixed_long_fraction,
                          num_prefixes=args.shared_prefix_num_prefixes)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.num_warmups < 0:
        p.error("--num-warmups must be >= 0")
    if not args.burstiness > 0:
        p.error("--burstiness must be > 0")
    if args.random_output_len < 1 or args.random_input_len < 0:
        p.error("--random-output-len must be >= 1 and --random-input-len >= 0")
    try:
        args.goodput = parse_goodput(args.goodput)
    except ValueError as exc:
        p.error(str(exc))


def _result_stem(args: argparse.Namespace, model: str, rate: float | None) -> str:
    if args.result_filename:
        stem = Path(args.result_filename).stem
        return stem if rate is None or not args.sweep else f"{stem}_rate{_rate_name(rate)}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    what = "sweep" if rate is None else f"{_rate_name(rate)}qps"
    return f"pdserve-{what}{conc}-{Path(model).name or 'model'}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


async def _connect(args: argparse.Namespace):
    """(server info, OpenAIBackend or None, tokenizer or None, one line naming the server), or an
    error line (str) when it cannot be reached."""
    if args.backend == "pdserve":
        import grpc

        from services.client import AsyncClient
        try:
            async with AsyncClient(args.router, timeout=30) as client:
                info = await client.model_info()
        except grpc.aio.AioRpcError as exc:
            return f"cannot reach the router at {args.router}: {exc.code().name} {exc.details()}"
        return info, None, None, (f"router {args.router}, model {info.model_name} (vocab {info.vocab_size}, "
                                  f"{info.num_prefill_workers} prefill / {info.num_decode_workers} decode workers)")
    backend = OpenAIBackend(args.base_url, args.model, chat=args.backend == "openai-chat", api_key=args.api_key,
                            timeout=args.request_timeout)
    try:
        info, tokenizer = await server_info(backend, args.tokenizer, need_vocab=args.dataset_name != "jsonl")
    except (OSError, asyncio.TimeoutError) as exc:
        return f"cannot reach {backend.endpoint.url}: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - an HTTP error, a missing tokenizer: one line
        return f"{backend.endpoint.url}: {exc}"
    return info, backend, tokenizer, f"{args.backend} API at {backend.endpoint.url}, model {info.model_name}"


async def _bench(args: argparse.Namespace) -> int:
    connected = await _connect(args)
    if isinstance(connected, str):
        print(f"pdserve bench serve: {connected}", file=sys.stderr)
        return 1
    info, backend, tokenizer, server = connected
    opts = _dataset_options(args)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.ignore_eos)
    rates = args.sweep or [args.request_rate]
    plot = args.plot if args.plot is not None else args.save_result
    out_dir = Path(args.result_dir)
    if args.save_result or plot:
        out_dir.mkdir(parents=True, exist_ok=True)
    eos = info.eos_token_id

    def workload(seed: int, n: int) -> list[SampleRequest]:
        reqs = sample_requests(opts, n, info.vocab_size, seed=seed, eos_token_id=eos)
        too_long = sum(1 for r in reqs if r.prompt_len >= 0 and r.prompt_len + r.expected_output_len > info.max_model_len)
        if too_long:
            print(f"warning: {too_long} request(s) exceed max_model_len {info.max_model_len} and will fail",
                  file=sys.stderr)
        return prepare_chat_prompts(reqs, tokenizer) if args.backend == "openai-chat" else reqs

    print(f"pdserve bench serve: {server}, dataset {args.dataset_name}, {args.num_prompts} prompts, "
          f"rate(s) {', '.join(map(_rate_name, rates))}", flush=True)
    if args.num_warmups:
        warm = workload(args.seed + WARMUP_SEED_OFFSET, args.num_warmups)
        wres, _ = await run_load(args.router, warm, rate=math.inf, max_concurrency=args.max_concurrency,
                                 sampling=sampling, timeout=args.request_timeout, tag="warmup",
                                 progress=LoadProgress(len(warm), "warmup", args.progress), backend=backend)
        bad = [r.error for r in wres if not r.success]
        print(f"warmup: {len(wres) - len(bad)}/{len(wres)} requests ok" + (f" (first error: {bad[0]})" if bad else ""),
              flush=True)

    rows: list[dict[str, Any]] = []
    for i, rate in enumerate(rates):
        seed = args.seed + i
        requests = workload(seed, args.num_prompts)
        results, duration = await run_load(args.router, requests, rate=rate, burstiness=args.burstiness,
                                           max_concurrency=args.max_concurrency, seed=seed, sampling=sampling,
                                           timeout=args.request_timeout,
                                           progress=LoadProgress(len(requests), f"rate {_rate_name(rate)}",
                                                                 args.progress), backend=backend)
        metrics = calculate_metrics(results, duration, args.metric_percentiles, args.goodput)
        title = " Serving Benchmark Result " if len(rates) == 1 else f" Serving Benchmark Result @ {_rate_name(rate)} req/s "
        print_summary(metrics, max_concurrency=args.max_concurrency, percentile_metrics=args.percentile_metrics,
                      percentiles=args.metric_percentiles, title=title)
        print_server_breakdown(server_breakdown(results))
        errors = [r.error for r in results if r.error]
        if errors:
            print(f"{len(errors)} failed request(s); first error: {errors[0]}", flush=True)
        result = build_result(args, info, rate, metrics, results)
        rows.append({k: v for k, v in result.items() if not isinstance(v, list) or k in ("percentile_metrics",
                                                                                          "metric_percentiles")})
        stem = _result_stem(args, info.model_name, rate)
        if args.save_result:
            path = out_dir / (args.result_filename if args.result_filename and not args.sweep else f"{stem}.json")
            path.write_text(json.dumps(result, indent=1))
            print(f"result: {path}", flush=True)
        if plot:
            try:
                for written in (plot_latency_cdfs(result, out_dir / f"{stem}_latency_cdf.png"),
                                plot_itl_over_time(result, out_dir / f"{stem}_itl_over_time.png",
                                                   [r.kind for r in requests])):
                    print(f"plot: {written}", flush=True)
            except ImportError:
                print("warning: matplotlib is not installed (pip install 'pdserve[bench]'); no plots", file=sys.stderr)
                plot = False

    if args.sweep:
        print_sweep_table(rows, args.metric_percentiles)
        stem = _result_stem(args, info.model_name, None)
        if args.save_result:
            path = out_dir / f"{stem}_sweep.json"
            path.write_text(json.dumps(rows, indent=1))
            print(f"sweep result: {path}", flush=True)
        if plot:
            print(f"plot: {plot_sweep(rows, out_dir / f'{stem}_sweep.png', args.metric_percentiles)}", flush=True)
    return 0


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    _check_args(parser, args)
    return asyncio.run(_bench(args))


if __name__ == "__main__":
    sys.exit(main())
