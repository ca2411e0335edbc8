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
  ``abort``. Failed requests count in ``failed`` and are left out of every latency metric. The
  report counts them by kind of error (``errors: 944 x HTTP 429: no decode capacity ...``, one
  line per kind, most frequent first; results.error_counts), as does the JSON's ``error_counts``.

The JSON result (``--save-result``) has vLLM's keys: ``completed``, ``failed`` (and pdserve's
``error_counts``: {kind: requests}), ``duration``, ``total_input_tokens``, ``total_output_tokens``,
``request_throughput``, ``request_goodput`` (null without ``--goodput``), ``output_throughput``,
``total_token_throughput``, ``{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`` (all four metrics
are always in the JSON; ``--percentile-metrics`` picks what the console shows, default
ttft,tpot,itl), and per-request arrays over all prompts in order (failed ones hold 0 / empty):
``input_lens``, ``output_lens``, ``ttfts``, ``itls`` (list of gaps), ``e2els`` (these in seconds,
as vLLM), ``errors`` ("" on success), plus ``start_times`` (seconds after the benchmark start),
``finish_reasons``, and the router's own per-request breakdown from the final message
(``server_timings``: queue, prefill, exposed KV transfer, first decode step, TTFT and e2e as the
router measured them, ms) with its mean over requests (``server_timings_mean_ms``).

Plots (PNG, matplotlib; made with ``--save-result`` unless ``--no-plot``, or with ``--plot``):
``<stem>_latency_cdf.png`` (CDFs of TTFT, TPOT and ITL, E2E) and ``<stem>_itl_over_time.png``
(every ITL gap at the time its token arrived, long-prompt arrivals marked for ``mixed``). With
``--sweep RATE,RATE,...`` one benchmark runs per rate (fresh prompts each, seed + index, so the
prefix cache does not carry over) and ``<stem>_sweep.png`` plots latency percentiles against
the achieved request throughput; ``<stem>_sweep.json`` holds the summary rows.

``--dataset-name mooncake_trace`` / ``azure_trace`` (services/loadtest/traces.py): a production
trace's rows from ``--trace-start``, sent at the trace's times (``--trace-time-scale``, or
rescaled to ``--request-rate``), lengths scaled by ``--trace-token-scale`` /
``--trace-output-scale``, the trace's shared blocks as shared tokens. With ``--goodput`` every
run reports ``slo_attainment`` (requests meeting every target / requests sent).

``--dataset-name multi-turn`` (services/loadtest/multi_turn.py): ``--num-prompts`` sessions of
``--multi-turn-turns`` turns arrive at ``--request-rate`` sessions/s; turn 1 has
``--multi-turn-first-input-len`` random tokens, each later turn the history so far, the previous
answer's exact token ids and ``--multi-turn-input-len`` new tokens, after a think time
(``--multi-turn-think-time-s``, exponential mean); answers of ``--random-output-len`` tokens.
Every request carries its session id (gRPC ``session_id``; over HTTP only with
``--send-session-id``, pdserve's body field), and the OpenAI backends ask for the answers' token
ids (``return_token_ids``, vLLM's extension). Besides the summary, a table by turn number: TTFT
p50/p99, mean prompt, cached (as the server reports them) and recomputed tokens, new tokens; the
JSON adds ``multi_turn`` (options, sessions, ``per_turn`` rows) and per-request ``session_ids``,
``turns``, ``cached_tokens``, ``new_tokens``. Not with ``--sweep`` or ``openai-chat``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from pdserve.services.client import AsyncClient
from pdserve.services.loadtest.datasets import DatasetOptions, DATASETS, SampleRequest, sample_requests
from pdserve.services.loadtest.metrics import METRICS, calculate_metrics, parse_goodput, server_breakdown
from pdserve.services.loadtest.multi_turn import (MultiTurnOptions, plan_sessions, request_fields, run_sessions,
    summarise)
from pdserve.services.loadtest.openai_backend import BACKENDS, OpenAIBackend, prepare_chat_prompts, server_info
from pdserve.services.loadtest.plots import plot_itl_over_time, plot_latency_cdfs, plot_sweep
from pdserve.services.loadtest.report import (error_lines, print_errors, print_server_breakdown, print_summary,
    print_sweep_table, print_turn_table)
from pdserve.services.loadtest.results import RequestResult, Sampling, error_counts
from pdserve.services.loadtest.run import LoadProgress, run_load
from pdserve.services.loadtest.traces import MOONCAKE_BLOCK, TRACES, TraceOptions, load_trace

WARMUP_SEED_OFFSET = 1_000_003


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


def _rate_name(rate: float) -> str:
    return "inf" if rate == math.inf else (f"{rate:g}")


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
    p.add_argument("--send-session-id", action="store_true",
                   help="--backend openai: send a session's id as the body field session_id (pdserve's HTTP "
                        "extension; the gRPC backend always sends it)")
    p.add_argument("--api-key", default=None,
                   help="--backend openai/openai-chat: sent as Bearer (default: $OPENAI_API_KEY, else "
                        "$PDSERVE_API_KEY)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=(*DATASETS, *TRACES))
    d.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\" | \"prompt_token_ids\", "
                                                       "\"output_len\"?} per line; mooncake_trace: a Mooncake / "
                                                       "AIPerf trace (JSON lines); azure_trace: an Azure LLM "
                                                       "inference trace (CSV)")
    d.add_argument("--trace-start", type=int, default=0, help="traces: rows skipped before the slice")
    d.add_argument("--trace-token-scale", type=float, default=1.0,
                   help="traces: input lengths (and a block's tokens) x this (default: %(default)s)")
    d.add_argument("--trace-output-scale", type=float, default=1.0,
                   help="traces: output lengths x this (default: %(default)s)")
    d.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="traces: gaps between arrivals x this, unless --request-rate rescales them to a mean "
                        "rate (default: %(default)s)")
    d.add_argument("--trace-block-size", type=int, default=MOONCAKE_BLOCK,
                   help="mooncake_trace: tokens per hash id before scaling (default: %(default)s)")
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
    mt = MultiTurnOptions()
    d.add_argument("--multi-turn-turns", type=int, default=mt.turns,
                   help="multi-turn: turns per session (default: %(default)s)")
    d.add_argument("--multi-turn-first-input-len", type=int, default=mt.first_input_len,
                   help="multi-turn: tokens of a session's first prompt (default: %(default)s)")
    d.add_argument("--multi-turn-input-len", type=int, default=mt.input_len,
                   help="multi-turn: new user tokens of each later turn (default: %(default)s)")
    d.add_argument("--multi-turn-think-time-s", type=float, default=mt.think_time_s,
                   help="multi-turn: mean pause (exponential) between an answer and the next turn; 0: none "
                        "(default: %(default)s)")
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


def _trace_options(args: argparse.Namespace, rate: float) -> TraceOptions:
    return TraceOptions(path=args.dataset_path, name=args.dataset_name, start=args.trace_start,
                        token_scale=args.trace_token_scale, output_scale=args.trace_output_scale,
                        time_scale=args.trace_time_scale, block_size=args.trace_block_size,
                        rate=rate if rate < math.inf else None)


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
        if args.dataset_name == "multi-turn":
            _multi_turn_options(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.dataset_name in TRACES:
        if not args.dataset_path:
            p.error(f"--dataset-name {args.dataset_name} needs --dataset-path")
        try:
            _trace_options(args, args.request_rate).validate()
        except ValueError as exc:
            p.error(str(exc))
        if args.burstiness != 1.0:
            p.error("--burstiness does not apply to a trace: its arrivals are the trace's")
    if args.dataset_name == "multi-turn" and (args.sweep or args.backend == "openai-chat"):
        p.error("--dataset-name multi-turn runs one rate (no --sweep) over token ids (not openai-chat)")


def _multi_turn_options(args: argparse.Namespace) -> MultiTurnOptions:
    return MultiTurnOptions(turns=args.multi_turn_turns, first_input_len=args.multi_turn_first_input_len,
                            input_len=args.multi_turn_input_len, output_len=args.random_output_len,
                            think_time_s=args.multi_turn_think_time_s)


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

        try:
            async with AsyncClient(args.router, timeout=30) as client:
                info = await client.model_info()
        except grpc.aio.AioRpcError as exc:
            return f"cannot reach the router at {args.router}: {exc.code().name} {exc.details()}"
        return info, None, None, (f"router {args.router}, model {info.model_name} (vocab {info.vocab_size}, "
                                  f"{info.num_prefill_workers} prefill / {info.num_decode_workers} decode workers)")
    backend = OpenAIBackend(args.base_url, args.model, chat=args.backend == "openai-chat", api_key=args.api_key,
                            timeout=args.request_timeout, send_session_id=args.send_session_id,
                            return_token_ids=args.dataset_name == "multi-turn")
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
    trace = args.dataset_name in TRACES
    rates = args.sweep or [args.request_rate]
    plot = args.plot if args.plot is not None else args.save_result
    out_dir = Path(args.result_dir)
    if args.save_result or plot:
        out_dir.mkdir(parents=True, exist_ok=True)
    eos = info.eos_token_id

    def workload(seed: int, n: int, rate: float = math.inf) -> tuple[list[SampleRequest], list[float] | None]:
        """The requests, and their send times when they come from a trace (at rate's mean, if finite)."""
        offsets = None
        if trace and seed < WARMUP_SEED_OFFSET:
            replay = load_trace(_trace_options(args, rate), n, info.vocab_size, seed=args.seed, eos_token_id=eos)
            reqs, offsets = replay.requests, replay.offsets
            print(f"trace {args.dataset_path}: rows {args.trace_start}-{args.trace_start + len(reqs) - 1}, "
                  f"{sum(r.prompt_len for r in reqs)} prompt tokens, {replay.shared_blocks} blocks shared between "
                  f"prompts, {len(reqs) / max(offsets[-1], 1e-9):.2f} req/s over {offsets[-1]:.1f}s", flush=True)
        else:
            warm_opts = DatasetOptions(input_len=args.multi_turn_first_input_len if args.dataset_name == "multi-turn"
                                       else args.random_input_len, output_len=args.random_output_len)
            reqs = sample_requests(opts if args.dataset_name not in (*TRACES, "multi-turn") else warm_opts, n,
                                   info.vocab_size, seed=seed, eos_token_id=eos)
        too_long = sum(1 for r in reqs if r.prompt_len >= 0 and r.prompt_len + r.expected_output_len > info.max_model_len)
        if too_long:
            print(f"warning: {too_long} request(s) exceed max_model_len {info.max_model_len} and will fail",
                  file=sys.stderr)
        return (prepare_chat_prompts(reqs, tokenizer) if args.backend == "openai-chat" else reqs), offsets

    print(f"pdserve bench serve: {server}, dataset {args.dataset_name}, {args.num_prompts} prompts, "
          f"rate(s) {', '.join(map(_rate_name, rates))}", flush=True)
    if args.num_warmups:
        warm, _ = workload(args.seed + WARMUP_SEED_OFFSET, args.num_warmups)
        wres, _ = await run_load(args.router, warm, rate=math.inf, max_concurrency=args.max_concurrency,
                                 sampling=sampling, timeout=args.request_timeout, tag="warmup",
                                 progress=LoadProgress(len(warm), "warmup", args.progress), backend=backend)
        bad = error_counts(r.error or "unknown error" for r in wres if not r.success)
        print(f"warmup: {len(wres) - sum(bad.values())}/{len(wres)} requests ok", *error_lines(bad), sep="\n",
              flush=True)

    if args.dataset_name == "multi-turn":
        return await _bench_multi_turn(args, info, backend, sampling, out_dir, plot)
    rows: list[dict[str, Any]] = []
    for i, rate in enumerate(rates):
        seed = args.seed + i
        requests, offsets = workload(seed, args.num_prompts, rate)
        results, duration = await run_load(args.router, requests, rate=rate, burstiness=args.burstiness,
                                           max_concurrency=args.max_concurrency, seed=seed, sampling=sampling,
                                           timeout=args.request_timeout,
                                           progress=LoadProgress(len(requests), f"rate {_rate_name(rate)}",
                                                                 args.progress), backend=backend, offsets=offsets)
        metrics = calculate_metrics(results, duration, args.metric_percentiles, args.goodput)
        title = " Serving Benchmark Result " if len(rates) == 1 else f" Serving Benchmark Result @ {_rate_name(rate)} req/s "
        print_summary(metrics, max_concurrency=args.max_concurrency, percentile_metrics=args.percentile_metrics,
                      percentiles=args.metric_percentiles, title=title)
        print_server_breakdown(server_breakdown(results))
        print_errors(metrics["error_counts"])
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


async def _bench_multi_turn(args: argparse.Namespace, info, backend, sampling: Sampling, out_dir: Path,
                            plot: bool) -> int:
    """One run of multi-turn sessions (the module docstring): the summary, the table by turn, the JSON."""
    opts = _multi_turn_options(args)
    if opts.max_total_len > info.max_model_len:
        print(f"warning: the last turns may reach {opts.max_total_len} tokens, over max_model_len "
              f"{info.max_model_len}, and fail", file=sys.stderr)
    plans = plan_sessions(opts, args.num_prompts, info.vocab_size, seed=args.seed, eos_token_id=info.eos_token_id)
    run = await run_sessions(args.router, plans, rate=args.request_rate, burstiness=args.burstiness,
                             max_concurrency=args.max_concurrency, seed=args.seed, sampling=sampling,
                             timeout=args.request_timeout, backend=backend,
                             progress=LoadProgress(len(plans), "multi-turn", args.progress, noun="sessions"))
    results = [t.result for t in run.turns]
    metrics = calculate_metrics(results, run.duration, args.metric_percentiles, args.goodput)
    print_summary(metrics, max_concurrency=args.max_concurrency, percentile_metrics=args.percentile_metrics,
                  percentiles=args.metric_percentiles)
    print_server_breakdown(server_breakdown(results))
    print_errors(metrics["error_counts"])
    summary = summarise(run)
    print_turn_table(summary)
    result = {**build_result(args, info, args.request_rate, metrics, results), **request_fields(run.turns),
              "multi_turn": {"options": asdict(opts), **summary}}
    stem = _result_stem(args, info.model_name, args.request_rate)
    if args.save_result:
        path = out_dir / (args.result_filename or f"{stem}.json")
        path.write_text(json.dumps(result, indent=1))
        print(f"result: {path}", flush=True)
    if plot:
        try:
            for written in (plot_latency_cdfs(result, out_dir / f"{stem}_latency_cdf.png"),
                            plot_itl_over_time(result, out_dir / f"{stem}_itl_over_time.png")):
                print(f"plot: {written}", flush=True)
        except ImportError:
            print("warning: matplotlib is not installed (pip install 'pdserve[bench]'); no plots", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    _check_args(parser, args)
    return asyncio.run(_bench(args))

