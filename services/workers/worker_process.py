"""A worker process: the engine in one role behind that role's gRPC service (plus the common
Worker service, and KVTransfer on decode workers), with health, reflection, metrics, the
cluster-token check on every internal call, and a graceful drain on SIGTERM.

A worker serves any role: every role's services are registered, the other roles' refused
(services/workers/roles.py), and Worker.SetRole switches an idle worker between prefill, decode
and colocated in its running process, model and KV pool kept loaded."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from pdserve.engine import EngineConfig
from pdserve.engine.step_cost import published_costs
from pdserve.services.common import tracing
from pdserve.services.common.grpc_setup import Server, service_registration, start_server, stop_on_signals
from pdserve.services.common.metrics import start_metrics_server
from pdserve.services.common.proto_convert import ROLE_ENUM, ROLE_NAMES
from pdserve.services.kv_transfer import KVSender, register_kv_servicer
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.workers.config import ENGINE_STALL_EXIT_CODE
from pdserve.services.workers.lifecycle import StallWatchdog, WorkerState
from pdserve.services.workers.membership_client import keep_joined
from pdserve.services.workers.options import WorkerOptions
from pdserve.services.workers.roles import GatedKVTransfer, RoleGate, RoleSides
from pdserve.services.workers.worker_metrics import WorkerMetrics
from pdserve.v1 import common_pb2, membership_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

STATUS_HEARTBEAT_S = 1.0     # WatchStatus sends the status at least this often
STATUS_MIN_INTERVAL_S = 0.01  # and at most once per this interval
MAX_KEYS_PER_MESSAGE = 16384  # WatchKVEvents: prefix-cache keys in one message (128 KiB)


def _role_name(value: int) -> str:
    try:
        return worker_pb2.WorkerRole.Name(value)
    except ValueError:
        return f"unknown role {value}"


def _round3(x: float) -> float:
    """3 significant digits: a published estimate changes the status only when it really moves."""
    return float(f"{x:.3g}")


class WorkerInfoServicer(worker_pb2_grpc.WorkerServicer):
    """Status, status stream, abort and role switch: served by every role."""

    def __init__(self, aengine: AsyncEngine, worker_id: str, state: WorkerState, kv_address: str = "",
                 sides: RoleSides | None = None, metrics: "WorkerMetrics | None" = None) -> None:
        """sides: the roles this worker can take (None: it cannot switch); metrics: relabelled
        with the new role on a switch."""
        self.aengine = aengine
        self.worker_id = worker_id
        self.state = state
        self.kv_address = kv_address
        self.sides = sides
        self.metrics = metrics

    @property
    def role(self) -> str:
        return self.state.role

    def status(self) -> worker_pb2.WorkerStatus:
        stats = self.aengine.engine.stats()
        engine = self.aengine.engine
        mc = engine.model_config
        base_ms, ms_per_token, ms_per_seq = published_costs(engine.step_cost, engine.decode_step_cost)
        return worker_pb2.WorkerStatus(
            role=ROLE_ENUM[self.role], worker_id=self.worker_id, model_name=self.aengine.config.model,
            kv_address=self.kv_address,
            num_total_blocks=stats["num_total_blocks"], num_free_blocks=stats["num_free_blocks"],
            num_running=stats["num_running"], num_waiting=stats["num_waiting"],
            num_reserved=stats["num_reserved"], num_queued_prompt_tokens=stats["num_queued_prompt_tokens"],
            block_size=self.aengine.config.block_size, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, kv_dtype=engine.runner.kv_dtype_name, max_model_len=engine.max_model_len,
            draining=self.state.draining, num_sending=stats["num_pinned"],
            step_base_ms=_round3(base_ms), step_ms_per_token=_round3(ms_per_token),
            decode_ms_per_seq=_round3(ms_per_seq),
            max_num_batched_tokens=engine.prompt_chunk_tokens(),
            kv_tier_load_ms_per_block=_round3(engine.kv_tiers.load_ms_per_block) if engine.kv_tiers else 0.0)

    async def GetStatus(self, request, context):
        return self.status()

    async def WatchStatus(self, request, context) -> AsyncIterator[worker_pb2.WorkerStatus]:
        last, sent_at = None, 0.0
        while True:
            status = self.status()
            now = time.monotonic()
            if status != last or now - sent_at >= STATUS_HEARTBEAT_S:
                yield status
                last, sent_at = status, now
            await self.aengine.wait_status_change(STATUS_HEARTBEAT_S)
            await asyncio.sleep(STATUS_MIN_INTERVAL_S)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=self.aengine.abort(request.request_id))

    async def SetRole(self, request: worker_pb2.SetRoleRequest, context) -> worker_pb2.WorkerStatus:
        """Switch between prefill, decode and colocated ("both") in this process, model and KV
        pool kept loaded. Only an idle
        worker switches (FAILED_PRECONDITION naming what is still here: the router drains it
        first); the same role answers the status; a draining worker refuses (UNAVAILABLE)."""
        role = ROLE_NAMES.get(request.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be WORKER_ROLE_PREFILL, "
                                f"WORKER_ROLE_DECODE or WORKER_ROLE_BOTH, got {_role_name(request.role)}")
        await self.state.refuse_if_draining(context)
        old = self.state.role
        if role == old:
            return self.status()
        if self.sides is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {old} worker cannot switch to {role}")
        busy = self.busy_reasons()
        if busy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} cannot switch "
                                f"{old} -> {role} while requests are here: {', '.join(busy)} (drain it first)")
        try:
            self.sides.handler(role)   # the new role's side first (say, its KV data listener): may fail
        except (OSError, ValueError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} cannot take the "
                                f"{role} role: {exc}")
        try:
            self.aengine.set_role(role)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.state.role = role
        if self.metrics is not None:
            self.metrics.set_role(role)
        log.info("worker %s switched role %s -> %s", self.worker_id, old, role)
        self.aengine.status_changed()
        return self.status()

    def busy_reasons(self) -> list[str]:
        """What keeps this worker from switching roles ([]: idle): its RPCs in flight, the engine's work."""
        rpcs = [f"{self.state.inflight} RPC(s) in flight"] if self.state.inflight else []
        return [*rpcs, *self.aengine.busy_reasons()]

    async def WatchKVEvents(self, request, context) -> AsyncIterator[worker_pb2.KVEvents]:
        """A snapshot of the prefix-cache keys, then their net changes, woken by the same
        notifications as WatchStatus (every step, admission, abort) and batched as densely."""
        cursor = None
        while True:
            batch = self.aengine.engine.read_kv_events(cursor)
            cursor = batch.cursor
            if batch:
                reset = batch.reset
                stored, removed, tiered = batch.stored, batch.removed, batch.tiered
                while reset or stored or removed or tiered:
                    n_removed = min(len(removed), MAX_KEYS_PER_MESSAGE)
                    n_stored = min(len(stored), MAX_KEYS_PER_MESSAGE - n_removed)
                    n_tiered = min(len(tiered), MAX_KEYS_PER_MESSAGE - n_removed - n_stored)
                    yield worker_pb2.KVEvents(reset=reset, stored=stored[:n_stored], removed=removed[:n_removed],
                                              tiered=tiered[:n_tiered])
                    stored, removed, tiered, reset = stored[n_stored:], removed[n_removed:], tiered[n_tiered:], False
            await self.aengine.wait_status_change(STATUS_HEARTBEAT_S)
            await asyncio.sleep(STATUS_MIN_INTERVAL_S)


@dataclass(eq=False)
class RunningWorker:
    """What serve_worker hands to on_start (Ray actors use it)."""

    aengine: AsyncEngine
    info: WorkerInfoServicer
    server: Server
    metrics: object
    sender: KVSender | None


async def serve_worker(config: EngineConfig, options: WorkerOptions, stop: asyncio.Event | None = None,
                       on_start: Callable[[RunningWorker], None] | None = None) -> None:
    """Run one worker until stop is set (or SIGINT/SIGTERM), then drain. on_start runs once serving.
    Raises RankFailure, after draining, when a tensor-parallel rank died: the worker cannot step
    again, and its supervisor (`pdserve up`, Ray) restarts it."""

    worker_id = options.worker_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
    metrics = WorkerMetrics(config.role, worker_id, model_name=config.model)
    aengine = AsyncEngine(config, lease=options.config.lease, on_step=metrics.on_step)
    metrics.attach(aengine.engine)   # gauges read at scrape time: exact after admission, cancel, finish
    aengine.start()
    stall_timeout_s = options.config.engine_stall_timeout_s
    watchdog = StallWatchdog(lambda: aengine.heartbeat, stall_timeout_s,   # a stuck engine thread ends the process
                             lambda stalled_s: exit_stalled(aengine, worker_id, stalled_s, stall_timeout_s))
    watchdog.start()
    state = WorkerState(config.role)
    sides = RoleSides(aengine, state, metrics, options)
    sides.handler(config.role)   # the starting role's side now (its KV data listener, senders)
    info = WorkerInfoServicer(aengine, worker_id, state, options.kv_address or options.config.kv_advertise_address,
                              sides=sides, metrics=metrics)
    tracing.configure(f"pdserve-{config.role}", options.config.otlp_endpoint, worker_id, options.credentials,
                      options.config.otlp_insecure)
    server = await start_server(role_registrations(info, sides, options), options.host, options.port,
                                interceptors=[*options.credentials.server_interceptors(),
                                              *tracing.server_interceptors()],
                                credentials=options.credentials.server_credentials(),
                                advertised=(options.config.advertise_address, options.config.kv_advertise_address))
    metrics_note = ""
    if options.metrics_port is not None:
        mport = start_metrics_server(metrics.registry, options.host, options.metrics_port, options.metrics_token)
        metrics_note = f", metrics on http://{options.host}:{mport}/metrics"
    data_note = f", KV data plane on {sides.listener.address()}" if sides.listener is not None else ""
    print(f"pdserve {config.role} worker {worker_id} listening on {options.host}:{server.port}{metrics_note}"
          f"{data_note}", flush=True)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    aengine.on_fatal = stop.set   # a dead tensor-parallel rank: drain, then raise aengine.failure
    if on_start is not None:
        on_start(RunningWorker(aengine, info, server, metrics, sides.sender))
    membership = None
    if options.config.router:   # a member of that router for as long as this process serves
        address = options.config.advertise_address or f"{options.host}:{server.port}"
        membership = asyncio.create_task(keep_joined(options.config.router, lambda: membership_pb2.JoinRequest(
            address=address, role=ROLE_ENUM[state.role], worker_id=worker_id), options.credentials))
    try:
        await stop.wait()
        state.draining = True               # refuse new work, tell the router, let the rest finish
        aengine.status_changed()
        await server.set_serving(False)
        if not await state.wait_idle(options.config.drain_timeout_s):
            log.warning("drain timeout: %d request(s) still in flight on %s", state.inflight, worker_id)
    finally:
        if membership is not None:
            membership.cancel()
        await server.server.stop(grace=1)
        await sides.close()
        watchdog.stop()   # a hung engine thread still hangs stop() no longer than its join
        aengine.stop()
        tracing.shutdown()
    if aengine.failure is not None:
        raise aengine.failure


def exit_stalled(aengine: AsyncEngine, worker_id: str, stalled_s: float, timeout_s: float) -> None:
    """The engine loop made no progress for stalled_s while it had work: it will not serve again.
    Say so in one line (then where the engine thread is stuck), and end the process at once
    (os._exit: the stuck thread would hang a normal exit) with ENGINE_STALL_EXIT_CODE, so that the
    supervisor (`pdserve up`, Ray) restarts it like any crashed worker and the router, whose streams
    from here break, migrates its requests."""
    try:
        frame = sys._current_frames().get(aengine.thread_ident or -1)
        where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(engine thread gone)\n"
        log.critical("worker %s: engine loop made no progress for %.1fs (engine_stall_timeout_s %g); exiting with "
                     "code %d to be restarted. The engine thread is stuck at:\n%s", worker_id, stalled_s, timeout_s,
                     ENGINE_STALL_EXIT_CODE, where.rstrip())
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
    finally:
        os._exit(ENGINE_STALL_EXIT_CODE)


def role_registrations(info: WorkerInfoServicer, sides: RoleSides, options: WorkerOptions
                       ) -> list[tuple[Callable, object, str]]:
    """The services a worker registers: Worker, and every role's (KVTransfer too), each answering
    in its role only, so that the worker can switch roles in place."""
    services = worker_pb2.DESCRIPTOR.services_by_name
    registrations: list[tuple[Callable, object, str]] = [service_registration(services["Worker"], info)]
    state = sides.state
    for role, name in (("prefill", "PrefillWorker"), ("decode", "DecodeWorker"), ("both", "ColocatedWorker")):
        registrations.append(service_registration(services[name], RoleGate(services[name], role, state, sides)))
    wc = options.config
    kv_servicer = GatedKVTransfer(state, sides.aengine.connector, shared_memory=wc.kv_shared_memory,
                                  shared_memory_dir=wc.kv_shared_memory_dir,
                                  cluster_token=options.credentials.cluster_token)
    registrations.append((lambda servicer, server: register_kv_servicer(servicer, server), kv_servicer,
                          "pdserve.v1.KVTransfer"))
    return registrations
