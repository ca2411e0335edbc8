"""Decode role: reserve blocks, verify and store arriving KV, continuous batching of decodes."""
from __future__ import annotations

import time
from typing import AsyncIterator

import grpc

from engine import NoCapacity, SamplingParams
from engine.block_manager import transfer_block_hashes
from pdserve.v1 import worker_pb2
from services.async_engine import AsyncEngine
from services.convert import params_from_proto
from services.kv_transfer import BlockHeader, KVIntegrityError, decode_tensor, dtype_name

DEFAULT_RESERVATION_S = 30.0


class DecodeHandler:
    """Implements Reserve/Decode and is the KV sink of this worker's KVTransfer service."""

    def __init__(self, aengine: AsyncEngine, metrics=None) -> None:
        self.aengine = aengine
        self.metrics = metrics
        runner = aengine.engine.runner
        self.block_shape = runner.block_shape
        self.kv_dtype = dtype_name(runner.dtype)
        self.block_size = aengine.config.block_size
        self.expected_hashes: dict[str, list[int]] = {}   # request id -> chain hash per block
        self.failures: dict[str, str] = {}                # request id -> why its KV was refused

    async def reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.ReserveResponse:
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        params = SamplingParams(max_tokens=max(1, request.max_tokens))
        timeout = request.deadline_ms / 1e3 if request.deadline_ms else DEFAULT_RESERVATION_S
        try:
            needed = await self.aengine.call(lambda e: e.reserve(rid, prompt, params, timeout_s=timeout))
        except NoCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker is full: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        hashes = transfer_block_hashes(prompt, self.block_size)
        self._forget_expired()
        self.expected_hashes[rid] = hashes
        self.failures.pop(rid, None)
        first_needed = needed[0] if needed else len(hashes)
        return worker_pb2.ReserveResponse(needed_block_indices=needed, held_block_hashes=hashes[:first_needed],
                                          num_blocks=len(hashes))

    def _forget_expired(self) -> None:
        """Drop expectations of reservations the engine has let expire (read-only peek)."""
        live = self.aengine.engine.reservations
        for rid in [r for r in self.expected_hashes if r not in live]:
            del self.expected_hashes[rid]

    async def accept_block(self, header: BlockHeader, payload: bytearray) -> None:
        """KV sink: check the block against the reservation, then write it into the pool."""
        rid = header.request_id
        try:
            expected = self.expected_hashes.get(rid)
            if expected is None:
                raise KVIntegrityError(f"no reservation for request {rid!r}")
            if not 0 <= header.block_index < len(expected) or expected[header.block_index] != header.block_hash:
                raise KVIntegrityError(f"block {header.block_index} of {rid!r}: chain hash mismatch")
            if tuple(header.shape) != self.block_shape or header.dtype != self.kv_dtype:
                raise KVIntegrityError(f"block layout {header.dtype}{list(header.shape)} != "
                                       f"{self.kv_dtype}{list(self.block_shape)}")
            # Written from this thread, not queued behind the running step (write_kv_block is safe here).
            self.aengine.engine.write_kv_block(rid, header.block_index, decode_tensor(header, payload))
        except Exception as exc:
            # Fail closed: the whole request is refused and its reservation freed.
            self.failures[rid] = str(exc)
            self.expected_hashes.pop(rid, None)
            await self.aengine.call(lambda e: e.abort(rid))
            if self.metrics is not None:
                self.metrics.kv_failure()
            raise KVIntegrityError(str(exc)) from exc
        if self.metrics is not None:
            self.metrics.kv_received(header.nbytes)

    async def decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        rid = request.request_id
        if rid in self.failures:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"KV of {rid!r} was refused: {self.failures.pop(rid)}")
        params = params_from_proto(request.params)
        stream = self.aengine.open_stream(rid)
        finished = False
        t_admit = time.perf_counter()
        try:
            try:
                reason = await self.aengine.call(lambda e: e.admit(rid, request.first_token_id, params))
            except KeyError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            finally:
                self.expected_hashes.pop(rid, None)
            if reason is not None:
                finished = True
                yield worker_pb2.DecodeEvent(finished=True, finish_reason=reason)
                return
            first = True
            while True:
                out = (await stream.get()).output
                event = worker_pb2.DecodeEvent(token_ids=out.new_token_ids, finished=out.finished)
                if out.finish_reason is not None:
                    event.finish_reason = out.finish_reason
                if first:
                    event.first_decode_step_ms = (time.perf_counter() - t_admit) * 1e3
                    first = False
                if out.finished:
                    finished = True
                yield event
                if out.finished:
                    return
        finally:
            self.aengine.close_stream(rid)
            if not finished:
                await self.aengine.call(lambda e: e.abort(rid))
