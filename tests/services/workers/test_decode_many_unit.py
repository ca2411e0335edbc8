"""DecodeHandler.DecodeMany in process: a caller that starts requests without reading their
events stops being read once MAX_PENDING_EVENTS wait to be written (its memory is bounded), and is
read again as it reads; every request still gets its own answer."""
from __future__ import annotations

import asyncio

import grpc

from pdserve.engine import EngineConfig
from pdserve.services.workers import decode
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.workers.decode import DecodeHandler
from pdserve.services.workers.lifecycle import WorkerState
from pdserve.v1 import worker_pb2

STARTS = 200


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code.name}: {details}")


def test_a_caller_that_does_not_read_stops_being_read_and_every_request_is_answered(tiny_qwen3: str,
                                                                                   monkeypatch) -> None:
    monkeypatch.setattr(decode, "MAX_PENDING_EVENTS", 8)
    consumed = 0

    async def controls():
        nonlocal consumed
        yield worker_pb2.DecodeControl()
        for i in range(STARTS):   # requests with no reservation: each ends at once, NOT_FOUND
            consumed += 1
            yield worker_pb2.DecodeControl(start=worker_pb2.DecodeRequest(request_id=f"ghost-{i}"))

    async def main() -> None:
        aengine = AsyncEngine(EngineConfig(model=tiny_qwen3, role="decode", dtype="float32", block_size=8,
                                           num_kv_blocks=16, max_model_len=128))
        aengine.start()
        try:
            batches = DecodeHandler(aengine, WorkerState("decode")).DecodeMany(controls(), Context())
            events = list((await batches.__anext__()).events)
            await asyncio.sleep(0.5)   # the caller stops reading
            assert consumed <= 8 + 2, consumed   # the pending events' bound, and the one read before it waits
            async for batch in batches:
                events += batch.events
            assert consumed == STARTS
            assert sorted(e.request_id for e in events) == sorted(f"ghost-{i}" for i in range(STARTS))
            assert {(e.error_code, e.finished) for e in events} == {(grpc.StatusCode.NOT_FOUND.value[0], True)}
        finally:
            aengine.stop()
    asyncio.run(main())
