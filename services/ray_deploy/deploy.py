"""Deploy / remove a pdserve deployment on a connected Ray cluster.

Layout of a deployment named NAME in namespace NS (all detached, so it outlives
the command that created it):

* placement group ``NAME-workers``: one bundle per worker, prefill and decode
  interleaved, strategy SPREAD by default (prefill and decode workers land on
  different nodes when the cluster has them);
* actors ``NAME-prefill-<i>`` / ``NAME-decode-<i>`` (``WorkerActor``), one per
  bundle, each ``num_cpus`` / ``num_gpus`` of its bundle;
* actor ``NAME-router`` (``RouterActor``), on the head node by default (where
  clients reach it), serving the unchanged pdserve.v1.Router API on HOST:PORT.

Every actor has ``max_restarts`` (default: unlimited). A restarted worker comes
back on a new port; the router follows it (see ``actors.ActorResolver``) and, while
no worker of a role is healthy, holds requests for up to ``worker_wait_s``.

Workers bound to a loopback address (the default) can only be reached from their
own node, so then every actor is pinned to the head node; give
``worker_host="node-ip"`` to let workers spread over nodes (their gRPC servers
then listen on the node's cluster IP).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.security import CLUSTER_TOKEN_ENV, new_token

HEAD_RESOURCE = "node:__internal_head__"
PIN = 0.001   # a sliver of the head node's marker resource pins an actor/bundle there
KV_TRANSPORTS = ("ray", "grpc")
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


class DeploymentError(RuntimeError):
    pass


@dataclass(slots=True)
class RayDeployment:
    model: str                              # model directory (shared path), or the one to ship (ship_model)
    prefill_workers: int = 1
    decode_workers: int = 1
    name: str = "pdserve"
    namespace: str = "pdserve"
    host: str = "127.0.0.1"                 # router bind address ("node-ip": the head's cluster IP)
    port: int = 50051
    worker_host: str = "127.0.0.1"          # workers' bind address: loopback (single node) or "node-ip"
    kv_transport: str = "ray"               # "ray": object store; "grpc": KVTransfer.PushBlocks
    engine: dict[str, Any] = field(default_factory=dict)   # EngineConfig fields for every worker
    worker_cpus: float = 1.0
    worker_gpus: float | None = None        # None: 1 per worker when the cluster has GPUs, else 0
    router_cpus: float = 1.0
    placement_strategy: str = "SPREAD"
    router_on_head: bool = True
    max_restarts: int = -1                  # -1: restart forever
    ship_model: bool = False                # ship `model` to every node in the runtime env (working_dir)
    worker_wait_s: float = 60.0             # router holds requests this long while no worker of a role is up
    ready_timeout_s: float = 300.0

    def validate(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("need at least one prefill and one decode worker")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}")
        if self.worker_cpus <= 0:
            raise ValueError("worker_cpus must be > 0")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            raise ValueError(f"bad deployment name {self.name!r}")
        if "://" not in self.model and not Path(self.model, "config.json").exists() and self.ship_model:
            raise ValueError(f"--ship-model: {self.model} is not a model directory here")

    @property
    def loopback_workers(self) -> bool:
        from services.ray_deploy.actors import LOOPBACK_HOSTS
        return self.worker_host in LOOPBACK_HOSTS

    def actor_names(self) -> dict[str, list[str]]:
        return {"prefill": [f"{self.name}-prefill-{i}" for i in range(self.prefill_workers)],
                "decode": [f"{self.name}-decode-{i}" for i in range(self.decode_workers)],
                "router": [f"{self.name}-router"]}


@dataclass(slots=True)
class DeploymentInfo:
    name: str
    namespace: str
    router_address: str
    router_node_ip: str
    workers: list[dict[str, Any]]
    placement_group: str
    seconds: float

    def describe(self) -> str:
        lines = [f"pdserve deployment {self.name!r} (namespace {self.namespace!r}): router at {self.router_address} "
                 f"on node {self.router_node_ip}"]
        for w in self.workers:
            lines.append(f"  {w['name']:<24} {w['address']:<22} kv={w['kv_address']}  node={w['node_ip']} pid={w['pid']}")
        return "\n".join(lines)


def _name_pattern(name: str) -> re.Pattern:
    return re.compile(rf"{re.escape(name)}-(router|prefill-\d+|decode-\d+)")


def _pg_name(name: str) -> str:
    return f"{name}-workers"


def _check_namespace(namespace: str) -> None:
    import ray

    current = ray.get_runtime_context().namespace
    if current != namespace:
        raise DeploymentError(f"connect in the deployment's namespace {namespace!r} (connected in {current!r})")


def list_actors(name: str, namespace: str) -> list[str]:
    import ray

    pattern = _name_pattern(name)
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and pattern.fullmatch(a["name"]))


def job_runtime_env(spec: RayDeployment) -> dict[str, Any] | None:
    """The runtime env to connect with: Ray uploads a local working_dir only at the job level
    (ray.init), and the job's actors, detached ones included, inherit it."""
    return {"working_dir": spec.model} if spec.ship_model else None


def _check_shipped(spec: RayDeployment) -> None:
    import ray

    if spec.ship_model and not (ray.get_runtime_context().runtime_env or {}).get("working_dir"):
        raise DeploymentError("ship_model: connect with ray.init(runtime_env=job_runtime_env(spec)) "
                              "(pdserve ray up --ship-model does) so that the model travels as the working_dir")


def _gpus(spec: RayDeployment) -> float:
    import ray

    if spec.worker_gpus is not None:
        return spec.worker_gpus
    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


class _QuietPlacementWarning(logging.Filter):
    """Ray warns that a restartable detached actor in a placement group dies with the group:
    that is what `teardown` wants, and restarts go back into the actor's bundle."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


def deploy(spec: RayDeployment) -> DeploymentInfo:
    """Create the deployment; returns once the router reports SERVING. On failure removes what it made."""
    quiet = _QuietPlacementWarning()
    logging.getLogger("ray.actor").addFilter(quiet)
    try:
        return _deploy(spec)
    finally:
        logging.getLogger("ray.actor").removeFilter(quiet)


def _deploy(spec: RayDeployment) -> DeploymentInfo:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from services.ray_deploy.actors import RouterActor, WorkerActor

    spec.validate()
    _check_namespace(spec.namespace)
    _check_shipped(spec)
    t0 = time.monotonic()
    if list_actors(spec.name, spec.namespace):
        raise DeploymentError(f"deployment {spec.name!r} already exists in namespace {spec.namespace!r}; "
                              "remove it first (pdserve ray down)")
    names = spec.actor_names()
    gpus = _gpus(spec)
    engine = dict(spec.engine)
    engine.setdefault("num_threads", max(1, int(spec.worker_cpus)))
    pin = {HEAD_RESOURCE: PIN} if spec.loopback_workers else {}
    bundle = {"CPU": spec.worker_cpus, **({"GPU": gpus} if gpus else {}), **pin}
    order = []   # interleave prefill and decode over the bundles
    for i in range(max(spec.prefill_workers, spec.decode_workers)):
        order += [(role, names[role][i]) for role in ("prefill", "decode") if i < len(names[role])]
    base = {"namespace": spec.namespace, "kv_transport": spec.kv_transport, "host": spec.worker_host,
            "model": spec.model, "ship_model": spec.ship_model, "engine": engine}
    # The internal plane's secret reaches the actors through their environment, never their arguments.
    secret_env = {"env_vars": {CLUSTER_TOKEN_ENV: os.environ.get(CLUSTER_TOKEN_ENV) or new_token()}}
    if pin:
        _check_head_fits(spec, bundle, len(order))
    try:
        pg = ray.util.placement_group([dict(bundle) for _ in order], strategy=spec.placement_strategy,
                                      name=_pg_name(spec.name), lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=spec.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DeploymentError(
                f"the cluster cannot place {len(order)} workers of {bundle} ({spec.placement_strategy}) within "
                f"{spec.ready_timeout_s}s; available: {ray.available_resources()}") from None
        workers = []
        for index, (role, actor_name) in enumerate(order):
            workers.append(WorkerActor.options(
                name=actor_name, namespace=spec.namespace, lifetime="detached", max_restarts=spec.max_restarts,
                num_cpus=spec.worker_cpus, num_gpus=gpus, runtime_env=secret_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index),
            ).remote(json.dumps({**base, "name": actor_name, "role": role})))
        router_spec = {**base, "name": names["router"][0], "host": spec.host, "port": spec.port,
                       "prefill": names["prefill"], "decode": names["decode"],
                       "worker_wait_s": spec.worker_wait_s, "ready_timeout_s": spec.ready_timeout_s}
        router = RouterActor.options(
            name=names["router"][0], namespace=spec.namespace, lifetime="detached", max_restarts=spec.max_restarts,
            num_cpus=spec.router_cpus, runtime_env=secret_env,
            resources={HEAD_RESOURCE: PIN} if spec.router_on_head or spec.loopback_workers else None,
        ).remote(json.dumps(router_spec))
        # Workers first: a worker that cannot start fails here with its own error.
        deadline = time.monotonic() + spec.ready_timeout_s
        infos = _get([w.info.remote() for w in workers], deadline, "workers")
        _get(router.address.remote(), deadline, "router")
        status = _get(router.health.remote(), deadline, "router health")
        if status != "SERVING":
            raise DeploymentError(f"router health is {status}")
        rinfo = _get(router.info.remote(), deadline, "router")
    except BaseException:
        teardown(spec.name, spec.namespace)
        raise
    return DeploymentInfo(name=spec.name, namespace=spec.namespace, router_address=rinfo["address"],
                          router_node_ip=rinfo["node_ip"], workers=infos, placement_group=_pg_name(spec.name),
                          seconds=time.monotonic() - t0)


def _check_head_fits(spec: RayDeployment, bundle: dict[str, float], n: int) -> None:
    """Loopback workers all go to the head node: fail fast when it cannot hold them."""
    import ray

    head = next((node["Resources"] for node in ray.nodes()
                 if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {})), None)
    if head is None:
        return
    need = {k: v * n for k, v in bundle.items() if k != HEAD_RESOURCE}
    need["CPU"] = need.get("CPU", 0) + spec.router_cpus
    short = {k: (v, head.get(k, 0)) for k, v in need.items() if head.get(k, 0) + 1e-9 < v}
    if short:
        detail = ", ".join(f"{k}: need {v:g}, head has {have:g}" for k, (v, have) in short.items())
        raise DeploymentError(f"with --worker-host {spec.worker_host} every worker runs on the head node, which "
                              f"is too small ({detail}); use --worker-host node-ip to spread workers over nodes")


def _get(refs, deadline: float, what: str):
    import ray

    try:
        return ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise DeploymentError(f"{what} not ready in time") from None
    except ray.exceptions.RayError as exc:
        raise DeploymentError(f"{what} failed to start: {exc}") from exc


def describe(name: str, namespace: str, timeout_s: float = 30.0) -> DeploymentInfo | None:
    import ray

    _check_namespace(namespace)
    present = list_actors(name, namespace)
    if not present:
        return None
    t0 = time.monotonic()
    router = ray.get_actor(f"{name}-router", namespace=namespace)
    workers = [ray.get_actor(n, namespace=namespace) for n in present if not n.endswith("-router")]
    deadline = time.monotonic() + timeout_s
    rinfo = _get(router.info.remote(), deadline, "router")
    infos = _get([w.info.remote() for w in workers], deadline, "workers")
    return DeploymentInfo(name=name, namespace=namespace, router_address=rinfo["address"],
                          router_node_ip=rinfo["node_ip"], workers=infos, placement_group=_pg_name(name),
                          seconds=time.monotonic() - t0)


def teardown(name: str, namespace: str, timeout_s: float = 30.0) -> list[str]:
    """Kill the deployment's actors (no restart) and remove its placement group."""
    import ray

    removed = []
    for actor_name in list_actors(name, namespace):
        try:
            ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=True)
            removed.append(actor_name)
        except ValueError:
            pass
    try:
        pg = ray.util.get_placement_group(_pg_name(name))
        if ray.util.placement_group_table(pg).get("state") != "REMOVED":
            ray.util.remove_placement_group(pg)
            removed.append(f"placement group {_pg_name(name)}")
    except ValueError:
        pass
    deadline = time.monotonic() + timeout_s   # names are released once the GCS has seen the deaths
    while list_actors(name, namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    return removed


def spec_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(RayDeployment)]
