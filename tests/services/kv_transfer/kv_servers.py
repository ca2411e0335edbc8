"""What the KV transport tests share: a real gRPC KV receiver on loopback feeding an engine's
connector, raw frame pushes to it (what a hostile or broken sender would write), and an
already-resolved stand-in for a Ray object reference."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import grpc

from pdserve.engine import LLMEngine
from pdserve.v1 import kv_pb2
from pdserve.services.kv_transfer import KVTransferServicer
from pdserve.services.kv_transfer.grpc_transport import METHOD
from pdserve.services.kv_transfer.grpc_receiver import register_kv_servicer


@asynccontextmanager
async def on_loopback(server: grpc.aio.Server) -> AsyncIterator[str]:
    """Start server on an ephemeral 127.0.0.1 port; yields its address, stops it after."""
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@asynccontextmanager
async def kv_receiver(engine: LLMEngine, cluster_token: str | None = None, shm: bool = False,
                      options: Sequence[tuple[str, object]] = (("grpc.so_reuseport", 0),)) -> AsyncIterator[str]:
    """A real gRPC KV receiver feeding engine's connector; yields its address."""
    server = grpc.aio.server(options=list(options))
    register_kv_servicer(KVTransferServicer(engine.kv, shared_memory=shm, cluster_token=cluster_token), server)
    async with on_loopback(server) as address:
        yield address


def raw_push(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryCall:
    """A PushBlocks call that writes serialized KVFrames as given (bytes, not messages)."""
    return channel.stream_unary(METHOD, request_serializer=lambda b: b,
                                response_deserializer=kv_pb2.PushAck.FromString)()


async def refusal_of(target: str, frames: Sequence[bytes]) -> grpc.aio.AioRpcError:
    """Push frames to the receiver at target and return the error it ends the call with
    (AssertionError if it accepts them)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = raw_push(channel)
        for frame in frames:
            await call.write(frame)
        await call.done_writing()
        try:
            ack = await call
        except grpc.aio.AioRpcError as err:
            return err
    raise AssertionError(f"the receiver accepted the frames: {ack}")


class Resolved:
    """An already-resolved object reference (what ray.put returns, awaited by the receiver)."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        yield from ()
        return self.value
