"""Prefill role: chunked prefill, KV blocks shipped to the decode worker chunk by chunk."""
from __future__ import annotations

import time
from typing import AsyncIterator

import grpc

from engine.block_manager import transfer_block_hashes
from pdserve.v1 import worker_pb2
from services.async_engine import AsyncEngine, StepResult
from services.convert import params_from_proto
from services.kv_transfer import KVBlock, KVSender, KVTransferError


class PrefillHandler:
    def __init__(self, aengine: AsyncEngine, sender: KVSender, metrics=None) -> None:
        self.aengine = aengine
        self.sender = sender
        self.metrics = metrics
        self.block_size = aengine.config.block_size

    async def prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[worker_pb2.PrefillEvent]:
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        params = params_from_proto(request.params)
        try:
            stream = await self.aengine.add_request(rid, prompt, params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        hashes = transfer_block_hashes(prompt, self.block_size)
        skip = set(request.skip_block_indices)
        sent_bytes, transfer_s, done = 0, 0.0, False
        try:
            while True:
                res: StepResult = await stream.get()
                out = res.output
                if out.finish_reason == "abort":
                    await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
                if out.ready_blocks and request.decode_address:
                    t0 = time.perf_counter()
                    shipped, nbytes = await self._ship(rid, request.decode_address, out.ready_blocks, res, hashes, skip, context)
                    elapsed = time.perf_counter() - t0
                    sent_bytes += nbytes
                    # Transfer that overlaps later chunks is hidden; what remains after the last chunk is exposed.
                    transfer_s = elapsed if out.prefill_done else transfer_s
                    if shipped:
                        yield worker_pb2.PrefillEvent(blocks_shipped=worker_pb2.BlocksShipped(block_indices=shipped, bytes=nbytes))
                if out.prefill_done:
                    done = True
                    pdone = worker_pb2.PrefillDone(
                        first_token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
                        queue_ms=(out.queue_s or 0.0) * 1e3, prefill_ms=(out.prefill_s or 0.0) * 1e3,
                        kv_transfer_ms=transfer_s * 1e3, kv_bytes_sent=sent_bytes)
                    if out.finish_reason is not None:
                        pdone.finish_reason = out.finish_reason
                    yield worker_pb2.PrefillEvent(done=pdone)
                    return
        finally:
            self.aengine.close_stream(rid)
            if done:
                await self.aengine.call(lambda e: e.release(rid))
            else:   # cancelled or failed: drop it wherever it is and unpin its blocks
                await self.aengine.call(lambda e: e.abort(rid))

    async def _ship(self, rid: str, target: str, indices: list[int], res: StepResult, hashes: list[int],
                    skip: set[int], context: grpc.aio.ServicerContext) -> tuple[list[int], int]:
        assert res.blocks is not None
        n_layers = res.blocks.shape[1]
        prompt_len = res.output.num_prompt_tokens
        blocks = [
            KVBlock.from_tensor(res.blocks[j], request_id=rid, block_index=idx, block_hash=hashes[idx],
                                num_tokens=min(self.block_size, prompt_len - idx * self.block_size),
                                layer_start=0, layer_end=n_layers)
            for j, idx in enumerate(indices) if idx not in skip
        ]
        if not blocks:
            return [], 0
        try:
            result = await self.sender.send_blocks(target, blocks)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to {target} failed: {exc}")
        if result.rejected:
            await context.abort(grpc.StatusCode.DATA_LOSS,
                                f"decode worker rejected blocks {result.rejected}: {result.error}")
        if self.metrics is not None:
            self.metrics.kv_sent(result.bytes, result.seconds)
        return [b.block_index for b in blocks], result.bytes
