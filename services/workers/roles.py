"""The roles one worker process can serve: every worker registers the prefill, decode and
colocated services from the start (a started gRPC server takes no new service), answers each only
while it is in that role (UNAVAILABLE otherwise), and builds each role's side (its handler, KV
senders or the KV data listener) the first time it takes the role. Worker.SetRole switches between
them (services/workers/worker_process.py)."""
from __future__ import annotations

import logging
from typing import Callable, TYPE_CHECKING

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.kv_transfer import GrpcKVSender, KVSender, KVTransferServicer, shared_memory
from pdserve.services.kv_transfer.grpc_transport import SharedMemoryRoute, grpc_message_limit
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.workers.colocated import ColocatedHandler
from pdserve.services.workers.data_plane import kv_data_listener, kv_data_sender
from pdserve.services.workers.decode import DecodeHandler
from pdserve.services.workers.lifecycle import WorkerState
from pdserve.services.workers.prefill import PrefillHandler

if TYPE_CHECKING:
    from pdserve.services.kv_transfer.tcp_receiver import KVDataListener
    from pdserve.services.workers.worker_metrics import WorkerMetrics
    from pdserve.services.workers.options import WorkerOptions

log = logging.getLogger(__name__)


class RoleSides:
    """Each role's side of this worker, built the first time the worker takes the role and kept
    (switching back reuses it), closed at shutdown: prefill: the KV senders (gRPC, raw TCP) and
    its handler; decode: the raw TCP KV data listener, the KV metrics hooks and its handler."""

    def __init__(self, aengine: AsyncEngine, state: WorkerState, metrics: "WorkerMetrics",
                 options: "WorkerOptions") -> None:
        self.aengine = aengine
        self.state = state
        self.metrics = metrics
        self.options = options
        self.handlers: dict[str, object] = {}
        self.sender: KVSender | None = None
        self.data_sender: KVSender | None = None
        self.listener: "KVDataListener | None" = None

    def handler(self, role: str) -> object:
        """The role's servicer, built on first use (raises what building its side raises)."""
        if role not in self.handlers:
            build = {"prefill": self._prefill, "decode": self._decode, "both": self._colocated}[role]
            self.handlers[role] = build()
        return self.handlers[role]

    def _prefill(self) -> PrefillHandler:
        creds, wc = self.options.credentials, self.options.config
        if wc.kv_shared_memory and shared_memory.available(wc.kv_shared_memory_dir):
            # segments a previous sender died holding; no live hand-off outlives a lease (and the
            # sender sweeps again periodically)
            shared_memory.sweep(wc.kv_lease_max_s, wc.kv_shared_memory_dir)
        self.sender = self.options.kv_sender or GrpcKVSender(
            lambda address: creds.channel(address, channel_options([("grpc.max_send_message_length",
                                                                     grpc_message_limit())]), attach_token=False),
            proof=creds.call_proof if creds.key is not None else None, shared_memory=wc.kv_shared_memory,
            shared_memory_route=SharedMemoryRoute(wc.kv_shared_memory_dir, max_bytes=wc.kv_shared_memory_max_bytes,
                                                  sweep_after_s=wc.kv_lease_max_s),
            cluster_token=creds.cluster_token, kv_compression=wc.kv_compression)
        self.data_sender = kv_data_sender(self.options) if self.options.kv_sender is None else None
        return PrefillHandler(self.aengine, self.sender, self.state, self.metrics, data_sender=self.data_sender)

    def _decode(self) -> DecodeHandler:
        kv = self.aengine.connector
        self.listener = kv_data_listener(kv, self.options)
        kv.subscribe(on_change=lambda rid, st: self.metrics.kv_handoff_ended(st), on_block=self.metrics.kv_received)
        return DecodeHandler(self.aengine, self.state, self.listener.address() if self.listener is not None else "")

    def _colocated(self) -> ColocatedHandler:
        return ColocatedHandler(self.aengine, self.state)

    async def close(self) -> None:
        """Close whatever the roles taken so far opened."""
        for sender in (self.sender, self.data_sender):
            if sender is not None:
                await sender.close()
        if self.listener is not None:
            self.listener.close()


class RoleGate:
    """A role's service as registered from the start: each call goes to the role's handler while
    the worker is in that role, and is refused UNAVAILABLE otherwise (a worker fault to the
    router, which retries elsewhere; not UNIMPLEMENTED, which it would blame on the request).
    In its role a call costs one comparison: the handler's own coroutine or stream is returned."""

    def __init__(self, service: ServiceDescriptor, role: str, state: WorkerState, sides: RoleSides) -> None:
        self.role = role   # "prefill", "decode" or "both"
        self.state = state
        self.sides = sides
        for method in service.methods:
            setattr(self, method.name, self._method(method.name, method.server_streaming))

    def _method(self, name: str, streaming: bool) -> Callable:
        def call(request, context: grpc.aio.ServicerContext):
            if self.state.role == self.role:
                return getattr(self.sides.handler(self.role), name)(request, context)
            return self._refuse_stream(context) if streaming else self.state.refuse_unless_role(context, self.role)
        return call

    async def _refuse_stream(self, context: grpc.aio.ServicerContext):
        await self.state.refuse_unless_role(context, self.role)
        yield   # never reached: the call was aborted


class GatedKVTransfer(KVTransferServicer):
    """KVTransfer, registered on a worker that may switch roles: KV is pushed to it only while it
    decodes (no reservation outlives the decode role, so a push in another role would fail anyway;
    this says why)."""

    def __init__(self, state: WorkerState, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = state

    async def PushBlocks(self, request_iterator, context: grpc.aio.ServicerContext):
        await self.state.refuse_unless_role(context, "decode")
        return await super().PushBlocks(request_iterator, context)
