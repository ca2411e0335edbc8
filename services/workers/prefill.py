"""Prefill role: chunked prefill; each chunk's finished blocks go to the decode worker while the
next chunk computes; the sampled token goes back to the router at once, before the KV lands.

One call in four steps: admit the prompt, run it and stream Progress (its blocks shipped chunk by
chunk), hand off (the first token, then the rest of the KV), account (KVDelivered). The blocks
travel through one Handoff (below), whose transport is chosen when the call opens it.

A prefill's KV hand-off: the blocks its decode worker needs, on their way there.

The transport is chosen once per request, when its hand-off opens (``HandoffRoutes.open``):
the decode worker's raw TCP data plane when the target names one and this worker can reach such
planes (over gRPC after all when that plane cannot be had: TcpKVStream's fallback), else this
worker's sender (gRPC, through shared memory to a worker on the same host, or Ray's object
store). A target that needs no block gets a hand-off with no transport. Every hand-off answers
the same calls: ``send`` a step's ready blocks, ``heartbeat``, ``finish`` (wait for the
acknowledgement of every block), ``close`` (cancel unless finished).
"""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
import torch

from pdserve.engine.kv.block_manager import salt_root, transfer_block_hashes
from pdserve.services.common.proto_convert import first_token_proto, params_from_proto
from pdserve.services.kv_transfer import KVBlock, KVSender, KVStream, KVTransferError, SendResult
from pdserve.services.workers.async_engine import AsyncEngine, RequestStream, StepResult
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
            params = params_from_proto(request.params)
            await self.aengine.compile_grammar(params)
            return self.aengine.add(request.request_id, request.prompt_token_ids, params, request.output_token_ids)
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


# Exported blocks as AsyncEngine gives them (StepResult.blocks): (head_start, head_end, data) per slice.
BlockPieces = list[tuple[int, int, torch.Tensor]]


class Handoff:
    """A hand-off with nothing to ship (the decode worker holds every block): every call is a no-op."""

    ships = False        # blocks go to the decode worker
    takes_views = False  # blocks may be views of pinned pool blocks (KVStream.takes_views)

    def __init__(self, target: str = "") -> None:
        self.target = target   # the decode worker's address, for error messages

    def wanted(self, ready: Sequence[int]) -> list[int]:
        """The blocks among ready that the decode worker needs."""
        return []

    async def send(self, ready: Sequence[int], pieces: BlockPieces) -> None:
        """Queue the needed ones among a step's ready blocks (their pieces, as exported)."""

    async def heartbeat(self) -> None:
        """Tell the decode worker the prefill is still working (its reservation's lease goes on)."""

    async def finish(self, timeout: float | None = None) -> SendResult:
        """Wait until every sent block is acknowledged; raises KVTransferError."""
        return SendResult(0, 0, 0.0, codec="", streams=0)

    async def close(self) -> None:
        """Cancel the transfer unless it finished (the decode worker then frees its reservation)."""


class StreamHandoff(Handoff):
    """A hand-off over one transport's stream to the decode worker."""

    ships = True

    def __init__(self, request_id: str, target: str, stream: KVStream, needed: set[int], hashes: list[int]) -> None:
        super().__init__(target)
        self.request_id = request_id
        self.stream = stream
        self.needed = needed
        self.hashes = hashes          # every block's chain hash, which the receiver checks
        self.takes_views = stream.takes_views
        self.finished = False

    def wanted(self, ready: Sequence[int]) -> list[int]:
        return [i for i in ready if i in self.needed]

    async def send(self, ready: Sequence[int], pieces: BlockPieces) -> None:
        await self.stream.send([KVBlock(self.request_id, idx, self.hashes[idx], data[j], head_start=start,
                                        head_end=end)
                                for j, idx in enumerate(ready) if idx in self.needed for start, end, data in pieces])

    async def heartbeat(self) -> None:
        await self.stream.heartbeat()

    async def finish(self, timeout: float | None = None) -> SendResult:
        result = await self.stream.finish(timeout=timeout)
        self.finished = True
        return result

    async def close(self) -> None:
        if not self.finished:
            await self.stream.cancel()


class HandoffRoutes:
    """This worker's ways to a decode worker: sender (gRPC, shared memory or Ray), and data_sender
    for a target that names a raw TCP data plane (KVTarget.data_address; None: never)."""

    def __init__(self, sender: KVSender, data_sender: KVSender | None, block_size: int) -> None:
        self.sender = sender
        self.data_sender = data_sender
        self.block_size = block_size

    def open(self, request: worker_pb2.PrefillRequest) -> Handoff:
        """The request's hand-off to its target, over the transport chosen here, once."""
        target, rid = request.target, request.request_id
        needed = set(target.needed_block_indices)
        if not needed:
            return Handoff(target.address)
        salt = request.params.cache_salt if request.params.HasField("cache_salt") else None
        hashes = transfer_block_hashes([*request.prompt_token_ids, *request.output_token_ids], self.block_size,
                                       salt_root(salt))
        return StreamHandoff(rid, target.address, self._stream(rid, target), needed, hashes)

    def _stream(self, rid: str, target: worker_pb2.KVTarget) -> KVStream:
        grpc_stream = functools.partial(self.sender.open, target.address, rid, target.transfer_token)
        if target.data_address and self.data_sender is not None:
            return self.data_sender.open(target.data_address, rid, target.transfer_token, fallback=grpc_stream)
        return grpc_stream()
