"""The `pdserve` command line. Settings flags are generated from the config dataclasses
(services/common/config_flags.py): EngineConfig, WorkerConfig, RouterConfig, GenerationOptions,
RequestLimits, Deployment."""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import sys

from pdserve.engine.config import EngineConfig
from pdserve.engine.presets import ARCHITECTURES, DEFAULT_ARCH, DEFAULT_PRESET, PUBLIC_PRESETS
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.settings import ENV, pdserve_home
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.cli.certs_cmd import add_certs_args
from pdserve.services.cli.chat_cmd import add_chat_args
from pdserve.services.cli.parser import (CLIParser, add_engine_args, add_model_arg, add_router_args, model_dir,
    router_argv)
from pdserve.services.cli.ray_cmd import add_ray_parser
from pdserve.services.cli.usage_errors import EXIT_USAGE, RuntimeFailure, UsageError, configure_logging, parse_log_level
from pdserve.services.cli.workers_cmd import add_workers_args, run_workers
from pdserve.services.common.config_flags import (add_config_args, config_from_args, config_to_argv, field_default,
                                                  given, none_or)
from pdserve.services.common.topology import (DEFAULT_HOST, ENGINE_FIXED, PER_WORKER, ROLES_SHARED, ROUTER_PORT,
    SERVE_HTTP_PORT, UP_OWN, UP_PER_PROCESS, WORKER_THREADS)
from pdserve.services.deployment.progress import Progress
from pdserve.services.router.config import GenerationOptions, RouterConfig
from pdserve.services.workers.config import WorkerConfig

# Importing this module, and `pdserve --help` or `pdserve generate --router`, must not import torch
# or transformers (seconds on a small machine): the engine, the router and the workers are imported
# in the handlers that run them, and a subcommand's flags are built only when it is the one given
# (tests/e2e/test_cli_vllm_habits.py checks sys.modules).
CONNECT_TIMEOUT_S = 2.0                   # `generate --router`: an unreachable router fails this soon
LOG_LEVEL_ENV = ENV.LOG_LEVEL.name
INSECURE_PLANE_FLAG = "--insecure-internal-plane"   # as services.common.security's (not imported here: grpc)


def _log_level(text: str) -> str:
    try:
        return parse_log_level(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_security_args(p: argparse.ArgumentParser, router: bool = False, member: bool = False,
                       binds: bool = False, admin: bool = False) -> None:
    """member: a role of the internal plane (worker, router); binds: a command that binds it on
    --host, itself or through its children (every member, `up`, `serve'); admin: the planner."""
    g = p.add_argument_group("security")
    g.add_argument("--cluster-token-file", default=None,
                   help="file holding the deployment's internal-plane secret (default: $PDSERVE_CLUSTER_TOKEN)")
    if router or admin:   # never a worker's: members hold only the cluster token
        g.add_argument("--admin-token-file", help="file of the router's admin secret (default: $PDSERVE_ADMIN_TOKEN)")
    if member:   # a role of the internal plane: refuses to start without the token unless this is given
        g.add_argument("--insecure-no-auth", action="store_true",
                       help="start without a cluster token: the internal plane is open to every local user "
                            "(loopback --host only; for experiments)")
    if member or binds:   # a non-loopback --host without TLS refuses to start unless this is given
        g.add_argument(INSECURE_PLANE_FLAG, action="store_true",
                       help="allow a non-loopback --host without mutual TLS: KV and the cluster token's proofs "
                            "travel unencrypted (warned at start; refused with a wildcard --host such as "
                            "0.0.0.0 or ::; for trusted networks and tests)")
    for name, what in (("cert", "this process's certificate"), ("key", "its private key"),
                       ("ca", "the deployment CA")):
        g.add_argument(f"--tls-{name}", default=None, help=f"mutual TLS on every channel: {what} (PEM)")
    if router:
        g.add_argument("--api-key", default=None,
                       help="key clients must send (authorization: Bearer KEY); prefer --api-key-file or "
                            "$PDSERVE_API_KEY, since argv is visible to other local users")
        g.add_argument("--api-key-file", default=None, help="file holding the API key")


def _add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none, no endpoint)")
    p.add_argument("--metrics-token-file", default=None, metavar="FILE",
                   help="scrapes of /metrics must send this file's token as `Authorization: Bearer TOKEN` "
                        "(default: $PDSERVE_METRICS_TOKEN, else no token)")


def _split(addresses: str | None) -> list[str]:
    return [a for a in (addresses or "").split(",") if a]


def plane_reach(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a command's internal plane binds and what it dials: a router dials its workers (its
    own --host is the client API, guarded by the API key); a worker, `up` and `serve` bind --host."""
    if args.command == "router":
        return (), (*_split(args.prefill), *_split(args.decode), *_split(args.colocated))
    return (args.host or DEFAULT_HOST,), tuple(_split(getattr(args, "router", None)))


def _credentials(args: argparse.Namespace, role: str | None = None):
    """The process's credentials. For a role of the internal plane (role given) a cluster token is
    required unless --insecure-no-auth, and a plane reaching past loopback (``plane_reach``) needs
    mutual TLS unless --insecure-internal-plane (ValueError: exit code 2, one line naming the flags)."""
    # lazy: grpc only when this runs
    from pdserve.services.common.security import Credentials, require_cluster_token, require_secure_internal_plane
    admin_file = getattr(args, "admin_token_file", None)   # the admin token: only where the flag is (never a worker)
    creds = Credentials.load(args.cluster_token_file, args.tls_cert, args.tls_key, args.tls_ca,
                             admin=hasattr(args, "admin_token_file"), admin_token_file=admin_file)
    if role is not None:
        if hasattr(args, "insecure_no_auth"):   # the members; `up` makes a token for its children
            require_cluster_token(creds, args.host, args.insecure_no_auth, role)
        binds, dials = plane_reach(args)
        require_secure_internal_plane(creds, role, binds=binds, dials=dials,
                                      insecure_plane=args.insecure_internal_plane)
    return creds


def _plane_argv(args: argparse.Namespace) -> list[str]:
    """The internal-plane flag `up` hands its children (they bind its --host)."""
    return [INSECURE_PLANE_FLAG] if args.insecure_internal_plane else []


def _api_key(args: argparse.Namespace) -> str | None:
    from pdserve.services.common.security import API_KEY_ENV, read_secret   # lazy: grpc only when this runs
    if args.api_key:
        return args.api_key
    return read_secret(args.api_key_file, API_KEY_ENV, "API key")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=field_default(SamplingParams, "max_tokens"),
                   help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: none, i.e. 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: none, all)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed (default: none, the engine's --seed)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


# ---- commands ---------------------------------------------------------------------
def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.engine.model_maker import make_model   # lazy: torch only when this runs
    print(make_model(args.dir, preset=args.preset, arch=args.arch, seed=args.seed))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.services.client import Client   # lazy: grpc only when this runs
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.sampling_seed, "ignore_eos": args.ignore_eos}
    if args.router:
        import grpc

        final = None
        try:
            with Client(args.router, api_key=args.api_key, connect_timeout=CONNECT_TIMEOUT_S) as client:
                for msg in client.generate_stream(args.prompt, **{k: v for k, v in sampling.items() if v is not None}):
                    print(msg.text, end="", flush=True)
                    final = msg
        except grpc.RpcError as exc:
            if final is not None:
                print()
            raise RuntimeFailure(_router_error(args.router, exc)) from None
        print()
        if final is not None and final.finished:
            print(f"[finish_reason={final.finish_reason} prompt_tokens={final.usage.prompt_tokens} "
                  f"completion_tokens={final.usage.completion_tokens} ttft_ms={final.timings.ttft_ms:.1f}]",
                  file=sys.stderr)
        return 0
    from pdserve.engine import LLM   # lazy: the engine (torch) only for an offline generate
    model = model_dir(args)
    with Progress().step(f"loading {model}"):
        llm = LLM(model, **given(args, EngineConfig, ENGINE_FIXED))
    params = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    print(f"[finish_reason={out.finish_reason} completion_tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def _router_error(address: str, exc) -> str:
    """One line for a failed call to the router."""
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    if code == "UNAVAILABLE":
        return (f"cannot reach the router at {address} (UNAVAILABLE): is it running? start one with `pdserve up`, "
                f"or pass its address with --router HOST:PORT")
    if code == "UNAUTHENTICATED":
        return f"the router at {address} wants an API key: pass --api-key or set $PDSERVE_API_KEY"
    if code == "DEADLINE_EXCEEDED":
        return f"the router at {address} did not answer in time (DEADLINE_EXCEEDED)"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"the router at {address} answered {code}: {details}"


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.services.common.metrics import read_metrics_token   # lazy: grpc, prometheus_client only when this runs
    from pdserve.services.workers.options import WorkerOptions   # lazy: grpc only when this runs
    from pdserve.engine.parallel import RankFailure   # lazy: torch only when this runs
    from pdserve.services.workers.worker_process import serve_worker   # lazy: torch only when this runs
    engine_kwargs = given(args, EngineConfig, ENGINE_FIXED)
    engine_kwargs.setdefault("num_threads", WORKER_THREADS)
    config = EngineConfig(model=model_dir(args), role=args.role, **engine_kwargs)
    credentials = _credentials(args, f"{args.role} worker")
    print(f"pdserve {args.role} worker {args.worker_id or ''}: loading {config.model}".replace(" :", ":"),
          file=sys.stderr, flush=True)
    options = WorkerOptions(host=args.host, port=args.port, worker_id=args.worker_id, metrics_port=args.metrics_port,
                            metrics_token=read_metrics_token(args.metrics_token_file), credentials=credentials,
                            config=config_from_args(WorkerConfig, args))
    try:
        asyncio.run(serve_worker(config, options))
    except RankFailure as exc:   # exit 1: `pdserve up` restarts the worker
        raise RuntimeFailure(f"{args.role} worker {args.worker_id or ''}: {exc}".replace(" :", ":")) from None
    return 0


def _served_names(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The HTTP API's model names, as vLLM's: --served-model-name, else --model exactly as given (what
    `vllm bench serve` and openai clients send), else the default model's name (not its cache dir's)."""
    from pdserve.engine.checkpoints.default_model import DEFAULT_MODEL   # lazy: torch only when this runs
    if args.served_model_name:
        return tuple(args.served_model_name)
    return (args.model,) if args.model else (DEFAULT_MODEL.name,)


def _check_port(host: str, port: int, what: str, flag: str) -> None:
    """A busy port is a usage error (exit 2) that says which flag picks another."""
    from pdserve.services.common.grpc_setup import check_port_free   # lazy: grpc only when this runs
    try:
        check_port_free(host, port)
    except OSError as exc:
        raise UsageError(f"{what}: {exc.strerror or exc}; stop what holds it, or choose another port with "
                         f"{flag} PORT") from None


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.services.common.metrics import read_metrics_token   # lazy: grpc, prometheus_client only when this runs
    from pdserve.services.api.grpc_router import RouterOptions, serve_router   # lazy: transformers only when this runs
    _check_port(args.host, args.port, "the router's port", "--port")
    if args.http_port:
        _check_port(args.host, args.http_port, "the HTTP API's port", "--http-port")
    options = RouterOptions(model=model_dir(args), prefill=_split(args.prefill), decode=_split(args.decode),
                            colocated=_split(args.colocated), generation=config_from_args(GenerationOptions, args),
                            limits=config_from_args(RequestLimits, args),
                            config=config_from_args(RouterConfig, args, served_model_name=_served_names(args)),
                            workers_file=args.workers_file)
    asyncio.run(serve_router(options, args.host, args.port, args.metrics_port, credentials=_credentials(args, "router"),
                             api_key=_api_key(args), metrics_token=read_metrics_token(args.metrics_token_file),
                             remote_workers=args.insecure_internal_plane))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.services.deployment.launcher import Cluster, Deployment, Stopped   # lazy: grpc only when this runs
    import signal

    progress = Progress()
    port_flag = "--grpc-port" if args.command == "serve" else "--port"
    _check_port(args.host or DEFAULT_HOST, ROUTER_PORT if args.port is None else args.port, "the router's port",
                port_flag)
    if args.http_port:
        _check_port(args.host or DEFAULT_HOST, args.http_port, "the HTTP API's port",
                    "--port" if args.command == "serve" else "--http-port")
    engine = EngineConfig(model=model_dir(args), **given(args, EngineConfig, (*ENGINE_FIXED, *UP_PER_PROCESS)))
    router = config_from_args(RouterConfig, args, exclude=UP_OWN, served_model_name=_served_names(args))
    router_args = [*router_argv(args, router), *_plane_argv(args)]
    api_key = _api_key(args)
    if api_key:
        ENV.API_KEY.set(api_key)   # the router reads it from its environment, never argv
    log_dir = args.log_dir or str(pdserve_home() / "logs" / f"up-{args.port or ROUTER_PORT}")
    spec = config_from_args(Deployment, args, model=engine.model, engine_tp=engine.tensor_parallel_size,
                            engine_args=config_to_argv(engine, exclude=ENGINE_FIXED),
                            worker_args=[*config_to_argv(config_from_args(WorkerConfig, args),
                                                         exclude=(*UP_OWN, *PER_WORKER)),
                                         *_plane_argv(args)],
                            router_args=router_args,
                            credentials=_credentials(args, "deployment"),
                            log_dir=None if log_dir == "-" else log_dir)
    cluster = Cluster(spec)
    for sig in (signal.SIGINT, signal.SIGTERM):   # from the first moment: start-up is stoppable too
        signal.signal(sig, cluster.request_stop)
    what = (f"{spec.prefill_workers} prefill + {spec.decode_workers} decode worker(s)" if not spec.colocated_workers
            else f"{spec.colocated_workers} colocated worker(s)")
    progress.say(f"starting {what} and a router (pdserve {_version()}, model {spec.model})"
                 + (f"; logs in {spec.log_dir}" if spec.log_dir else ""))
    try:
        cluster.start(progress=progress)
    except Stopped:
        print("pdserve: stopped during start-up", flush=True)
        return 0
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:   # taken since the check above: a usage error, as `pdserve router`'s
            raise UsageError(f"{exc}; choose another port with {port_flag} PORT") from None
        raise RuntimeFailure(str(exc)) from None
    except (RuntimeError, TimeoutError) as exc:   # a child that could not start
        raise RuntimeFailure(str(exc)) from None
    print(f"pdserve is up: router at {cluster.router_address}\n{cluster.describe()}", flush=True)
    print(f"try: pdserve chat --router {cluster.router_address}", flush=True)
    if args.http_port is not None:
        scheme = "https" if spec.credentials.tls is not None else "http"
        from pdserve.services.api.grpc_router import served_model_names   # lazy: transformers only when this runs
        name = served_model_names(router, engine.model)[0]
        print(f"OpenAI-compatible HTTP API at {scheme}://{spec.host}:{args.http_port}/v1, model name {name!r}",
              flush=True)
        body = json.dumps({"model": name, "prompt": "Once upon a time", "max_tokens": 16})
        print(f"try: curl {scheme}://{spec.host}:{args.http_port}/v1/completions -H 'Content-Type: "
              f"application/json' -d '{body}'", flush=True)
    return cluster.wait()


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the process at ADDRESS reports SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with _credentials(args).probe_channel(args.address) as ch:   # health checks carry no secret
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_profile(args: argparse.Namespace) -> int:
    # lazy: grpc, numpy, prometheus_client only when this runs
    from pdserve.services.planner.profile import ProfileConfig, run_profile
    engine_kwargs = given(args, EngineConfig, ENGINE_FIXED)
    engine_kwargs.setdefault("num_threads", WORKER_THREADS)   # as each worker `pdserve up` starts
    engine = EngineConfig(model=model_dir(args), **engine_kwargs)
    import signal
    config = config_from_args(ProfileConfig, args)
    # SIGTERM as an exit: the finally blocks stop its serving measurement's `pdserve up`
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    model = run_profile(engine, config, say=lambda line: print(line, file=sys.stderr, flush=True))
    out = config.out or str(pdserve_home() / "profiles" / f"{os.path.basename(os.path.normpath(engine.model))}.json")
    path = model.save(out)
    print(f"cost model ({len(model.samples)} steps in {model.machine['seconds']}s):\n{model.describe()}")
    print(f"wrote {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.services.planner.plan import PlanConfig, run_plan   # lazy: torch only when this runs
    from pdserve.services.planner.watch import WatchConfig, run_watch   # lazy: torch only when this runs
    plan = config_from_args(PlanConfig, args, slos=tuple(args.slo or ()))
    watch = config_from_args(WatchConfig, args)
    return run_watch(plan, watch, _credentials(args)) if watch.watch else run_plan(plan)


BENCH_HELP = """usage: pdserve bench {offline,serve} [FLAGS]

benchmarks:
  serve     load test against a running router: TTFT, TPOT, ITL, throughput (like `vllm bench serve`)
  offline   offline throughput of the engine against Hugging Face transformers

`pdserve bench serve --help` and `pdserve bench offline --help` list each one's flags."""


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    # lazy: grpc, numpy only when this runs
    from pdserve.services.loadtest import offline as offline_bench, serve as serve_bench
    if args.kind is None:
        if any(a in ("-h", "--help") for a in rest):
            print(BENCH_HELP)
            return 0
        raise UsageError("choose a benchmark: `pdserve bench serve` or `pdserve bench offline` "
                         "(see `pdserve bench --help`)")
    bench_main = offline_bench.main if args.kind == "offline" else serve_bench.main
    try:
        return bench_main(rest) or 0
    except SystemExit as exc:     # argparse's --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)


def _p_make_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the checkpoint to")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=list(PUBLIC_PRESETS),
                   help="model size: " + "; ".join(f"{name}: {about}" for name, about in PUBLIC_PRESETS.items()))
    p.add_argument("--arch", default=None, choices=list(ARCHITECTURES),
                   help=f"architecture (default: the preset's own, else {DEFAULT_ARCH})")
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.set_defaults(func=cmd_make_model)


def _p_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--router", default=None, metavar="HOST:PORT",
                   help="a running router's address (default: none, generate offline in this process)")
    p.add_argument("--api-key", default=None,
                   help="the router's API key (default: $PDSERVE_API_KEY; argv is visible to other local users)")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def _add_up_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """`up`'s flags; `serve` (vLLM's shape) has the model positional, --port for the HTTP API
    (default 8000) and --grpc-port for the router's gRPC API."""
    from pdserve.services.deployment.launcher import Deployment   # lazy: grpc only when this runs
    if serve:
        p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="a checkpoint directory, .gguf file, Hub id (ORG/NAME) or `tiny`, served under this "
                            "name as given (default: SmolLM2-135M-Instruct)")
        p.add_argument("--port", dest="http_port", type=int, default=SERVE_HTTP_PORT,
                       help="the OpenAI-compatible HTTP API's port")
        p.add_argument("--grpc-port", dest="port", type=int, default=None,
                       help=f"the router's gRPC port (default: {ROUTER_PORT})")
    else:
        add_model_arg(p)
        p.add_argument("--http-port", type=none_or(int), default=SERVE_HTTP_PORT, metavar="PORT",
                       help=f"the OpenAI-compatible HTTP API's port (default: {SERVE_HTTP_PORT}; none: no HTTP API)")
    dep_exclude = ("model", "port") if serve else ("model",)
    add_config_args(p.add_argument_group("deployment"), Deployment, exclude=dep_exclude)
    add_config_args(p.add_argument_group("engine"), EngineConfig, exclude=(*ENGINE_FIXED, *UP_PER_PROCESS))
    add_config_args(p.add_argument_group("workers"), WorkerConfig, exclude=(*UP_OWN, *PER_WORKER, *ROLES_SHARED))
    add_router_args(p, exclude=(*UP_OWN, "http_port"))
    _add_security_args(p, router=True, binds=True)
    p.set_defaults(func=cmd_up)


def _p_worker(p: argparse.ArgumentParser, role: str | None) -> None:
    add_engine_args(p)
    add_config_args(p.add_argument_group("worker"), WorkerConfig)
    if role is None:
        p.add_argument("--role", required=True, choices=["prefill", "decode", "both"],
                       help="prefill, decode, or both (colocated)")
    else:
        p.set_defaults(role=role)
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0: a free one, printed")
    p.add_argument("--worker-id", default="", help="name in metrics and status (default: ROLE-RANDOM)")
    _add_metrics_args(p)
    _add_security_args(p, member=True)
    p.set_defaults(func=cmd_worker)


def _p_router(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    for role in ("prefill", "decode", "colocated"):   # more may join: a worker's --router, or --workers-file
        p.add_argument(f"--{role}", default="", metavar="ADDRS", help=f"comma-separated {role} worker addresses")
    p.add_argument("--workers-file", metavar="PATH", help="more workers, a 'ROLE HOST:PORT' per line, followed as "
                   "the file changes (docs/architecture.md, Membership)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind")
    p.add_argument("--port", type=int, default=ROUTER_PORT, help="the public gRPC port")
    _add_metrics_args(p)
    add_router_args(p)
    _add_security_args(p, router=True, member=True)
    p.set_defaults(func=cmd_router)


def _p_health(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="HOST:PORT of a router or worker")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    _add_security_args(p)
    p.set_defaults(func=cmd_health)


def _p_workers(p: argparse.ArgumentParser) -> None:
    add_workers_args(p, _add_security_args)
    p.set_defaults(func=run_workers)


def _p_profile(p: argparse.ArgumentParser) -> None:
    # lazy: grpc, numpy, prometheus_client only when this runs
    from pdserve.services.planner.profile import ProfileConfig
    add_engine_args(p)
    add_config_args(p.add_argument_group("profile"), ProfileConfig)
    p.set_defaults(func=cmd_profile)


def _p_plan(p: argparse.ArgumentParser) -> None:
    from pdserve.services.planner.plan import PlanConfig   # lazy: torch only when this runs
    from pdserve.services.planner.watch import WatchConfig   # lazy: torch only when this runs
    add_config_args(p.add_argument_group("plan"), PlanConfig)
    add_config_args(p.add_argument_group("watch: re-plan a running deployment"), WatchConfig)
    _add_security_args(p, admin=True)
    p.add_argument("--slo", action="append", metavar="METRIC:MS",
                   help="a latency objective, repeatable: ttft, tpot or e2el in ms, e.g. --slo ttft:500 --slo tpot:50 "
                        "(as `bench serve --goodput`)")
    p.set_defaults(func=cmd_plan)


def _p_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", nargs="?", choices=["offline", "serve"], default=None, help="which benchmark")
    p.set_defaults(func=cmd_bench)


# name -> (help, builder of its flags, extra add_parser arguments); built only for the command given.
COMMANDS: dict[str, tuple[str, object, dict]] = {
    "make-model": ("write a deterministic random-weight HF checkpoint", _p_make_model, {}),
    "generate": ("generate offline, or through a running router with --router", _p_generate, {}),
    "chat": ("chat with the model interactively (as `ollama run`), offline or through a running router with --router",
             lambda p: add_chat_args(p, _router_error), {}),
    "serve": (f"serve MODEL with the OpenAI-compatible HTTP API on port {SERVE_HTTP_PORT}, as `vllm serve MODEL` "
              f"(`pdserve up` with the model positional: 1 prefill + 1 decode worker and a router)",
              lambda p: _add_up_args(p, serve=True), {}),
    "up": (f"start router + workers as local processes, supervised (gRPC on {ROUTER_PORT}, HTTP on {SERVE_HTTP_PORT})",
           _add_up_args, {}),
    "worker": ("run one engine worker", lambda p: _p_worker(p, None), {}),
    "prefill": ("run one prefill worker", lambda p: _p_worker(p, "prefill"), {}),
    "decode": ("run one decode worker", lambda p: _p_worker(p, "decode"), {}),
    "router": ("run the router", _p_router, {}),
    "health": ("check a process's grpc.health.v1 status", _p_health, {}),
    "workers": ("show and change a running router's workers: list, add, drain, resume, remove, switch-role",
                _p_workers, {}),
    "profile": ("measure engine step costs on this machine and save a cost model", _p_profile, {}),
    "plan": ("simulate deployments on a profile's cost model and recommend one under SLOs", _p_plan, {}),
    "certs": ("make a deployment CA and a certificate per host (mutual TLS across hosts)", add_certs_args, {}),
    "bench": ("benchmarks: serving load test, offline throughput (`pdserve bench --help`)", _p_bench,
              {"add_help": False}),
}
ALL = "*"


def build_parser(command: str | None = ALL) -> argparse.ArgumentParser:
    """The `pdserve` parser. command: build only that subcommand's flags (the others are listed by
    name and help), so that parsing a client command imports nothing heavy; ALL (the default):
    every subcommand's flags, for tests and documentation."""
    common = CLIParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, type=_log_level, metavar="LEVEL",
                        help=f"DEBUG, INFO, WARNING, ERROR or CRITICAL, before or after the subcommand; reaches "
                             f"the processes `up` and `ray up` start (default: ${LOG_LEVEL_ENV}, else WARNING)")
    parser = CLIParser(prog="pdserve", parents=[common],
                       description="Disaggregated prefill/decode LLM serving: `pdserve up` serves the default "
                                   "model (SmolLM2-135M-Instruct) on 127.0.0.1:50051, `pdserve serve MODEL` serves MODEL with the "
                                   "OpenAI-compatible HTTP API on 127.0.0.1:8000; `pdserve COMMAND --help` explains "
                                   "each command.",
                       epilog=f"environment: {ENV.documented()}")
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, build, extra) in COMMANDS.items():
        p = sub.add_parser(name, help=text, parents=[common], **extra)
        if command in (ALL, name):
            build(p)
    if command in (ALL, "ray"):
        add_ray_parser(sub, parents=[common])
    else:
        sub.add_parser("ray", help="deploy onto a Ray cluster (ray up | ray down | ray scale | ray status)", parents=[common])
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand argv names (the first word that is not a global flag or its value)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--log-level":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 a runtime failure (unreachable router, failed start), 2 a usage error;
    either failure is one `pdserve: error: ...` line on stderr (tracebacks with --log-level DEBUG)."""
    if ENV.PARENT_PID.is_set():
        from pdserve.services.deployment.launcher import die_with_parent   # lazy: grpc only for a child of `up`
        die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_of(argv))
    args, rest = parser.parse_known_args(argv)
    try:
        level = getattr(args, "log_level", None) or parse_log_level(ENV.LOG_LEVEL.get())
    except ValueError as exc:
        print(f"pdserve: error: ${LOG_LEVEL_ENV} {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(level)
    ENV.LOG_LEVEL.set(level)   # the processes `up` starts inherit it
    try:
        if args.command == "bench":
            return cmd_bench(args, rest)
        if rest:   # named by the subcommand that was given, with its help
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(rest)}")
        return args.func(args)
    except (UsageError, RuntimeFailure) as exc:
        logging.getLogger("pdserve").debug("error", exc_info=True)
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (ValueError, OSError) as exc:   # a bad setting, a busy port, an unreadable file: one line
        logging.getLogger("pdserve").debug("error", exc_info=True)
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pdserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
