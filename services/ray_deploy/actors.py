"""The pdserve roles as Ray actors.

Each actor runs the existing grpc.aio server (``serve_worker`` / ``serve_router``)
as a task on the actor's own asyncio event loop, started from ``async __init__`` so
that a restart by Ray (``max_restarts``) brings the server back by itself, on a new
port. The actors take one argument, a JSON spec (plain data, nothing pickled of
ours) whose settings are argv lists (``engine_args``, ``worker_args``, ``router_args``)
parsed by the CLI's generated flags: the same serialised form `pdserve up` hands its
child processes. They expose:

* ``address()``: the gRPC address the server listens on;
* ``info()``: a JSON-able dict (role, address, KV address, model path, pid, node,
  tensor-parallel size and rank pids, transport counters);
* decode workers: ``push_blocks(headers, refs)``, the receiving end of the
  object-store KV transport (``services.kv_transfer.ray_transport``);
* ``stop(proof)``: drain, then exit the actor for good. Any job of the Ray cluster can call an
  actor's methods, so this one answers only a caller proving the deployment's cluster token
  (``control_proof``); anyone else gets PermissionError and the actor keeps serving.

Secrets never travel in the actors' spec or runtime env (both readable through Ray's state
API and dashboard): the spec names files on the actor's node (``cluster_token_file``, the
router's ``api_key_file``, mode 0600) and the actors read them themselves; TLS files are
paths too.

The router actor resolves its workers' addresses through their actor names, and
hands ``WorkerPool`` a resolver that asks an unreachable worker's actor for its
current address, so a restarted worker is followed to its new port.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Awaitable, Callable

import ray

from pdserve.engine import EngineConfig
from pdserve.engine.checkpoints.resolve import resolve_model
from pdserve.engine.settings import ENV
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.common.config_flags import configs_from_argv
from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.common.proofs import ProofCheck
from pdserve.services.common.security import API_KEY_ENV, Credentials, read_secret
from pdserve.services.router.config import GenerationOptions, RouterConfig
from pdserve.services.workers.config import WorkerConfig
from pdserve.services.workers.options import WorkerOptions

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def bind_host(host: str) -> str:
    """'node-ip' -> this node's Ray IP; anything else as given."""
    return ray.util.get_node_ip_address() if host == "node-ip" else host


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def model_dir(spec: dict[str, Any]) -> str:
    """The model on this node: shipped in the runtime env's working_dir (the actor's cwd), else
    --model resolved here (a shared path, or a Hub id / GGUF file / preset made on this node)."""
    return os.getcwd() if spec.get("ship_model") else resolve_model(spec["model"])


async def _await(ref: Any) -> Any:
    return await ref


async def _until_started(started: asyncio.Future, task: asyncio.Task) -> Any:
    """Wait for the server's on_start, or raise what ended its task first."""
    await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
    if started.done():
        return started.result()
    task.result()   # raises the startup error
    raise RuntimeError("server exited during startup")


def _crash_if_unexpected(stop: asyncio.Event, name: str):
    """Exit the actor's process (Ray restarts it) when its server ends unasked, or with an error
    (a worker whose tensor-parallel rank died drains, then raises)."""
    def on_done(task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        if stop.is_set() and exc is None:
            return
        log.error("pdserve server of %s ended unexpectedly (%r); exiting so that Ray restarts the actor", name, exc)
        os._exit(1)
    return on_done


def _setup_logging() -> None:
    """The deployment's log level (PDSERVE_LOG_LEVEL, from the runtime env) for pdserve's loggers."""
    level = ENV.LOG_LEVEL.raw()
    if level:
        logging.getLogger("services").setLevel(level)
        logging.getLogger("engine").setLevel(level)


def worker_configs(spec: dict[str, Any], model: str):
    """(EngineConfig, WorkerConfig) from the spec's argv, parsed by the CLI's generated flags."""

    engine, = configs_from_argv(spec.get("engine_args", []), (EngineConfig, ()), model=model, role=spec["role"])
    worker, = configs_from_argv(spec.get("worker_args", []), (WorkerConfig, ()))
    return engine, worker


def router_configs(spec: dict[str, Any]):
    """(GenerationOptions, RequestLimits, RouterConfig) from the spec's router argv."""

    return configs_from_argv(spec.get("router_args", []), (GenerationOptions, ()), (RequestLimits, ()),
                             (RouterConfig, ()))


def load_credentials(spec: dict[str, Any]):
    """The deployment's Credentials from the files the spec names (read on this node)."""

    path = spec.get("cluster_token_file")
    if not path:
        raise ValueError("the actor spec names no cluster_token_file")
    try:
        return Credentials.load(path, *spec.get("tls") or (None, None, None), admin="admin_token_file" in spec,
                                admin_token_file=spec.get("admin_token_file"))   # the router's spec, `ray scale`
    except ValueError as exc:
        raise ValueError(f"{exc} on node {ray.util.get_node_ip_address()}: give --cluster-token-file a path that "
                         f"every node has (mode 0600)") from None


def control_proof(credentials, actor_name: str, method: str) -> str:
    """The proof a control method of actor_name wants: a fresh HMAC of the cluster token."""
    return credentials.call_proof(f"ray:{actor_name}.{method}").metadata[0][1]


class ControlGate:
    """Control methods answer only a caller proving the cluster token, each proof once."""

    def __init__(self, credentials, actor_name: str) -> None:
        self.actor_name = actor_name
        self.check = ProofCheck(credentials.key) if credentials.key is not None else None

    def require(self, method: str, proof: object) -> None:
        if self.check is None or not self.check.verify(f"ray:{self.actor_name}.{method}", proof):
            raise PermissionError(f"{self.actor_name}.{method}() needs a fresh proof of the deployment's cluster "
                                  f"token (services.ray_deploy.actors.control_proof); refused, still serving")


async def _stop_for_good(stop: asyncio.Event, task: asyncio.Task) -> None:
    """Drain, then end the actor's process without a restart: never alive serving nothing."""
    stop.set()
    await task
    ray.actor.exit_actor()


def _node_info() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id()}


class _ServerActor:
    """What both actors do: read their spec, run their server as a task (the actor exits when it
    ends unasked), answer its address, and stop for good when asked with proof."""

    def _load(self, spec_json: str) -> dict[str, Any]:
        _setup_logging()
        spec = json.loads(spec_json)
        self.spec, self.name, self.model = spec, spec["name"], model_dir(spec)
        return spec

    async def _start(self, serve: Callable[[asyncio.Event, Callable[[Any], None]], Awaitable[Any]]) -> Any:
        """Run serve(stop, on_start) as the server task; what it gave on_start, once started."""
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(serve(self._stop, started.set_result))
        running = await _until_started(started, self._task)
        self._task.add_done_callback(_crash_if_unexpected(self._stop, self.name))
        return running

    async def address(self) -> str:
        return self._address

    async def stop(self, proof: str = "") -> None:
        """Drain and exit (no restart); needs ``control_proof(credentials, name, "stop")``."""
        self._control.require("stop", proof)
        await _stop_for_good(self._stop, self._task)


@ray.remote
class WorkerActor(_ServerActor):
    """A prefill or decode worker (grpc Worker service + KVTransfer, and push_blocks for Ray KV)."""

    async def __init__(self, spec_json: str) -> None:
        # lazy: the worker's engine (torch) loads in the actor's process, not in the driver's
        from pdserve.services.kv_transfer import GrpcKVSender
        # lazy: torch only when this runs
        from pdserve.services.kv_transfer.ray_transport import RayKVReceiver, RayKVSender, ray_kv_address
        from pdserve.services.workers.worker_process import serve_worker   # lazy: torch only when this runs

        spec = self._load(spec_json)
        self.role, namespace = spec["role"], spec["namespace"]
        config, worker_config = worker_configs(spec, self.model)
        credentials = load_credentials(spec)   # the cluster token from its file on this node
        self._control = ControlGate(credentials, self.name)
        ray_kv = spec["kv_transport"] == "ray"
        sender = None
        if self.role == "prefill" and ray_kv:
            token = credentials.cluster_token
            sender = RayKVSender(default_namespace=namespace, cluster_token=token,
                                 kv_compression=worker_config.kv_compression,
                                 # its own proof per stream, bound to the stream's first frame (a
                                 # channel's proof cannot see a stream written frame by frame)
                                 fallback=GrpcKVSender(lambda a: credentials.channel(a, channel_options(),
                                                                                     attach_token=False),
                                                       proof=credentials.call_proof if token else None,
                                                       cluster_token=token,
                                                       kv_compression=worker_config.kv_compression))
        kv_address = ray_kv_address(self.name, namespace) if self.role == "decode" and ray_kv else ""
        host = bind_host(spec["host"])
        options = WorkerOptions(host=host, port=0, worker_id=self.name, kv_address=kv_address, kv_sender=sender,
                                credentials=credentials, config=worker_config)
        self.running = await self._start(lambda stop, on_start: serve_worker(config, options, stop=stop,
                                                                            on_start=on_start))
        self._address = join_host_port(host, self.running.server.port)
        self.kv_address = kv_address or self._address
        self.receiver = (RayKVReceiver(self.running.aengine.connector, cluster_token=credentials.cluster_token)
                         if self.role == "decode" else None)

    async def launch_spec(self) -> str:
        """The JSON spec this actor was started with (file paths, no secret): `pdserve ray scale`
        starts another worker of its role from it."""
        return json.dumps(self.spec)

    async def info(self) -> dict[str, Any]:
        receiver = self.receiver
        runner = self.running.aengine.engine.runner
        return {"name": self.name, "role": self.role, "address": self._address, "kv_address": self.kv_address,
                "kv_transport": self.spec["kv_transport"], "model": self.model, **_node_info(),
                "tensor_parallel_size": runner.layout.size, "rank_pids": runner.ranks.pids if runner.ranks else [],
                "ray_receiver": ({"blocks_received": receiver.blocks_received, "bytes_received": receiver.bytes_received}
                                 if receiver is not None else None),
                "metrics": self._metrics()}

    def _metrics(self) -> dict[str, float]:
        metrics = self.running.metrics
        return {name: metrics.registry.get_sample_value(f"pdserve:{name}_total", metrics.labels) or 0.0
                for name in ("generation_tokens", "prompt_tokens", "kv_transfer_bytes")}

    def _receiver(self):
        if self.receiver is None:
            raise RuntimeError(f"{self.name} is a {self.role} worker: it receives no KV blocks")
        return self.receiver

    async def push_blocks(self, open_bytes: bytes, headers: list[bytes], refs: list[Any]) -> bytes:
        return await self._receiver().push_blocks(open_bytes, headers, refs)

    async def kv_heartbeat(self, open_bytes: bytes) -> None:
        self._receiver().heartbeat(open_bytes)

    async def kv_cancel(self, open_bytes: bytes) -> None:
        self._receiver().cancel(open_bytes)


class ActorResolver:
    """Worker addresses through actor names: initial lookup, and after restarts."""

    def __init__(self, namespace: str, timeout_s: float = 1.0) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.names: dict[str, str] = {}               # address -> actor name
        self._pending: dict[str, asyncio.Future] = {}  # actor name -> address() call in flight

    async def address_of(self, name: str, timeout_s: float) -> str:
        handle = ray.get_actor(name, namespace=self.namespace)
        address = await asyncio.wait_for(_await(handle.address.remote()), timeout_s)
        self.names[address] = name
        return address

    async def resolve(self, worker) -> str | None:
        """WorkerPool resolver: the current address of an unreachable worker's actor, or None."""
        name = self.names.get(worker.address)
        if name is None:
            return None
        fut = self._pending.get(name)
        if fut is None:
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
            except ValueError:   # gone for good (removed, or out of restarts)
                return None
            # While the actor restarts, this call waits in Ray's queue; keep it across polls.
            fut = self._pending[name] = asyncio.ensure_future(_await(handle.address.remote()))
        try:
            address = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            return None
        except Exception as exc:  # noqa: BLE001 - died again, or unavailable: ask anew next poll
            self._pending.pop(name, None)
            log.info("worker actor %s not reachable yet: %s", name, exc)
            return None
        self._pending.pop(name, None)
        self.names[address] = name
        return address


@ray.remote
class RouterActor(_ServerActor):
    """The router: the client-facing pdserve.v1.Router gRPC API, unchanged."""

    async def __init__(self, spec_json: str) -> None:
        # lazy: transformers only when this runs
        from pdserve.services.api.grpc_router import RouterOptions, serve_router

        spec = self._load(spec_json)
        generation, limits, config = router_configs(spec)
        timeout = config.ready_timeout_s
        self.resolver = ActorResolver(spec["namespace"])
        prefill = [await self.resolver.address_of(n, timeout) for n in spec["prefill"]]
        decode = [await self.resolver.address_of(n, timeout) for n in spec["decode"]]
        options = RouterOptions(model=self.model, prefill=prefill, decode=decode, generation=generation,
                                limits=limits, config=config)
        self.host = bind_host(spec["host"])
        self.credentials = load_credentials(spec)
        self._control = ControlGate(self.credentials, self.name)
        key_file = spec.get("api_key_file")
        api_key = read_secret(key_file, API_KEY_ENV, "API key") if key_file else None
        port = await self._start(lambda stop, on_start: serve_router(
            options, self.host, spec["port"], credentials=self.credentials, api_key=api_key, stop=stop,
            resolver=self.resolver.resolve, on_start=on_start, remote_workers=spec.get("remote_workers", False)))
        self._address = join_host_port(self.host, port)

    async def health(self) -> str:
        """grpc.health.v1 status of this router's server, checked from inside the actor."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("::1" if self.host == "::" else self.host)
        address = join_host_port(host, int(self._address.rsplit(":", 1)[1]))
        async with self.credentials.channel(address, attach_token=False) as ch:   # TLS when configured
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def info(self) -> dict[str, Any]:
        return {"name": self.name, "role": "router", "address": self._address, "model": self.model,
                "workers": dict(self.resolver.names), **_node_info()}

    async def follow(self, actor_name: str, proof: str = "") -> str:
        """Know a worker actor added since the deployment (`pdserve ray scale`) by its name, so that
        the router follows it to its new address when Ray restarts it; returns its address. Needs
        ``control_proof(credentials, router name, "follow")``."""
        self._control.require("follow", proof)
        return await self.resolver.address_of(actor_name, 30.0)
