"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

DEFAULT_PORT = 50051


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF checkpoint directory (default: the tiny model, made on first use)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--schedule-policy", default=None, choices=["prefill_first", "interleave", "mixed"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--quantization", default=None, choices=["w8a16"])
    g.add_argument("--threads", type=int, default=None, help="torch threads in this process")


_ENGINE_FIELDS = ("dtype", "device", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                  "num_kv_blocks", "kv_cache_memory_bytes", "schedule_policy", "quantization")


def _model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from engine.model_maker import ensure_default_model
    return str(ensure_default_model())


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {f: getattr(args, f) for f in _ENGINE_FIELDS if getattr(args, f) is not None}
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    return kwargs


def _forward_engine_args(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `up`, to pass on to each worker."""
    out: list[str] = []
    for f in _ENGINE_FIELDS:
        value = getattr(args, f)
        if value is not None and not (f in ("dtype", "device") and value == "auto"):
            out += [f"--{f.replace('_', '-')}", str(value)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    return out


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


# ---- commands ---------------------------------------------------------------------
def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.model_maker import make_model
    print(make_model(args.dir, preset=args.preset, arch=args.arch, seed=args.seed))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.seed, "ignore_eos": args.ignore_eos}
    if args.router:
        from services.client import Client
        with Client(args.router) as client:
            final = None
            for msg in client.generate_stream(args.prompt, **{k: v for k, v in sampling.items() if v is not None}):
                print(msg.text, end="", flush=True)
                final = msg
            print()
            if final is not None and final.finished:
                print(f"[finish_reason={final.finish_reason} prompt_tokens={final.usage.prompt_tokens} "
                      f"completion_tokens={final.usage.completion_tokens} ttft_ms={final.timings.ttft_ms:.1f}]",
                      file=sys.stderr)
        return 0
    from engine import LLM, SamplingParams
    llm = LLM(_model_dir(args), **_engine_kwargs(args))
    params = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    print(f"[finish_reason={out.finish_reason} completion_tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from engine import EngineConfig
    from services.worker import WorkerOptions, serve_worker
    kwargs = _engine_kwargs(args)
    kwargs.setdefault("num_threads", 1)
    config = EngineConfig.from_kwargs(_model_dir(args), role=args.role, **kwargs)
    options = WorkerOptions(host=args.host, port=args.port, worker_id=args.worker_id, metrics_port=args.metrics_port)
    asyncio.run(serve_worker(config, options))
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from services.router import RouterOptions, serve_router
    split = lambda s: [a for a in (s or "").split(",") if a]  # noqa: E731
    options = RouterOptions(model=_model_dir(args), prefill=split(args.prefill), decode=split(args.decode),
                            colocated=split(args.colocated))
    asyncio.run(serve_router(options, args.host, args.port, args.metrics_port))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import Cluster, Deployment
    spec = Deployment(model=_model_dir(args), prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                      colocated_workers=args.colocated_workers, host=args.host, port=args.port,
                      engine_args=_forward_engine_args(args), metrics=args.metrics,
                      threads_per_worker=args.threads or 1)
    cluster = Cluster(spec)
    cluster.start()
    print(f"pdserve is up: router at {cluster.router_address}\n{cluster.describe()}", flush=True)
    print(f"try: pdserve generate --router {cluster.router_address} \"Once upon a time\"", flush=True)
    return cluster.wait()


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the process at ADDRESS reports SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with grpc.insecure_channel(args.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.kind == "offline":
        from bench.offline_throughput import main as bench_main
    else:
        from bench.serve import main as bench_main
    return bench_main(rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a deterministic random-weight HF checkpoint")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("generate", help="generate offline, or through a running router with --router")
    p.add_argument("prompt")
    p.add_argument("--router", default=None, help="router address HOST:PORT")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("up", help="start router + workers as local processes")
    _add_engine_args(p)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--colocated-workers", type=int, default=0, help="serve colocated (no disaggregation)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--metrics", action="store_true", help="expose Prometheus /metrics on every process")
    p.set_defaults(func=cmd_up)

    for name, role in (("worker", None), ("prefill", "prefill"), ("decode", "decode")):
        p = sub.add_parser(name, help=f"run one {role or 'engine'} worker")
        _add_engine_args(p)
        if role is None:
            p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
        else:
            p.set_defaults(role=role)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--worker-id", default="")
        p.add_argument("--metrics-port", type=int, default=None)
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("router", help="run the router")
    p.add_argument("--model", default=None)
    p.add_argument("--prefill", default="", help="comma-separated prefill worker addresses")
    p.add_argument("--decode", default="", help="comma-separated decode worker addresses")
    p.add_argument("--colocated", default="", help="comma-separated colocated worker addresses")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--metrics-port", type=int, default=None)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("health", help="check a process's grpc.health.v1 status")
    p.add_argument("address")
    p.add_argument("--timeout", type=float, default=2.0)
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("bench", help="benchmarks: offline throughput, serving load test", add_help=False)
    p.add_argument("kind", choices=["offline", "serve"])
    p.set_defaults(func=cmd_bench)

    from services.ray_deploy.cli import add_ray_parser   # `pdserve ray up|down|status` (imports Ray only when run)
    add_ray_parser(sub, _add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
