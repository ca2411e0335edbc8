"""A worker process: the engine in one role behind the Worker gRPC service (+ KVTransfer
on decode workers), with health, reflection and Prometheus metrics."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Callable

import grpc

from engine import EngineConfig
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.async_engine import AsyncEngine
from services.colocated import ColocatedHandler
from services.decode import DecodeHandler
from services.kv_transfer import GrpcKVSender, KVSender, KVTransferServicer
from services.kv_transfer.grpc_transport import register_kv_servicer
from services.prefill import PrefillHandler
from services.server import start_server, stop_on_signals

log = logging.getLogger(__name__)

ROLE_ENUM = {"prefill": worker_pb2.WORKER_ROLE_PREFILL, "decode": worker_pb2.WORKER_ROLE_DECODE,
             "both": worker_pb2.WORKER_ROLE_BOTH}


@dataclass(slots=True)
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    metrics_port: int | None = None   # Prometheus /metrics; None: no endpoint
    kv_address: str = ""              # advertised as WorkerStatus.kv_address ("": the Worker address)
    kv_sender: KVSender | None = None  # prefill: how KV blocks leave (None: a GrpcKVSender)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, aengine: AsyncEngine, worker_id: str, metrics=None, sender: KVSender | None = None,
                 kv_address: str = "") -> None:
        self.aengine = aengine
        self.role = aengine.config.role
        self.worker_id = worker_id
        self.metrics = metrics
        self.kv_address = kv_address
        self.sender = (sender or GrpcKVSender()) if self.role == "prefill" else None
        self.prefill_handler = PrefillHandler(aengine, self.sender, metrics) if self.sender else None
        self.decode_handler = DecodeHandler(aengine, metrics) if self.role == "decode" else None
        self.colocated_handler = ColocatedHandler(aengine) if self.role == "both" else None

    async def _require(self, handler, context: grpc.aio.ServicerContext, rpc: str):
        if handler is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{rpc} is not served by a {self.role} worker")
        return handler

    async def GetStatus(self, request, context):
        stats = self.aengine.snapshot
        engine = self.aengine.engine
        mc = engine.model_config
        return worker_pb2.WorkerStatus(
            role=ROLE_ENUM[self.role], worker_id=self.worker_id, model_name=self.aengine.config.model,
            kv_address=self.kv_address,
            num_total_blocks=stats["num_total_blocks"], num_free_blocks=stats["num_free_blocks"],
            num_running=stats["num_running"], num_waiting=stats["num_waiting"],
            num_reserved=stats["num_reserved"], num_queued_prompt_tokens=stats["num_queued_prompt_tokens"],
            block_size=self.aengine.config.block_size, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, kv_dtype=str(engine.runner.dtype).removeprefix("torch."),
            max_model_len=engine.max_model_len)

    async def Prefill(self, request, context):
        handler = await self._require(self.prefill_handler, context, "Prefill")
        async for event in handler.prefill(request, context):
            yield event

    async def Reserve(self, request, context):
        handler = await self._require(self.decode_handler, context, "Reserve")
        return await handler.reserve(request, context)

    async def Decode(self, request, context):
        handler = await self._require(self.decode_handler, context, "Decode")
        async for event in handler.decode(request, context):
            yield event

    async def GenerateLocal(self, request, context):
        handler = await self._require(self.colocated_handler, context, "GenerateLocal")
        async for event in handler.generate(request, context):
            yield event

    async def Abort(self, request, context):
        found = await self.aengine.abort(request.request_id)
        if self.decode_handler is not None:
            self.decode_handler.expected_hashes.pop(request.request_id, None)
        return worker_pb2.AbortResponse(found=found)


async def serve_worker(config: EngineConfig, options: WorkerOptions, ready: asyncio.Event | None = None,
                       stop: asyncio.Event | None = None,
                       on_start: Callable[[WorkerServicer, int], None] | None = None) -> None:
    """Run one worker until stop is set (or SIGINT/SIGTERM). on_start(servicer, bound_port) runs once serving."""
    from services.metrics import WorkerMetrics, start_metrics_server

    worker_id = options.worker_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
    metrics = WorkerMetrics(config.role, worker_id)
    aengine = AsyncEngine(config, on_step=metrics.on_step)
    aengine.start()
    servicer = WorkerServicer(aengine, worker_id, metrics, sender=options.kv_sender, kv_address=options.kv_address)
    registrations = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "pdserve.v1.Worker")]
    if servicer.decode_handler is not None:
        kv_servicer = KVTransferServicer(servicer.decode_handler)
        registrations.append((register_kv_servicer, kv_servicer, "pdserve.v1.KVTransfer"))
    server, port, _ = await start_server(registrations, options.host, options.port)
    metrics_note = ""
    if options.metrics_port is not None:
        mport = start_metrics_server(metrics.registry, options.host, options.metrics_port)
        metrics_note = f", metrics on http://{options.host}:{mport}/metrics"
    print(f"pdserve {config.role} worker {worker_id} listening on {options.host}:{port}{metrics_note}", flush=True)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    if on_start is not None:
        on_start(servicer, port)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await server.stop(grace=2)
        if servicer.sender is not None:
            await servicer.sender.close()
        aengine.stop()
