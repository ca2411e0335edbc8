"""Deploy / remove a pdserve deployment on a connected Ray cluster.

Layout of a deployment named NAME in namespace NS (all detached, so it outlives
the command that created it):

* placement group ``NAME-workers``: one bundle per worker, prefill and decode
  interleaved, strategy SPREAD by default (prefill and decode workers land on
  different nodes when the cluster has them). A worker with tensor parallelism N
  (``prefill_tp`` / ``decode_tp``, else the engine's ``tensor_parallel_size``) is one
  actor that starts its N-1 rank processes itself, so its bundle holds the CPUs and
  GPUs of all N ranks (N x ``worker_cpus``, N x ``worker_gpus``): they are placed
  together, on one node, or not at all;
* actors ``NAME-prefill-<i>`` / ``NAME-decode-<i>`` (``WorkerActor``), one per
  bundle, each ``num_cpus`` / ``num_gpus`` of its bundle;
* actor ``NAME-router`` (``RouterActor``), on the head node by default (where
  clients reach it), serving the unchanged pdserve.v1.Router API on HOST:PORT.

Every actor has ``max_restarts`` (default: unlimited). A restarted worker comes
back on a new port; the router follows it (see ``actors.ActorResolver``) and, while
no worker of a role is healthy, holds requests for up to ``worker_wait_s``.

Secrets stay out of the actors' specs and runtime envs (Ray's state API and dashboard show
both): the cluster token (``--cluster-token-file``, else $PDSERVE_CLUSTER_TOKEN or a fresh one)
and the router's API key (``--api-key-file``, else $PDSERVE_API_KEY) reach the actors as files
of mode 0600 that they read on their node; without a file given, this machine writes one under
``$PDSERVE_HOME/ray/secrets`` (right for a single-node cluster; on several nodes give a path
every node has) and ``teardown`` removes it.

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

from pdserve.engine.config import EngineConfig
from pdserve.engine.settings import ENV, setting
from pdserve.services.common.config_flags import config_to_argv, configs_from_argv
from pdserve.services.common.security import new_token
from pdserve.services.common.topology import DEFAULT_HOST, ROUTER_PORT, Topology
from pdserve.services.ray_deploy.cluster import state_dir

HEAD_RESOURCE = "node:__internal_head__"
DEFAULT_PLACEMENT_WAIT_S = 20.0   # placing a deployment that fits the cluster's nodes
PIN = 0.001   # a sliver of the head node's marker resource pins an actor/bundle there
KV_TRANSPORTS = ("ray", "grpc")
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


class DeploymentError(RuntimeError):
    pass




@dataclass(slots=True)
class RayDeployment:
    """One deployment on a Ray cluster. The `pdserve ray up` flags are generated from these fields;
    the roles' own settings travel to the actors as argv (``engine_args``, ``worker_args``,
    ``router_args``: made by ``config_to_argv``, parsed by the same generated flags)."""

    model: str = field(metadata={"help": "model directory: a path every node has, or the one to ship"})
    prefill_workers: int = setting(1, "prefill worker actors")
    decode_workers: int = setting(1, "decode worker actors")
    prefill_tp: int | None = setting(None, "tensor_parallel_size of the prefill workers (each reserves the CPUs/GPUs "
                                      "of all its ranks in one bundle); none: --tensor-parallel-size")
    decode_tp: int | None = setting(None, "tensor_parallel_size of the decode workers; none: --tensor-parallel-size "
                                     "(any pair of layouts hands KV over)")
    name: str = setting("pdserve", "deployment name (actor name prefix)", cli=False)
    namespace: str = setting("pdserve", "Ray namespace of the actors", cli=False)
    host: str = setting(DEFAULT_HOST, "router bind address (node-ip: the head node's cluster IP)")
    port: int = setting(ROUTER_PORT, "router port")
    worker_host: str = setting(DEFAULT_HOST, "workers' gRPC bind address; loopback pins every actor to the head node, "
                                       "node-ip lets workers spread over nodes")
    cluster_token_file: str | None = setting(None, "file (mode 0600) holding the internal-plane token, at this path on "
                                              "every node the actors run on; none: $PDSERVE_CLUSTER_TOKEN or a "
                                              "fresh token, written for the actors under $PDSERVE_HOME/ray/secrets "
                                              "(a single-node cluster)")
    api_key_file: str | None = setting(None, "file (mode 0600) holding the router's API key, on the router's node; none: "
                                        "$PDSERVE_API_KEY, written for the router as the token is, else no key")
    tls_cert: str | None = setting(None, "mutual TLS on every channel, the router's public port too: this "
                                    "process's certificate (PEM), a path on every node")
    tls_key: str | None = setting(None, "its private key (PEM), a path on every node")
    tls_ca: str | None = setting(None, "the deployment CA (PEM), a path on every node")
    kv_transport: str = setting("ray", "KV blocks through Ray's object store (ray) or over gRPC KVTransfer (grpc)",
                           choices=KV_TRANSPORTS)
    engine: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})  # EngineConfig fields (Python API)
    engine_args: list[str] = field(default_factory=list, metadata={"cli": False})  # EngineConfig flags, every worker
    worker_args: list[str] = field(default_factory=list, metadata={"cli": False})  # WorkerConfig flags
    router_args: list[str] = field(default_factory=list, metadata={"cli": False})  # router's config flags
    worker_cpus: float | None = setting(None, "CPUs per worker rank (a worker with tensor parallelism N reserves N "
                                         "times this); none: 1, or an equal share that fits the head node when "
                                         "every actor runs there (e.g. 0.66 on a 2-CPU head)")
    worker_gpus: float | None = setting(None, "GPUs per worker rank (tensor parallelism needs a whole GPU per rank); "
                                         "none: 1 if the cluster has GPUs, else 0")
    router_cpus: float | None = setting(None, "CPUs of the router actor; none: 1, or the share of the head node "
                                         "that fits (as --worker-cpus)")
    placement_strategy: str = setting("SPREAD", "strategy of the deployment's placement group", choices=STRATEGIES)
    router_on_head: bool = setting(True, "run the router on the head node (where clients find it)")
    max_restarts: int = setting(-1, "restarts per actor; -1: unlimited")
    ship_model: bool = setting(False, "upload --model through the runtime env (working_dir) instead of reading a "
                                 "shared path (small models: Ray's limit is 512 MiB zipped)")
    placement_timeout_s: float | None = setting(None, "seconds to wait for the cluster to place the deployment (an "
                                                 "autoscaling cluster adding nodes); none: fail at once when the "
                                                 "cluster as it is can never hold it, else wait 20 s")
    ready_timeout_s: float = setting(300.0, "seconds to wait for the deployment to serve; on failure it is removed",
                                aliases=("--timeout",))

    def validate(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("need at least one prefill and one decode worker")
        for what in ("prefill_tp", "decode_tp"):
            value = getattr(self, what)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}")
        for what in ("worker_cpus", "router_cpus"):
            value = getattr(self, what)
            if value is not None and value <= 0:
                raise ValueError(f"{what} must be > 0")
        gpus, tp = self.worker_gpus, max(self.tp("prefill"), self.tp("decode"))
        if gpus and tp > 1 and (gpus < 1 or gpus != int(gpus)):
            raise ValueError(f"worker_gpus must be a whole number of GPUs per rank with tensor parallelism "
                             f"(NCCL: one GPU per rank), got {gpus:g} with --prefill-tp {self.tp('prefill')} "
                             f"--decode-tp {self.tp('decode')}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            raise ValueError(f"bad deployment name {self.name!r}")
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("tls_cert, tls_key and tls_ca go together")
        if "://" not in self.model and not Path(self.model, "config.json").exists() and self.ship_model:
            raise ValueError(f"--ship-model: {self.model} is not a model directory here")

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers

    @property
    def topology(self) -> Topology:
        """The deployment's shape (services/common/topology.py): the same one `pdserve up` reads."""
        return Topology(self.prefill_workers, self.decode_workers, 0, self.prefill_tp, self.decode_tp,
                        self.engine_config().tensor_parallel_size, self.host, self.port)

    def tp(self, role: str) -> int:
        """The tensor_parallel_size of a role's workers."""
        if role not in ("prefill", "decode"):
            raise KeyError(role)
        return self.topology.tp(role)

    @property
    def num_ranks(self) -> int:
        """Engine processes of all workers together (what worker_cpus / worker_gpus are per)."""
        return self.prefill_workers * self.tp("prefill") + self.decode_workers * self.tp("decode")

    @property
    def loopback_workers(self) -> bool:
        from pdserve.services.ray_deploy.actors import LOOPBACK_HOSTS   # lazy: ray only when this runs
        return self.worker_host in LOOPBACK_HOSTS

    def actor_names(self) -> dict[str, list[str]]:
        return {"prefill": [f"{self.name}-prefill-{i}" for i in range(self.prefill_workers)],
                "decode": [f"{self.name}-decode-{i}" for i in range(self.decode_workers)],
                "router": [f"{self.name}-router"]}

    def _engine_argv(self) -> list[str]:
        engine = list(self.engine_args)
        if self.engine:
            engine = config_to_argv(EngineConfig(model="-", **self.engine), exclude=("model", "role")) + engine
        return engine

    def engine_config(self):
        """The workers' EngineConfig (model "-", role both) as the actors parse it; a bad setting raises."""

        return configs_from_argv(self._engine_argv(), (EngineConfig, ("model", "role")), model="-")[0]

    def role_argv(self, worker_cpus: float) -> tuple[list[str], list[str], list[str]]:
        """(engine, worker, router) argv for the actors: the one serialised form of their settings.
        worker_cpus: per rank (each rank runs that many torch threads)."""
        engine = self._engine_argv()
        self.engine_config()   # a bad setting fails here
        if "--num-threads" not in engine and "--threads" not in engine:
            engine += ["--num-threads", str(max(1, int(worker_cpus)))]
        router = list(self.router_args)
        if "--ready-timeout-s" not in router:
            router = ["--ready-timeout-s", f"{self.ready_timeout_s:g}", *router]
        return engine, list(self.worker_args), router

    def worker_bundle(self, role: str, worker_cpus: float, worker_gpus: float) -> dict[str, float]:
        """The placement-group bundle of one worker of role: the resources of all its ranks."""
        tp = self.tp(role)
        pin = {HEAD_RESOURCE: PIN} if self.loopback_workers else {}
        gpus = {"GPU": round(worker_gpus * tp, 4)} if worker_gpus else {}
        return {"CPU": round(worker_cpus * tp, 4), **gpus, **pin}


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


def secret_path(name: str, namespace: str, kind: str) -> Path:
    """Where this machine writes a deployment's secret of kind for its actors."""
    return state_dir() / "secrets" / f"{namespace}.{name}.{kind}"


def _write_secret(path: Path, value: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(value)
    return str(path)


def admin_token_file(name: str, namespace: str) -> str | None:
    """The deployment's admin token file written here at `ray up` (None: not on this machine; then
    $PDSERVE_ADMIN_TOKEN), for `ray scale`'s membership changes."""
    path = secret_path(name, namespace, "admin-token")
    return str(path) if path.is_file() else None


def secret_files(spec: RayDeployment) -> dict[str, Any]:
    """The actors' spec entries naming their secrets' files (and the TLS files): given ones as
    they are, else files written here from the environment (a fresh token if none is set)."""
    given = lambda path: os.path.abspath(path) if path else None  # noqa: E731 - the actors' cwd is not ours
    token_file = given(spec.cluster_token_file) or _write_secret(
        secret_path(spec.name, spec.namespace, "cluster-token"), ENV.CLUSTER_TOKEN.raw() or new_token())
    key_file = given(spec.api_key_file)
    if key_file is None and ENV.API_KEY.is_set():
        key_file = _write_secret(secret_path(spec.name, spec.namespace, "api-key"), ENV.API_KEY.get())
    tls = [given(spec.tls_cert), given(spec.tls_key), given(spec.tls_ca)] if spec.tls_cert else None
    admin_file = _write_secret(secret_path(spec.name, spec.namespace, "admin-token"),   # the router's only
                               ENV.ADMIN_TOKEN.raw() or new_token())
    return {"cluster_token_file": token_file, "api_key_file": key_file, "tls": tls, "admin_token_file": admin_file}


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


def _head_resources() -> dict[str, float]:
    import ray

    return next((node["Resources"] for node in ray.nodes()
                 if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {})), {})


def resolve_cpus(spec: RayDeployment, head_cpus: float | None) -> tuple[float, float]:
    """(worker_cpus per rank, router_cpus): as given; an unset one is 1 CPU, or, when every actor runs
    on the head node (loopback workers) and 1 each would not fit, an equal share (per rank of every
    worker, and the router) of what the given ones leave."""
    worker, router = spec.worker_cpus, spec.router_cpus
    if worker is not None and router is not None:
        return worker, router
    if not spec.loopback_workers or head_cpus is None:
        return worker or 1.0, router or min(1.0, worker or 1.0)
    ranks = spec.num_ranks
    fixed = (ranks * worker if worker is not None else 0.0) + (router or 0.0)
    shares = (ranks if worker is None else 0) + (1 if router is None else 0)
    share = min(1.0, max(0.01, (head_cpus - fixed) / shares))
    share = int(share * 100) / 100   # down to a hundredth, so that the shares fit
    return (worker if worker is not None else share), (router if router is not None else share)


def _deploy(spec: RayDeployment) -> DeploymentInfo:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pdserve.services.ray_deploy.actors import RouterActor, WorkerActor   # lazy: ray only when this runs

    spec.validate()
    _check_namespace(spec.namespace)
    _check_shipped(spec)
    t0 = time.monotonic()
    if list_actors(spec.name, spec.namespace):
        raise DeploymentError(f"deployment {spec.name!r} already exists in namespace {spec.namespace!r}; "
                              "remove it first (pdserve ray down), or pass --if-exists keep|replace")
    names = spec.actor_names()
    gpus = _gpus(spec)
    tps = {role: spec.tp(role) for role in ("prefill", "decode")}
    head = _head_resources()
    worker_cpus, router_cpus = resolve_cpus(spec, head.get("CPU"))
    engine_args, worker_args, router_args = spec.role_argv(worker_cpus)
    router_pin = spec.router_on_head or spec.loopback_workers
    router_bundle = {"CPU": router_cpus, **({HEAD_RESOURCE: PIN} if router_pin else {})}
    # The router takes bundle 0 of the group, so the whole deployment is placed at once or not at
    # all (STRICT_SPREAD would then also want a node of its own for the router: not there).
    router_in_group = spec.placement_strategy != "STRICT_SPREAD"
    order = []   # interleave prefill and decode over the bundles
    for i in range(max(spec.prefill_workers, spec.decode_workers)):
        order += [(role, names[role][i]) for role in ("prefill", "decode") if i < len(names[role])]
    worker_bundles = [spec.worker_bundle(role, worker_cpus, gpus) for role, _ in order]
    files = secret_files(spec)   # secrets as files the actors read, never in their spec or runtime env
    base = {"namespace": spec.namespace, "kv_transport": spec.kv_transport, "host": spec.worker_host,
            "model": spec.model, "ship_model": spec.ship_model, "engine_args": engine_args,
            "worker_args": worker_args, "cluster_token_file": files["cluster_token_file"], "tls": files["tls"]}
    # The log level reaches the actors through their environment (nothing secret goes there).
    env = ENV.LOG_LEVEL.env(ENV.LOG_LEVEL.get()) if ENV.LOG_LEVEL.is_set() else {}
    runtime_env = {"env_vars": env} if env else None
    if spec.loopback_workers:
        _check_head_fits(spec, head, worker_bundles, router_cpus)
    bundles = ([dict(router_bundle)] if router_in_group else []) + [dict(b) for b in worker_bundles]
    first_worker = 1 if router_in_group else 0
    try:
        if spec.placement_timeout_s is None:
            _check_cluster_fits(spec, bundles, worker_bundles, router_bundle)
        pg = ray.util.placement_group(bundles, strategy=spec.placement_strategy, name=_pg_name(spec.name),
                                      lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=spec.placement_timeout_s or DEFAULT_PLACEMENT_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            raise DeploymentError(_unplaceable(spec, worker_bundles, router_bundle)) from None
        workers = []
        for index, (role, actor_name) in enumerate(order):
            # The actor takes its whole bundle: its own rank's share and its rank processes'.
            bundle = worker_bundles[index]
            workers.append(WorkerActor.options(
                name=actor_name, namespace=spec.namespace, lifetime="detached", max_restarts=spec.max_restarts,
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=first_worker + index),
            ).remote(json.dumps({**base, "engine_args": [*engine_args, "--tensor-parallel-size", str(tps[role])],
                                 "name": actor_name, "role": role,
                                 # what `pdserve ray scale` starts one more of this role with
                                 "placement": {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                                               "on_head": spec.loopback_workers, "max_restarts": spec.max_restarts,
                                               "log_level_env": env}})))
        router_spec = {**base, "name": names["router"][0], "host": spec.host, "port": spec.port,
                       "prefill": names["prefill"], "decode": names["decode"], "router_args": router_args,
                       "api_key_file": files["api_key_file"], "remote_workers": not spec.loopback_workers,
                       "admin_token_file": files["admin_token_file"]}
        placement = ({"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)} if router_in_group
            else {"resources": {HEAD_RESOURCE: PIN} if router_pin else None})
        router = RouterActor.options(
            name=names["router"][0], namespace=spec.namespace, lifetime="detached", max_restarts=spec.max_restarts,
            num_cpus=router_cpus, runtime_env=runtime_env, **placement,
        ).remote(json.dumps(router_spec))
        # Workers first: a worker that cannot start fails here with its own error.
        deadline = time.monotonic() + spec.ready_timeout_s
        infos = _get([w.info.remote() for w in workers], deadline, "workers", names=[n for _, n in order])
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


FIXES = ("lower --worker-cpus / --router-cpus (fractions are fine, e.g. 0.5), deploy fewer "
         "--prefill-workers / --decode-workers, or give the cluster more CPUs (--address local: --local-num-cpus)")
TP_NOTE = " (a worker of tensor parallelism N reserves N x --worker-cpus / --worker-gpus, on one node)"


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:")
                           and k not in ("memory", "object_store_memory")) + "}"


def _workers_text(worker_bundles: list[dict]) -> str:
    """'2 worker(s) of {CPU: 1}', or per kind of bundle: '1 worker(s) of {CPU: 2} + 1 worker(s) of {CPU: 1}'."""
    counts: dict[str, int] = {}
    for b in worker_bundles:
        counts[_fmt(b)] = counts.get(_fmt(b), 0) + 1
    return " + ".join(f"{n} worker(s) of {text}" for text, n in counts.items())


def _fixes(spec: RayDeployment) -> str:
    return FIXES + (TP_NOTE if spec.tp("prefill") > 1 or spec.tp("decode") > 1 else "")


def _check_cluster_fits(spec: RayDeployment, bundles: list[dict], worker_bundles: list[dict],
                        router_bundle: dict) -> None:
    """Fail at once when the alive nodes, empty, could not hold every bundle (first fit, largest
    first; STRICT_SPREAD: each on its own node): waiting would not help a cluster that does not grow."""
    import ray

    nodes = [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    spread = spec.placement_strategy == "STRICT_SPREAD"
    used: set[int] = set()
    for b in sorted(bundles, key=lambda b: -b.get("CPU", 0)):
        for i, free in enumerate(nodes):
            if (spread and i in used) or any(free.get(k, 0) + 1e-9 < v for k, v in b.items()):
                continue
            for k, v in b.items():
                if not k.startswith("node:"):
                    free[k] -= v
            used.add(i)
            break
        else:
            raise DeploymentError(
                f"the cluster can never place the deployment: it needs {_workers_text(worker_bundles)} and a "
                f"router of {_fmt(router_bundle)}, but its nodes have {', '.join(_fmt(nd['Resources']) for nd in ray.nodes() if nd.get('Alive'))}; "
                f"{_fixes(spec)} (an autoscaling cluster: give --placement-timeout-s to wait for new nodes)")


def _unplaceable(spec: RayDeployment, worker_bundles: list[dict], router_bundle: dict) -> str:
    import ray

    return (f"the cluster could not place the deployment within {spec.placement_timeout_s or DEFAULT_PLACEMENT_WAIT_S:g}s "
            f"(--placement-timeout-s): it needs {_workers_text(worker_bundles)} and a router of "
            f"{_fmt(router_bundle)}; the cluster has {_fmt(ray.cluster_resources())}, free "
            f"{_fmt(ray.available_resources())}; {_fixes(spec)}")


def _check_head_fits(spec: RayDeployment, head: dict[str, float], worker_bundles: list[dict[str, float]],
                     router_cpus: float) -> None:
    """Loopback workers all go to the head node: fail at once when it can never hold them."""
    if not head:
        return
    need: dict[str, float] = {}
    for bundle in worker_bundles:
        for k, v in bundle.items():
            if k != HEAD_RESOURCE:
                need[k] = need.get(k, 0) + v
    need["CPU"] = need.get("CPU", 0) + router_cpus
    short = {k: (v, head.get(k, 0)) for k, v in need.items() if head.get(k, 0) + 1e-9 < v}
    if short:
        detail = ", ".join(f"{k}: need {v:g}, head has {have:g}" for k, (v, have) in short.items())
        raise DeploymentError(f"with --worker-host {spec.worker_host} every actor runs on the head node, which "
                              f"is too small ({detail}); {_fixes(spec)}, or --worker-host node-ip to spread workers "
                              f"over nodes")


UNAVAILABLE_RETRY_S = 0.5   # an actor being restarted (its node lost) is asked again this often


def _get(refs, deadline: float, what: str, call=None, names: list[str] | None = None):
    """ray.get(refs) by deadline. With call (which makes refs again), an actor that is only
    temporarily unavailable (restarting after its node was lost) is asked again until then.
    names (one per ref) say which actors a timeout left not ready."""
    import ray

    while True:
        try:
            return ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            late = ""
            if names and isinstance(refs, list):
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                late = ": " + ", ".join(n for n, r in zip(names, refs) if r not in ready) + " still starting"
            raise DeploymentError(f"{what} not ready in time (--timeout){late}") from None
        except ray.exceptions.ActorUnavailableError as exc:
            if call is None or time.monotonic() + UNAVAILABLE_RETRY_S >= deadline:
                raise DeploymentError(f"{what} unavailable: {exc}") from exc
            time.sleep(UNAVAILABLE_RETRY_S)
            refs = call()
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
    def ask_router():
        return router.info.remote()

    def ask_workers():
        return [w.info.remote() for w in workers]
    rinfo = _get(ask_router(), deadline, "router", ask_router)
    infos = _get(ask_workers(), deadline, "workers", ask_workers)
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
    for kind in ("cluster-token", "api-key"):   # the secrets this machine wrote for the actors
        secret_path(name, namespace, kind).unlink(missing_ok=True)
    return removed


def spec_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(RayDeployment)]
