"""Decode role: reserve blocks for a sequence whose KV arrives from a prefill worker, admit it
once the KV connector has every block verified, and decode it with continuous batching."""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

import grpc

from pdserve.engine import NoCapacity
from pdserve.engine.kv.handoff import HandoffError, HandoffState
from pdserve.services.common.proto_convert import decode_event_proto, params_from_proto
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.workers.colocated import generate_local
from pdserve.services.workers.lifecycle import WorkerState
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def status_code(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)


class DecodeHandler(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, aengine: AsyncEngine, state: WorkerState, data_address: str = "") -> None:
        """data_address: this worker's raw TCP KV data plane, named in every reservation ("": none)."""
        self.aengine = aengine
        self.state = state
        self.data_address = data_address

    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.ReserveResponse:
        await self.state.refuse_if_draining(context)
        try:
            params = params_from_proto(request.params)
            await self.aengine.compile_grammar(params)
            res = self.aengine.reserve(request.request_id, request.prompt_token_ids, params,
                                       request.output_token_ids, lease_s=request.lease_ms / 1e3 or None)
        except NoCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker is full: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.ReserveResponse(needed_block_indices=res.needed_block_indices,
                                          held_block_hashes=res.held_block_hashes, num_blocks=res.num_blocks,
                                          transfer_token=res.transfer_token, lease_ms=int(res.lease_s * 1e3),
                                          data_address=self.data_address)

    async def FailTransfer(self, request: worker_pb2.FailTransferRequest, context: grpc.aio.ServicerContext
                           ) -> common_pb2.AbortResponse:
        found = self.aengine.connector.fail(request.request_id, "UNAVAILABLE",
                                            f"the prefill worker could not deliver the KV: {request.reason[:512]}")
        return common_pb2.AbortResponse(found=found)

    async def Generate(self, request: worker_pb2.GenerateLocalRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[worker_pb2.GenerateLocalEvent]:
        """Conditional disaggregation: prefill the prompt here, in the mixed steps, and decode it."""
        async with contextlib.aclosing(generate_local(self.aengine, self.state, request, context)) as events:
            async for event in events:
                yield event

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        rid = request.request_id
        kv = self.aengine.connector
        t0 = time.perf_counter()
        wait_s = request.kv_wait_ms / 1e3 if request.kv_wait_ms else kv.max_lease_s
        state = await self.aengine.wait_kv(rid, wait_s)
        if state is not HandoffState.READY:
            failure = kv.failure(rid)
            if failure is not None:
                await context.abort(status_code(failure.code), f"KV of {rid!r}: {failure.message}")
            if state is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation for request {rid!r}")
            self.aengine.abort(rid)   # still incomplete after kv_wait: give the blocks back
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"KV of {rid!r} incomplete after waiting {wait_s:g}s")
        kv_wait_ms = (time.perf_counter() - t0) * 1e3
        try:
            stream, reason = self.aengine.admit(rid, request.first_token_id)
        except HandoffError as exc:
            await context.abort(status_code(exc.code), str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self.state.track():
            async with stream:
                if reason is not None:
                    yield worker_pb2.DecodeEvent(finished=True, finish_reason=reason, kv_wait_ms=kv_wait_ms)
                    return
                t_admit, first = time.perf_counter(), True
                while True:
                    out = (await stream.get()).output
                    event = decode_event_proto(out)
                    if first:
                        event.kv_wait_ms = kv_wait_ms
                        event.first_decode_step_ms = (time.perf_counter() - t_admit) * 1e3
                        first = False
                    yield event
                    if out.finished:
                        return
