"""`pdserve ray up | down | scale | status`: deploy pdserve onto a Ray cluster."""
from __future__ import annotations

import argparse
import json
import sys

from pdserve.engine.config import EngineConfig
from pdserve.services.cli.parser import add_engine_args, add_router_args, model_dir, router_argv
from pdserve.services.cli.usage_errors import RuntimeFailure
from pdserve.services.common.config_flags import add_config_args, config_from_args, config_to_argv, given
from pdserve.services.common.topology import ENGINE_FIXED, PER_WORKER, ROLES_SHARED, UP_OWN
from pdserve.services.deployment.progress import Progress
from pdserve.services.router.config import RouterConfig
from pdserve.services.workers.config import WorkerConfig


RAY_UP_FIXED = ("model", "name", "namespace")   # --model, and the flags every ray command has


def add_ray_parser(sub, parents: list[argparse.ArgumentParser] | tuple = ()) -> None:
    from pdserve.services.ray_deploy.deploy import RayDeployment   # lazy: grpc only when this runs
    p = sub.add_parser("ray", help="deploy onto a Ray cluster (ray up | ray down | ray scale | ray status)", parents=list(parents))
    rsub = p.add_subparsers(dest="ray_command", required=True, metavar="COMMAND")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--address", default="auto",
                       help="Ray cluster: auto (RAY_ADDRESS / this node's cluster), HOST:PORT, ray://HOST:PORT, or "
                            "local (a loopback-only head on this machine, started if needed, state in "
                            "$PDSERVE_HOME/ray)")
        q.add_argument("--name", default="pdserve", help="deployment name (actor name prefix)")
        q.add_argument("--namespace", default="pdserve", help="Ray namespace of the actors")

    up = rsub.add_parser("up", help="deploy router + prefill + decode actors; returns once the router is SERVING",
                         parents=list(parents))
    common(up)
    add_engine_args(up)
    add_config_args(up.add_argument_group("deployment"), RayDeployment, exclude=RAY_UP_FIXED)
    up.add_argument("--if-exists", default="fail", choices=["fail", "keep", "replace"],
                    help="when the deployment exists: fail; keep it if its router is SERVING (else replace it); "
                         "replace it. `keep` makes `ray up` idempotent (the KubeRay submitter runs it in a loop)")
    add_config_args(up.add_argument_group("workers"), WorkerConfig, exclude=(*PER_WORKER, *ROLES_SHARED))
    add_router_args(up, exclude=(*UP_OWN, "ready_timeout_s"))
    local = up.add_argument_group("--address local")
    local.add_argument("--local-num-cpus", type=float, default=None, metavar="N",
                       help="logical CPUs of the local head (default: none, this machine's cores)")
    local.add_argument("--local-num-gpus", type=int, default=None, metavar="N",
                       help="GPUs of the local head (default: none, the ones Ray detects)")
    local.add_argument("--local-object-store-mb", type=int, default=512, metavar="MB", help="object store size of the local head")
    up.add_argument("--json", action="store_true", help="print the deployment as JSON")
    up.set_defaults(func=cmd_ray_up)

    down = rsub.add_parser("down", help="remove a deployment (and a local cluster that holds nothing else)",
                           parents=list(parents))
    common(down)
    down.add_argument("--keep-local-cluster", action="store_true", help="--address local: leave the head running")
    down.set_defaults(func=cmd_ray_down)

    scale = rsub.add_parser("scale", help="change a running deployment's worker counts: new workers join its "
                                          "router, removed ones drain first (no request lost)", parents=list(parents))
    common(scale)
    scale.add_argument("--prefill-workers", type=int, default=None, metavar="N",
                       help="prefill workers wanted (default: none, unchanged)")
    scale.add_argument("--decode-workers", type=int, default=None, metavar="M",
                       help="decode workers wanted (default: none, unchanged)")
    scale.add_argument("--drain-timeout-s", type=float, default=0.0,
                       help="a removed worker's in-flight requests get this long, then move to other workers "
                            "(0: the router's --drain-timeout-s)")
    scale.add_argument("--timeout", type=float, default=180.0, help="seconds for each new worker to start")
    scale.add_argument("--insecure-internal-plane", action="store_true",
                       help="allow a router or new workers off loopback without mutual TLS: the cluster token's "
                            "proofs and the membership calls travel unencrypted (for trusted networks)")
    scale.set_defaults(func=cmd_ray_scale)

    status = rsub.add_parser("status", help="show a deployment", parents=list(parents))
    common(status)
    status.set_defaults(func=cmd_ray_status)


def ray_spec(args: argparse.Namespace, model: str):
    """The RayDeployment of `pdserve ray up`'s flags; the roles' settings as argv."""
    from pdserve.services.ray_deploy.deploy import RayDeployment   # lazy: grpc only when this runs

    engine = EngineConfig(model=model, **given(args, EngineConfig, ENGINE_FIXED))
    router_args = router_argv(args, config_from_args(RouterConfig, args, exclude=("ready_timeout_s",)))
    fixed = {"model": model, "name": args.name, "namespace": args.namespace,
             "engine_args": config_to_argv(engine, exclude=ENGINE_FIXED),
             "worker_args": config_to_argv(config_from_args(WorkerConfig, args), exclude=PER_WORKER), "router_args": router_args}
    return config_from_args(RayDeployment, args, exclude=RAY_UP_FIXED, **fixed)


def _existing(spec, if_exists: str):
    """What to do with a deployment of the same name: its DeploymentInfo to keep, or None to (re)deploy."""
    # lazy: grpc only when this runs
    from pdserve.services.ray_deploy.deploy import DeploymentError, describe, list_actors, teardown
    import ray


    if not list_actors(spec.name, spec.namespace) or if_exists == "fail":
        return None
    if if_exists == "keep":
        try:
            router = ray.get_actor(f"{spec.name}-router", namespace=spec.namespace)
            if ray.get(router.health.remote(), timeout=30) == "SERVING":
                return describe(spec.name, spec.namespace)
        except (ValueError, ray.exceptions.RayError, DeploymentError):
            pass
        print(f"pdserve: deployment {spec.name!r} exists but does not serve: replacing it", file=sys.stderr, flush=True)
    teardown(spec.name, spec.namespace)
    return None


def cmd_ray_up(args: argparse.Namespace) -> int:

    # lazy: grpc only when this runs
    from pdserve.services.ray_deploy.cluster import AuthError, connect, stop_local_cluster
    # lazy: grpc only when this runs
    from pdserve.services.ray_deploy.deploy import DeploymentError, deploy, job_runtime_env
    # a model the local machine resolves (fetches, converts) where it is read here; on a remote
    # cluster a directory given as --model must be on the nodes
    spec = ray_spec(args, model_dir(args, check=args.address == "local" or args.ship_model))
    spec.validate()
    started = []
    try:
        try:
            local = connect(args.address, args.namespace, runtime_env=job_runtime_env(spec),
                            on_local_start=started.append, num_cpus=args.local_num_cpus,
                            num_gpus=args.local_num_gpus, object_store_bytes=args.local_object_store_mb << 20)
        except AuthError as exc:
            raise RuntimeFailure(str(exc)) from None
        if local is not None:
            print(f"pdserve: local Ray cluster at {local.address} ({'started' if started else 'running'}; "
                  f"loopback only, token auth)", file=sys.stderr, flush=True)
        try:
            info = _existing(spec, args.if_exists)
            if info is not None:
                print(f"pdserve: deployment {spec.name!r} is already up", file=sys.stderr, flush=True)
            else:
                with Progress().step(f"deploying {spec.prefill_workers} prefill + {spec.decode_workers} decode "
                                     f"worker(s) and a router on Ray", done="up"):
                    info = deploy(spec)
        except DeploymentError as exc:
            raise RuntimeFailure(f"ray up: {exc}") from None
    except BaseException:
        for cluster in started:   # a failed `ray up` leaves no local head it started behind
            _shutdown_ray()
            stop_local_cluster(cluster)
            print(f"pdserve: stopped the local Ray cluster it had started at {cluster.address}",
                  file=sys.stderr, flush=True)
        raise
    if args.json:
        print(json.dumps({"name": info.name, "namespace": info.namespace, "router_address": info.router_address,
                          "router_node_ip": info.router_node_ip, "workers": info.workers,
                          "ray_address": local.address if local else args.address}), flush=True)
    else:
        print(info.describe(), flush=True)
        print(f"pdserve is up ({info.seconds:.1f}s); try: pdserve chat --router {info.router_address}", flush=True)
    return 0


def _shutdown_ray() -> None:
    import ray
    if ray.is_initialized():
        ray.shutdown()


def cmd_ray_down(args: argparse.Namespace) -> int:

    # lazy: grpc only when this runs
    from pdserve.services.ray_deploy.cluster import load_local_cluster, stop_local_cluster
    from pdserve.services.ray_deploy.deploy import teardown   # lazy: grpc only when this runs
    if args.address == "local":
        saved = load_local_cluster()
        if saved is None or not saved.alive():
            print("pdserve ray down: no local cluster is running", file=sys.stderr)
            return 0
    local = _connect(args.address, args.namespace)
    import ray

    removed = teardown(args.name, args.namespace)
    print("removed: " + (", ".join(removed) if removed else "nothing"), flush=True)
    others = ray.util.list_named_actors(all_namespaces=True)
    ray.shutdown()
    if local is not None and not args.keep_local_cluster:
        if others:
            print(f"local cluster {local.address} kept: it still holds {len(others)} named actor(s)", flush=True)
        else:
            stop_local_cluster(local)
            print(f"stopped the local cluster at {local.address}", flush=True)
    return 0


def _connect(address: str, namespace: str):
    from pdserve.services.ray_deploy.cluster import AuthError, connect   # lazy: grpc only when this runs
    try:
        return connect(address, namespace)
    except AuthError as exc:
        raise RuntimeFailure(str(exc)) from None


def cmd_ray_scale(args: argparse.Namespace) -> int:
    from pdserve.services.ray_deploy.scale import ScaleError, scale   # lazy: grpc only when this runs
    if args.prefill_workers is None and args.decode_workers is None:
        raise ValueError("ray scale: give --prefill-workers N and/or --decode-workers M")
    if not args.drain_timeout_s >= 0:
        raise ValueError(f"--drain-timeout-s must be >= 0, got {args.drain_timeout_s}")
    _connect(args.address, args.namespace)
    try:
        result = scale(args.name, args.namespace, {"prefill": args.prefill_workers, "decode": args.decode_workers},
                       args.drain_timeout_s, args.timeout, insecure_plane=args.insecure_internal_plane)
    except ScaleError as exc:
        raise RuntimeFailure(f"ray scale: {exc}") from None
    print(result.describe(), flush=True)
    return 0


def cmd_ray_status(args: argparse.Namespace) -> int:
    from pdserve.services.ray_deploy.cluster import load_local_cluster   # lazy: grpc only when this runs
    from pdserve.services.ray_deploy.deploy import describe   # lazy: grpc only when this runs
    if args.address == "local" and (load_local_cluster() is None or not load_local_cluster().alive()):
        print("no local cluster is running", file=sys.stderr)
        return 1
    _connect(args.address, args.namespace)
    info = describe(args.name, args.namespace)
    if info is None:
        print(f"no deployment {args.name!r} in namespace {args.namespace!r}", file=sys.stderr)
        return 1
    print(info.describe())
    return 0
