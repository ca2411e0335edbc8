"""The router clients wait for a connection before a call: a router that comes up (or back) within
the connect timeout serves the call; one that does not fails it with UNAVAILABLE, named."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest

from pdserve.v1 import router_pb2, router_pb2_grpc
from pdserve.services.client import AsyncClient, Client
from pdserve.services.deployment.launcher import free_port


class _ModelInfoOnly(router_pb2_grpc.RouterServicer):
    """The one call these tests make; the client is under test, not the router."""

    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model_name="late-router")


def _serve_after(address: str, delay_s: float) -> tuple[threading.Thread, list[grpc.Server]]:
    servers: list[grpc.Server] = []

    def run() -> None:
        time.sleep(delay_s)   # kept: a router that comes up late is what is tested
        server = grpc.server(futures.ThreadPoolExecutor(2))
        router_pb2_grpc.add_RouterServicer_to_server(_ModelInfoOnly(), server)
        server.add_insecure_port(address)
        server.start()
        servers.append(server)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, servers


def test_a_call_waits_for_a_router_that_comes_up_within_the_connect_timeout() -> None:
    address = f"127.0.0.1:{free_port()}"
    with Client(address, timeout=30, connect_timeout=20) as client:
        # a bare (fail-fast) call fails at once, and leaves the channel in reconnect backoff
        with pytest.raises(grpc.RpcError) as bare:
            client.stub.GetModelInfo(router_pb2.ModelInfoRequest(), timeout=5)
        assert bare.value.code() == grpc.StatusCode.UNAVAILABLE
        thread, servers = _serve_after(address, 1.0)
        try:
            assert client.model_info().model_name == "late-router"
        finally:
            thread.join()
            for server in servers:
                server.stop(None)


def test_async_client_waits_for_the_router_too() -> None:
    address = f"127.0.0.1:{free_port()}"
    thread, servers = _serve_after(address, 1.0)

    async def main() -> str:
        client = AsyncClient(address, timeout=30, connect_timeout=20)
        try:
            return (await client.model_info()).model_name
        finally:
            await client.close()

    try:
        assert asyncio.run(main()) == "late-router"
    finally:
        thread.join()
        for server in servers:
            server.stop(None)


def test_no_router_within_the_connect_timeout_is_unavailable_and_named() -> None:
    address = f"127.0.0.1:{free_port()}"   # nothing listens there
    with Client(address, connect_timeout=0.5) as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert time.monotonic() - t0 < 10
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == f"no connection to the router at {address} within 0.5s"

    async def main() -> None:
        client = AsyncClient(address, connect_timeout=0.5)
        try:
            await client.model_info()
        finally:
            await client.close()

    with pytest.raises(grpc.aio.AioRpcError) as aerr:
        asyncio.run(main())
    assert aerr.value.code() == grpc.StatusCode.UNAVAILABLE
    assert aerr.value.details() == f"no connection to the router at {address} within 0.5s"
