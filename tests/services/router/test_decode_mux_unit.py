"""The router's DecodeMux against small in-process gRPC servers on loopback: each request reads its
own events and its own status off the shared stream, a cancelled one is cancelled on it, and a
worker without DecodeMany (an older pdserve) is asked with a Decode call per request."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.services.router.decode_mux import DecodeMux
from pdserve.v1 import worker_pb2, worker_pb2_grpc

SERVICE = "pdserve.v1.DecodeWorker"


def _with_mux(handlers: dict, body) -> None:
    """body(mux) against a server on loopback answering the DecodeWorker methods in handlers."""
    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(DecodeMux(worker_pb2_grpc.DecodeWorkerStub(channel)))
        finally:
            await server.stop(0)
    asyncio.run(main())


def _events(rid: str) -> list[worker_pb2.DecodeEvent]:
    return [worker_pb2.DecodeEvent(request_id=rid, token_ids=[1, 2]),
            worker_pb2.DecodeEvent(request_id=rid, token_ids=[3], finished=True, finish_reason="length")]


async def _read_all(call) -> list[worker_pb2.DecodeEvent]:
    out = []
    while (event := await call.read()) is not grpc.aio.EOF:
        out.append(event)
        if event.finished:
            break
    return out


def test_each_request_gets_its_own_events_and_status_and_a_cancel_reaches_the_worker() -> None:
    cancelled: list[str] = []

    async def decode_many(requests, context):
        async for control in requests:
            kind = control.WhichOneof("kind")
            if kind == "cancel":
                cancelled.append(control.cancel)
            elif kind == "start" and control.start.request_id == "missing":
                yield worker_pb2.DecodeEvents(events=[worker_pb2.DecodeEvent(
                    request_id="missing", finished=True, error_code=grpc.StatusCode.NOT_FOUND.value[0],
                    error_message="no reservation for request 'missing'")])
            elif kind == "start" and control.start.request_id == "slow":
                yield worker_pb2.DecodeEvents(events=_events("slow")[:1])
            elif kind == "start":
                yield worker_pb2.DecodeEvents(events=_events(control.start.request_id))

    async def body(mux: DecodeMux) -> None:
        ok, missing = (mux.decode(worker_pb2.DecodeRequest(request_id=r)) for r in ("ok", "missing"))
        assert [list(e.token_ids) for e in await _read_all(ok)] == [[1, 2], [3]]
        assert await ok.read() is grpc.aio.EOF
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await missing.read()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'missing'" in err.value.details()
        slow = mux.decode(worker_pb2.DecodeRequest(request_id="slow"))
        assert list((await slow.read()).token_ids) == [1, 2]
        slow.cancel()   # the router stops reading it: the worker is told
        for _ in range(100):
            if cancelled:
                break
            await asyncio.sleep(0.01)
        assert cancelled == ["slow"]
        ok.cancel()   # finished: nothing to tell
        await asyncio.sleep(0.05)
        assert cancelled == ["slow"]

    _with_mux({"DecodeMany": grpc.stream_stream_rpc_method_handler(
        decode_many, request_deserializer=worker_pb2.DecodeControl.FromString,
        response_serializer=worker_pb2.DecodeEvents.SerializeToString)}, body)


def test_a_worker_without_decode_many_gets_a_decode_call_per_request() -> None:
    seen: list[str] = []

    async def decode(request, context):
        seen.append(request.request_id)
        for event in _events(request.request_id):
            event.ClearField("request_id")   # as Decode sends them
            yield event

    async def body(mux: DecodeMux) -> None:
        first = mux.decode(worker_pb2.DecodeRequest(request_id="a"))
        assert [list(e.token_ids) for e in await _read_all(first)] == [[1, 2], [3]]
        second = mux.decode(worker_pb2.DecodeRequest(request_id="b"))   # straight to Decode now
        assert [list(e.token_ids) for e in await _read_all(second)] == [[1, 2], [3]]
        first.cancel()
        second.cancel()
        assert seen == ["a", "b"]

    _with_mux({"Decode": grpc.unary_stream_rpc_method_handler(
        decode, request_deserializer=worker_pb2.DecodeRequest.FromString,
        response_serializer=worker_pb2.DecodeEvent.SerializeToString)}, body)


def _decode_handler(seen: list[str]):
    async def decode(request, context):
        seen.append(request.request_id)
        for event in _events(request.request_id):
            event.ClearField("request_id")
            yield event
    return grpc.unary_stream_rpc_method_handler(decode, request_deserializer=worker_pb2.DecodeRequest.FromString,
                                                response_serializer=worker_pb2.DecodeEvent.SerializeToString)


def _decode_many_handler(behaviour):
    return grpc.stream_stream_rpc_method_handler(behaviour, request_deserializer=worker_pb2.DecodeControl.FromString,
                                                 response_serializer=worker_pb2.DecodeEvents.SerializeToString)


def test_a_stream_failing_with_internal_before_any_batch_leaves_its_requests_to_decode_calls() -> None:
    """grpcio reports a worker's UNIMPLEMENTED as INTERNAL when a control was being written as it
    came: a stream that ends so before delivering anything hands its requests to Decode calls;
    one that ends so after a batch fails the requests still on it with that status."""
    seen: list[str] = []

    async def refuse_at_once(requests, context):
        async for control in requests:
            if control.WhichOneof("kind") == "start":
                await context.abort(grpc.StatusCode.INTERNAL, "as grpcio reports a lost status")
        yield worker_pb2.DecodeEvents()   # never reached

    async def body(mux: DecodeMux) -> None:
        call = mux.decode(worker_pb2.DecodeRequest(request_id="a"))
        assert [list(e.token_ids) for e in await _read_all(call)] == [[1, 2], [3]]
        call.cancel()
        assert seen == ["a"]

    _with_mux({"DecodeMany": _decode_many_handler(refuse_at_once), "Decode": _decode_handler(seen)}, body)

    async def fail_after_a_batch(requests, context):
        async for control in requests:
            if control.WhichOneof("kind") == "start" and control.start.request_id == "x":
                yield worker_pb2.DecodeEvents(events=_events("x"))
            elif control.WhichOneof("kind") == "start":
                await context.abort(grpc.StatusCode.INTERNAL, "a fault of the worker")

    async def after(mux: DecodeMux) -> None:
        x = mux.decode(worker_pb2.DecodeRequest(request_id="x"))
        assert [list(e.token_ids) for e in await _read_all(x)] == [[1, 2], [3]]
        y = mux.decode(worker_pb2.DecodeRequest(request_id="y"))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _read_all(y)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert seen == ["a"]   # no Decode call for y

    _with_mux({"DecodeMany": _decode_many_handler(fail_after_a_batch), "Decode": _decode_handler(seen)}, after)
