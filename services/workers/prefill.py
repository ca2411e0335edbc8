"""Prefill role: chunked prefill; each chunk's finished blocks go to the decode worker while the
next chunk computes; the sampled token goes back to the router at once, before the KV lands."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import grpc

from pdserve.engine.kv.block_manager import salt_root, transfer_block_hashes
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.common.proto_convert import first_token_proto, params_from_proto
from pdserve.services.kv_transfer import KVBlock, KVSender, KVTransferError
from pdserve.services.workers.lifecycle import WorkerState

HEARTBEAT_S = 0.5          # Progress to the router and a KV heartbeat to the decode worker, while computing
KV_ACK_TIMEOUT_S = 30.0    # the decode worker must acknowledge the last block within this


class PrefillHandler(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, sender: KVSender, state: WorkerState, metrics=None,
                 heartbeat_s: float = HEARTBEAT_S, kv_ack_timeout_s: float = KV_ACK_TIMEOUT_S,
                 data_sender: KVSender | None = None) -> None:
        """data_sender: KV to a target that names a raw TCP data plane (KVTarget.data_address) goes
        through it (over sender when that plane cannot be had: TcpKVStream); None, or a target
        without one: sender (gRPC)."""
        self.aengine = aengine
        self.sender = sender
        self.data_sender = data_sender
        self.state = state
        self.metrics = metrics
        self.block_size = aengine.config.block_size
        self.heartbeat_s = heartbeat_s
        self.kv_ack_timeout_s = kv_ack_timeout_s

    @staticmethod
    def _blocks(rid: str, ready: list[int], pieces, needed: set[int], hashes: list[int]) -> list[KVBlock]:
        """A step's ready blocks the decode worker needs, each as its ranks' head ranges."""
        return [KVBlock(rid, idx, hashes[idx], data[j], head_start=start, head_end=end)
                for j, idx in enumerate(ready) if idx in needed for start, end, data in pieces]

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.PrefillEvent]:
        rid = request.request_id
        await self.state.refuse_if_draining(context)
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        try:
            stream = self.aengine.add(rid, request.prompt_token_ids, params_from_proto(request.params),
                                      request.output_token_ids)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        target = request.target
        needed = set(target.needed_block_indices)
        kv = None
        if needed and target.data_address and self.data_sender is not None:   # gRPC when the plane cannot be had
            kv = self.data_sender.open(target.data_address, rid, target.transfer_token,
                                       fallback=lambda: self.sender.open(target.address, rid, target.transfer_token))
        elif needed:
            kv = self.sender.open(target.address, rid, target.transfer_token)
        salt = request.params.cache_salt if request.params.HasField("cache_salt") else None
        hashes = transfer_block_hashes(tokens, self.block_size, salt_root(salt))
        delivered = False
        last_sent = 0
        try:
            with self.state.track():
                async with stream:
                    while True:
                        try:
                            res = await stream.get(timeout=self.heartbeat_s)
                        except asyncio.TimeoutError:   # queued, or in a long step: say so, both ways
                            if kv is not None:
                                await kv.heartbeat()
                            yield worker_pb2.PrefillEvent(progress=worker_pb2.Progress())
                            continue
                        out = res.output
                        if out.finish_reason == "abort":
                            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
                        if out.prefill_done:
                            break
                        if kv is not None and out.ready_blocks:
                            await kv.send(self._blocks(rid, out.ready_blocks, res.blocks, needed, hashes))
                        if out.ready_blocks:
                            yield worker_pb2.PrefillEvent(progress=worker_pb2.Progress())
                sampled_at = time.perf_counter()
                # The first token never waits for KV. The last chunk's blocks (the exposed ones), when
                # already copied out, are only queued for the sender's thread before it: their
                # frames are built while the token is written (its write took 0.5-0.8 ms of the
                # hand-off before they started, 2 cores, 10 Gbit/s).
                copied = bool(kv is not None and out.ready_blocks and res.blocks is not None)
                if copied:
                    last = self._blocks(rid, out.ready_blocks, res.blocks, needed, hashes)
                    last_sent = len({b.block_index for b in last})
                    await kv.send(last)
                yield worker_pb2.PrefillEvent(first_token=first_token_proto(out))
                if kv is not None and out.ready_blocks and not copied:   # a large export: a run at a time, each
                    wanted = [i for i in out.ready_blocks if i in needed]   # sent while the next is copied
                    last_sent = len(wanted)
                    per_run = max(1, self.aengine.export_run_bytes // self.aengine.engine.kv.pool.bytes_per_block)
                    for at in range(0, len(wanted), per_run):
                        run = wanted[at:at + per_run]
                        pieces = await self.aengine.export_blocks(rid, run, views=kv.takes_views)
                        if pieces is None:
                            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
                        await kv.send(self._blocks(rid, run, pieces, needed, hashes))
                blocks = nbytes = wire = streams = 0
                codec = ""
                acked_at = 0.0   # when the receiver acknowledged every block (0: now)
                if kv is not None:
                    try:
                        result = await kv.finish(timeout=self.kv_ack_timeout_s)
                    except KVTransferError as exc:
                        if self.metrics is not None:
                            self.metrics.kv_failure()
                        code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNAVAILABLE)
                        await context.abort(code, f"KV transfer to {target.address} failed: {exc}")
                    delivered = True
                    blocks, nbytes, codec, streams = result.blocks, result.bytes, result.codec, result.streams
                    acked_at = result.acked_at
                    wire = result.wire_bytes or nbytes   # a transport that does not count them sends raw
                    if self.metrics is not None:
                        self.metrics.kv_sent(nbytes, result.seconds, wire, codec)
                yield worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KVDelivered(
                    blocks=blocks, bytes=nbytes, exposed_ms=((acked_at or time.perf_counter()) - sampled_at) * 1e3,
                    exposed_blocks=last_sent if kv is not None else 0, wire_bytes=wire, codec=codec,
                    streams=streams))
        finally:
            if kv is not None and not delivered:
                await kv.cancel()
            self.aengine.engine.release(rid)   # pinned blocks fall back to the prefix cache
