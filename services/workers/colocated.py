"""Colocated ("both") role: prefill and decode in one engine, no KV transfer. The baseline.

``generate_local`` also serves a decode worker's ``Generate`` (conditional disaggregation: the
router has it prefill a prompt itself, as chunks of its mixed steps)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.common.proto_convert import decode_event_proto, first_token_proto, params_from_proto
from pdserve.services.workers.prefill import HEARTBEAT_S
from pdserve.services.workers.lifecycle import WorkerState


class ColocatedHandler(worker_pb2_grpc.ColocatedWorkerServicer):
    def __init__(self, aengine: AsyncEngine, state: WorkerState) -> None:
        self.aengine = aengine
        self.state = state

    async def Generate(self, request: worker_pb2.GenerateLocalRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[worker_pb2.GenerateLocalEvent]:
        async with contextlib.aclosing(generate_local(self.aengine, self.state, request, context)) as events:
            async for event in events:
                yield event


async def generate_local(aengine: AsyncEngine, state: WorkerState, request: worker_pb2.GenerateLocalRequest,
                         context: grpc.aio.ServicerContext, heartbeat_s: float = HEARTBEAT_S
                         ) -> AsyncIterator[worker_pb2.GenerateLocalEvent]:
    """Prefill the prompt on this engine and decode it: Progress heartbeats while it waits for its
    first token (a long queue is not a fault: the router's stall watchdog sees them), one
    FirstToken, then DecodeEvents."""
    await state.refuse_if_draining(context)
    try:
        params = params_from_proto(request.params)
        await aengine.compile_grammar(params)
        stream = aengine.add(request.request_id, request.prompt_token_ids, params, request.output_token_ids)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    with state.track():
        async with stream:
            first = True
            while True:
                try:   # until the first token, say every heartbeat_s that the request is still here
                    out = (await stream.get(timeout=heartbeat_s if first else None)).output
                except asyncio.TimeoutError:   # queued behind others, or a long prefill
                    yield worker_pb2.GenerateLocalEvent(progress=worker_pb2.Progress())
                    continue
                if out.finish_reason == "abort":
                    event = worker_pb2.DecodeEvent(finished=True, finish_reason="abort")
                    yield worker_pb2.GenerateLocalEvent(decode=event)
                    return
                if first:
                    first = False
                    yield worker_pb2.GenerateLocalEvent(first_token=first_token_proto(out))
                    if out.finished:
                        return
                    continue
                event = decode_event_proto(out)
                yield worker_pb2.GenerateLocalEvent(decode=event)
                if out.finished:
                    return
