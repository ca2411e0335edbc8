"""Colocated ("both") role: prefill and decode in one engine, no KV transfer. The baseline."""
from __future__ import annotations

from typing import AsyncIterator

import grpc

from pdserve.v1 import worker_pb2
from services.async_engine import AsyncEngine
from services.convert import params_from_proto


class ColocatedHandler:
    def __init__(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine

    async def generate(self, request: worker_pb2.GenerateLocalRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[worker_pb2.GenerateLocalEvent]:
        rid = request.request_id
        try:
            stream = await self.aengine.add_request(rid, list(request.prompt_token_ids), params_from_proto(request.params))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finished = False
        try:
            first = True
            while True:
                out = (await stream.get()).output
                if out.finish_reason == "abort":
                    finished = True
                    yield worker_pb2.GenerateLocalEvent(decode=worker_pb2.DecodeEvent(finished=True, finish_reason="abort"))
                    return
                if first:
                    first = False
                    done = worker_pb2.PrefillDone(first_token_id=out.new_token_ids[0],
                                                  num_cached_tokens=out.num_cached_tokens,
                                                  queue_ms=(out.queue_s or 0.0) * 1e3,
                                                  prefill_ms=(out.prefill_s or 0.0) * 1e3)
                    if out.finish_reason is not None:
                        done.finish_reason = out.finish_reason
                    yield worker_pb2.GenerateLocalEvent(prefill_done=done)
                    if not out.finished:
                        continue
                    event = worker_pb2.DecodeEvent(finished=True, finish_reason=out.finish_reason)
                else:
                    event = worker_pb2.DecodeEvent(token_ids=out.new_token_ids, finished=out.finished)
                    if out.finish_reason is not None:
                        event.finish_reason = out.finish_reason
                finished = out.finished
                yield worker_pb2.GenerateLocalEvent(decode=event)
                if finished:
                    return
        finally:
            self.aengine.close_stream(rid)
            if not finished:
                await self.aengine.call(lambda e: e.abort(rid))
