"""gRPC server bootstrap shared by every process: health, reflection, message limits."""
from __future__ import annotations

import asyncio
import signal
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


async def start_server(registrations: Iterable[tuple[Callable, object, str]], host: str, port: int
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """registrations: (add_XServicer_to_server, servicer, full service name). Returns the
    started server, its bound port, and the health servicer (already SERVING)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    names = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set stop (where the loop supports signal handlers)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
