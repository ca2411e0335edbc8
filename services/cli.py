"""The `pdserve` command line. Settings flags are generated from the config dataclasses
(services/config_cli.py): EngineConfig, WorkerConfig, RouterConfig, GenerationOptions,
RequestLimits, Deployment."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from engine.config import EngineConfig
from services.config_cli import add_config_args, config_from_args, config_to_argv, given
from services.generation import GenerationOptions
from services.launcher import Deployment, die_with_parent
from services.router import RequestLimits, RouterConfig
from services.worker import WorkerConfig

DEFAULT_PORT = 50051
ENGINE_FIXED = ("model", "role")          # set by --model and the subcommand
UP_PER_PROCESS = ("num_threads",)         # `up` sets these per worker (threads_per_worker)
UP_ROUTER_OWN = ("drain_timeout_s",)      # `up` sets these on the router from its Deployment


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the tiny model, made on first use)")


def _add_engine_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    _add_model_arg(p)
    add_config_args(p.add_argument_group("engine"), EngineConfig, exclude=(*ENGINE_FIXED, *exclude))


def _add_security_args(p: argparse.ArgumentParser, router: bool = False) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--cluster-token-file", default=None,
                   help="file holding the deployment's internal-plane secret (default: $PDSERVE_CLUSTER_TOKEN)")
    for name, what in (("cert", "this process's certificate"), ("key", "its private key"),
                       ("ca", "the deployment CA")):
        g.add_argument(f"--tls-{name}", default=None, help=f"mutual TLS on every channel: {what} (PEM)")
    if router:
        g.add_argument("--api-key", default=None,
                       help="key clients must send (authorization: Bearer KEY); prefer --api-key-file or "
                            "$PDSERVE_API_KEY, since argv is visible to other local users")
        g.add_argument("--api-key-file", default=None, help="file holding the API key")


def _credentials(args: argparse.Namespace):
    from services.security import Credentials
    return Credentials.load(args.cluster_token_file, args.tls_cert, args.tls_key, args.tls_ca)


def _api_key(args: argparse.Namespace) -> str | None:
    from services.security import API_KEY_ENV, read_secret
    if args.api_key:
        return args.api_key
    return read_secret(args.api_key_file, API_KEY_ENV, "API key")


def _model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from engine.model_maker import ensure_default_model
    return str(ensure_default_model())


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--ignore-eos", action="store_true")


# ---- commands ---------------------------------------------------------------------
def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.model_maker import make_model
    print(make_model(args.dir, preset=args.preset, arch=args.arch, seed=args.seed))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.sampling_seed, "ignore_eos": args.ignore_eos}
    if args.router:
        from services.client import Client
        with Client(args.router, api_key=args.api_key) as client:
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
    llm = LLM(_model_dir(args), **given(args, EngineConfig, ENGINE_FIXED))
    params = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    print(f"[finish_reason={out.finish_reason} completion_tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from services.worker import WorkerOptions, serve_worker
    engine_kwargs = given(args, EngineConfig, ENGINE_FIXED)
    engine_kwargs.setdefault("num_threads", 1)
    config = EngineConfig(model=_model_dir(args), role=args.role, **engine_kwargs)
    options = WorkerOptions(host=args.host, port=args.port, worker_id=args.worker_id, metrics_port=args.metrics_port,
                            credentials=_credentials(args), config=config_from_args(WorkerConfig, args))
    asyncio.run(serve_worker(config, options))
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from services.router import RouterOptions, serve_router
    split = lambda s: [a for a in (s or "").split(",") if a]  # noqa: E731
    options = RouterOptions(model=_model_dir(args), prefill=split(args.prefill), decode=split(args.decode),
                            colocated=split(args.colocated), generation=config_from_args(GenerationOptions, args),
                            limits=config_from_args(RequestLimits, args), config=config_from_args(RouterConfig, args))
    asyncio.run(serve_router(options, args.host, args.port, args.metrics_port, credentials=_credentials(args),
                             api_key=_api_key(args)))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from services.launcher import Cluster, Stopped
    engine = EngineConfig(model=_model_dir(args), **given(args, EngineConfig, (*ENGINE_FIXED, *UP_PER_PROCESS)))
    router_args = [*config_to_argv(config_from_args(GenerationOptions, args)),
                   *config_to_argv(config_from_args(RequestLimits, args)),
                   *config_to_argv(config_from_args(RouterConfig, args, exclude=UP_ROUTER_OWN), exclude=UP_ROUTER_OWN)]
    api_key = _api_key(args)
    if api_key:
        os.environ["PDSERVE_API_KEY"] = api_key   # the router reads it from its environment, never argv
    spec = config_from_args(Deployment, args, model=engine.model,
                            engine_args=config_to_argv(engine, exclude=ENGINE_FIXED),
                            worker_args=config_to_argv(config_from_args(WorkerConfig, args), exclude=("drain_timeout_s",)),
                            router_args=router_args, credentials=_credentials(args))
    cluster = Cluster(spec)
    for sig in (signal.SIGINT, signal.SIGTERM):   # from the first moment: start-up is stoppable too
        signal.signal(sig, cluster.request_stop)
    print(f"pdserve: starting {spec.prefill_workers}P+{spec.decode_workers}D" if not spec.colocated_workers
          else f"pdserve: starting {spec.colocated_workers} colocated worker(s)", flush=True)
    try:
        cluster.start()
    except Stopped:
        print("pdserve: stopped during start-up", flush=True)
        return 0
    print(f"pdserve is up: router at {cluster.router_address}\n{cluster.describe()}", flush=True)
    print(f"try: pdserve generate --router {cluster.router_address} \"Once upon a time\"", flush=True)
    if args.http_port is not None:
        scheme = "https" if spec.credentials.tls is not None else "http"
        print(f"OpenAI-compatible HTTP API at {scheme}://{spec.host}:{args.http_port}/v1", flush=True)
    return cluster.wait()


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the process at ADDRESS reports SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with _credentials(args).sync_channel(args.address) as ch:
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
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS,
                        help="DEBUG, INFO, WARNING (default), ERROR; also reaches `up`'s children")
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving",
                                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a deterministic random-weight HF checkpoint", parents=[common])
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("generate", help="generate offline, or through a running router with --router", parents=[common])
    p.add_argument("prompt")
    p.add_argument("--router", default=None, help="router address HOST:PORT")
    p.add_argument("--api-key", default=None, help="the router's API key (default: $PDSERVE_API_KEY)")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("up", help="start router + workers as local processes, supervised", parents=[common])
    _add_model_arg(p)
    add_config_args(p.add_argument_group("deployment"), Deployment, exclude=("model",))
    add_config_args(p.add_argument_group("engine"), EngineConfig, exclude=(*ENGINE_FIXED, *UP_PER_PROCESS))
    add_config_args(p.add_argument_group("workers"), WorkerConfig, exclude=("drain_timeout_s",))
    add_config_args(p.add_argument_group("router"), GenerationOptions)
    add_config_args(p.add_argument_group("router process"), RouterConfig, exclude=UP_ROUTER_OWN)
    add_config_args(p.add_argument_group("request limits"), RequestLimits)
    _add_security_args(p, router=True)
    p.set_defaults(func=cmd_up)

    for name, role in (("worker", None), ("prefill", "prefill"), ("decode", "decode")):
        p = sub.add_parser(name, help=f"run one {role or 'engine'} worker", parents=[common])
        _add_engine_args(p)
        add_config_args(p.add_argument_group("worker"), WorkerConfig)
        if role is None:
            p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
        else:
            p.set_defaults(role=role)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--worker-id", default="")
        p.add_argument("--metrics-port", type=int, default=None)
        _add_security_args(p)
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("router", help="run the router", parents=[common])
    _add_model_arg(p)
    p.add_argument("--prefill", default="", help="comma-separated prefill worker addresses")
    p.add_argument("--decode", default="", help="comma-separated decode worker addresses")
    p.add_argument("--colocated", default="", help="comma-separated colocated worker addresses")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--metrics-port", type=int, default=None)
    add_config_args(p.add_argument_group("router"), RouterConfig)
    add_config_args(p.add_argument_group("generation"), GenerationOptions)
    add_config_args(p.add_argument_group("request limits"), RequestLimits)
    _add_security_args(p, router=True)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("health", help="check a process's grpc.health.v1 status", parents=[common])
    p.add_argument("address")
    p.add_argument("--timeout", type=float, default=2.0)
    _add_security_args(p)
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("bench", help="benchmarks: offline throughput, serving load test", add_help=False)
    p.add_argument("kind", choices=["offline", "serve"])
    p.set_defaults(func=cmd_bench)

    from services.ray_deploy.cli import add_ray_parser   # `pdserve ray up|down|status` (imports Ray only when run)
    add_ray_parser(sub, _add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    level = getattr(args, "log_level", None) or os.environ.get("PDSERVE_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ["PDSERVE_LOG_LEVEL"] = level   # `up`'s children inherit it
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except ValueError as exc:   # a bad setting: one line, not a traceback
        logging.getLogger("pdserve").debug("error", exc_info=True)
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
