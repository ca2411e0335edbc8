"""`pdserve ray up | down | status`: deploy pdserve onto a Ray cluster."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable


def add_ray_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("ray", help="deploy onto a Ray cluster (ray up | ray down | ray status)")
    rsub = p.add_subparsers(dest="ray_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--address", default="auto",
                       help="Ray cluster: auto (RAY_ADDRESS / this node's cluster), HOST:PORT, ray://HOST:PORT, or "
                            "local (a loopback-only head on this machine, started if needed)")
        q.add_argument("--name", default="pdserve", help="deployment name (actor name prefix)")
        q.add_argument("--namespace", default="pdserve", help="Ray namespace of the actors")

    up = rsub.add_parser("up", help="deploy router + prefill + decode actors; returns once the router is SERVING")
    common(up)
    add_engine_args(up)
    up.add_argument("--prefill-workers", type=int, default=1)
    up.add_argument("--decode-workers", type=int, default=1)
    up.add_argument("--host", default="127.0.0.1", help="router bind address (node-ip: the head node's cluster IP)")
    up.add_argument("--port", type=int, default=50051, help="router port")
    up.add_argument("--kv-transport", default="ray", choices=["ray", "grpc"],
                    help="KV blocks through Ray's object store (default) or over gRPC KVTransfer")
    up.add_argument("--worker-host", default="127.0.0.1",
                    help="workers' gRPC bind address; loopback pins every actor to the head node, "
                         "node-ip lets workers spread over nodes")
    up.add_argument("--worker-cpus", type=float, default=1.0)
    up.add_argument("--worker-gpus", type=float, default=None, help="default: 1 if the cluster has GPUs, else 0")
    up.add_argument("--router-cpus", type=float, default=1.0)
    up.add_argument("--placement-strategy", default="SPREAD", choices=["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"])
    up.add_argument("--max-restarts", type=int, default=-1, help="per actor; -1: unlimited")
    up.add_argument("--ship-model", action="store_true",
                    help="upload --model through the runtime env (working_dir) instead of reading a shared path")
    up.add_argument("--worker-wait", type=float, default=60.0,
                    help="seconds the router holds a request while no worker of a role is healthy (restarts)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the deployment to serve")
    up.add_argument("--local-num-cpus", type=float, default=None, help="--address local: CPUs of the head")
    up.add_argument("--local-num-gpus", type=int, default=None, help="--address local: GPUs of the head")
    up.add_argument("--local-object-store-mb", type=int, default=512, help="--address local: object store size")
    up.add_argument("--json", action="store_true", help="print the deployment as JSON")
    up.set_defaults(func=cmd_ray_up)

    down = rsub.add_parser("down", help="remove a deployment (and a local cluster that holds nothing else)")
    common(down)
    down.add_argument("--keep-local-cluster", action="store_true", help="--address local: leave the head running")
    down.set_defaults(func=cmd_ray_down)

    status = rsub.add_parser("status", help="show a deployment")
    common(status)
    status.set_defaults(func=cmd_ray_status)


def _engine_settings(args: argparse.Namespace) -> dict:
    from engine.config import EngineConfig
    from services.cli import ENGINE_FIXED
    from services.config_cli import given
    return given(args, EngineConfig, ENGINE_FIXED)


def cmd_ray_up(args: argparse.Namespace) -> int:
    from services.cli import _model_dir
    from services.ray_deploy.cluster import connect
    from services.ray_deploy.deploy import DeploymentError, RayDeployment, deploy, job_runtime_env

    spec = RayDeployment(
        model=_model_dir(args), prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        name=args.name, namespace=args.namespace, host=args.host, port=args.port, worker_host=args.worker_host,
        kv_transport=args.kv_transport, engine=_engine_settings(args), worker_cpus=args.worker_cpus,
        worker_gpus=args.worker_gpus, router_cpus=args.router_cpus, placement_strategy=args.placement_strategy,
        max_restarts=args.max_restarts, ship_model=args.ship_model, worker_wait_s=args.worker_wait,
        ready_timeout_s=args.timeout)
    spec.validate()
    local = connect(args.address, args.namespace, runtime_env=job_runtime_env(spec),
                    num_cpus=args.local_num_cpus, num_gpus=args.local_num_gpus,
                    object_store_bytes=args.local_object_store_mb << 20)
    if local is not None:
        print(f"local Ray cluster at {local.address} (loopback only, token auth)", file=sys.stderr, flush=True)
    try:
        info = deploy(spec)
    except DeploymentError as exc:
        print(f"pdserve ray up: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"name": info.name, "namespace": info.namespace, "router_address": info.router_address,
                          "router_node_ip": info.router_node_ip, "workers": info.workers,
                          "ray_address": local.address if local else args.address}), flush=True)
    else:
        print(info.describe(), flush=True)
        print(f"pdserve is up ({info.seconds:.1f}s); try: pdserve generate --router {info.router_address} "
              f"\"Once upon a time\"", flush=True)
    return 0


def cmd_ray_down(args: argparse.Namespace) -> int:
    from services.ray_deploy.cluster import connect, load_local_cluster, stop_local_cluster
    from services.ray_deploy.deploy import teardown

    if args.address == "local":
        saved = load_local_cluster()
        if saved is None or not saved.alive():
            print("pdserve ray down: no local cluster is running", file=sys.stderr)
            return 0
    local = connect(args.address, args.namespace)
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


def cmd_ray_status(args: argparse.Namespace) -> int:
    from services.ray_deploy.cluster import connect, load_local_cluster
    from services.ray_deploy.deploy import describe

    if args.address == "local" and (load_local_cluster() is None or not load_local_cluster().alive()):
        print("no local cluster is running", file=sys.stderr)
        return 1
    connect(args.address, args.namespace)
    info = describe(args.name, args.namespace)
    if info is None:
        print(f"no deployment {args.name!r} in namespace {args.namespace!r}", file=sys.stderr)
        return 1
    print(info.describe())
    return 0
