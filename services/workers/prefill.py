"""Prefill role: chunked prefill; each chunk's finished blocks go to the decode worker while the
next chunk computes; the sampled token goes back to the router at once, before the KV lands.

One call in four steps: admit the prompt, run it and stream Progress (its blocks shipped chunk by
chunk), hand off (the first token, then the rest of the KV), account (KVDelivered). The blocks
travel through one Handoff (handoff.py), whose transport is chosen when the call opens it."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from pdserve.services.common.proto_convert import first_token_proto, params_from_proto
from pdserve.services.kv_transfer import KVSender, KVTransferError
from pdserve.services.workers.async_engine import AsyncEngine, RequestStream, StepResult
from pdserve.services.workers.handoff import Handoff, HandoffRoutes
from pdserve.services.workers.lifecycle import WorkerState
from pdserve.v1 import worker_pb2, worker_pb2_grpc

HEARTBEAT_S = 0.5          # Progress to the router and a KV heartbeat to the decode worker, while computing
KV_ACK_TIMEOUT_S = 30.0    # the decode worker must acknowledge the last block within this


@dataclass(eq=False)
class PrefillCall:
    """One Prefill call, as its steps hand it on."""

    request_id: str
    stream: RequestStream
    handoff: Handoff
    context: grpc.aio.ServicerContext
    last: StepResult | None = None   # the output that ended the prompt (its first token)
    sampled_at: float = 0.0          # time.perf_counter() when it came
    exposed_blocks: int = 0          # blocks still to ship once the first token is out


class PrefillHandler(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, sender: KVSender, state: WorkerState, metrics=None,
                 heartbeat_s: float = HEARTBEAT_S, kv_ack_timeout_s: float = KV_ACK_TIMEOUT_S,
                 data_sender: KVSender | None = None) -> None:
        """data_sender: KV to a target that names a raw TCP data plane (KVTarget.data_address) goes
        through it (over sender when that plane cannot be had: TcpKVStream); None, or a target
        without one: sender (gRPC). HandoffRoutes picks one per request."""
        self.aengine = aengine
        self.routes = HandoffRoutes(sender, data_sender, aengine.config.block_size)
        self.state = state
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.kv_ack_timeout_s = kv_ack_timeout_s

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.PrefillEvent]:
        """Progress while the prompt waits and computes, FirstToken at once, KVDelivered once the
        decode worker acknowledged every block."""
        stream = await self._admit(request, context)
        call = PrefillCall(request.request_id, stream, self.routes.open(request), context)
        try:
            with self.state.track():
                async with stream:
                    async for event in self._run_and_stream(call):
                        yield event
                    yield await self._first_token(call)
                    await self._ship_rest(call)
                    yield await self._account(call)
        finally:
            await call.handoff.close()
            self.aengine.release(call.request_id)   # pinned blocks fall back to the prefix cache

    async def _admit(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                     ) -> RequestStream:
        await self.state.refuse_if_draining(context)
        try:
            return self.aengine.add(request.request_id, request.prompt_token_ids, params_from_proto(request.params),
                                    request.output_token_ids)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise   # not reached: abort raises

    async def _run_and_stream(self, call: PrefillCall) -> AsyncIterator[worker_pb2.PrefillEvent]:
        """Until the prompt is computed (call.last): each chunk's ready blocks shipped, and Progress
        after them and every heartbeat_s without output (queued, or in a long step), when the
        decode worker hears a heartbeat too."""
        while True:
            try:
                res = await call.stream.get(timeout=self.heartbeat_s)
            except asyncio.TimeoutError:
                await call.handoff.heartbeat()
                yield worker_pb2.PrefillEvent(progress=worker_pb2.Progress())
                continue
            out = res.output
            if out.finish_reason == "abort":
                await call.context.abort(grpc.StatusCode.ABORTED, f"request {call.request_id} was aborted")
            if out.prefill_done:
                call.last = res
                return
            if out.ready_blocks:
                await call.handoff.send(out.ready_blocks, res.blocks)
                yield worker_pb2.PrefillEvent(progress=worker_pb2.Progress())

    async def _first_token(self, call: PrefillCall) -> worker_pb2.PrefillEvent:
        """The first token never waits for KV. The last chunk's blocks (the exposed ones), when
        already copied out, are only queued for the sender's thread before it: their frames are
        built while the token is written (its write took 0.5-0.8 ms of the hand-off before they
        started, 2 cores, 10 Gbit/s)."""
        res = call.last
        call.sampled_at = time.perf_counter()
        call.exposed_blocks = len(call.handoff.wanted(res.output.ready_blocks))
        if res.blocks is not None:
            await call.handoff.send(res.output.ready_blocks, res.blocks)
        return worker_pb2.PrefillEvent(first_token=first_token_proto(res.output))

    async def _ship_rest(self, call: PrefillCall) -> None:
        """A large export, after the first token: a run at a time, each sent while the next is copied."""
        if call.last.blocks is not None:
            return
        wanted = call.handoff.wanted(call.last.output.ready_blocks)
        per_run = self.aengine.export_run_blocks
        for at in range(0, len(wanted), per_run):
            run = wanted[at:at + per_run]
            pieces = await self.aengine.export_blocks(call.request_id, run, views=call.handoff.takes_views)
            if pieces is None:
                await call.context.abort(grpc.StatusCode.ABORTED, f"request {call.request_id} was aborted")
            await call.handoff.send(run, pieces)

    async def _account(self, call: PrefillCall) -> worker_pb2.PrefillEvent:
        """Wait for the decode worker's acknowledgement of every block, count the transfer, report it."""
        try:
            result = await call.handoff.finish(timeout=self.kv_ack_timeout_s)
        except KVTransferError as exc:
            if self.metrics is not None:
                self.metrics.kv_failure()
            code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNAVAILABLE)
            await call.context.abort(code, f"KV transfer to {call.handoff.target} failed: {exc}")
            raise   # not reached: abort raises
        wire = result.wire_bytes or result.bytes   # a transport that does not count them sends raw
        if call.handoff.ships and self.metrics is not None:
            self.metrics.kv_sent(result.bytes, result.seconds, wire, result.codec)
        acked_at = result.acked_at or time.perf_counter()   # when the receiver acknowledged every block
        return worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KVDelivered(
            blocks=result.blocks, bytes=result.bytes, exposed_ms=(acked_at - call.sampled_at) * 1e3,
            exposed_blocks=call.exposed_blocks, wire_bytes=wire, codec=result.codec, streams=result.streams))
