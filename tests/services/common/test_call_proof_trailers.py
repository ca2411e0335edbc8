"""A call that ends at once: its status counts only when its server proved membership, in the
initial metadata or, when grpcio's asyncio client recorded none, in the trailers."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.common.security import Credentials
from pdserve.services.common.proofs import AUTH_HEADER, AUTH_REPLY_HEADER
from pdserve.services.common.proof_interceptors import proving_interceptors

TOKEN = "a-cluster-token-for-this-test-only"
METHOD = "/grpc.health.v1.Health/Watch"


class _Refusing(health_pb2_grpc.HealthServicer):
    """Ends every Watch with DATA_LOSS and no initial metadata (trailers only), its proof of
    the caller's nonce in the trailers, or none."""

    def __init__(self, prove: bool) -> None:
        self.key = Credentials(TOKEN).key
        self.prove = prove

    async def Watch(self, request, context):
        proof = dict(context.invocation_metadata())[AUTH_HEADER]
        claim = self.key.check(METHOD, proof)
        assert claim is not None
        trailers = ((AUTH_REPLY_HEADER, self.key.reply(METHOD, claim.nonce)),) if self.prove else ()
        await context.abort(grpc.StatusCode.DATA_LOSS, "the block failed its check", trailing_metadata=trailers)
        yield  # pragma: no cover


async def _status_seen(prove: bool) -> tuple[grpc.StatusCode, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(_Refusing(prove), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=proving_interceptors(
                Credentials(TOKEN), f"127.0.0.1:{port}")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10):
                    pass
            return err.value.code(), err.value.details() or ""
    finally:
        await server.stop(None)


def test_a_status_vouched_for_in_the_trailers_is_reported() -> None:
    code, details = asyncio.run(_status_seen(prove=True))
    assert code == grpc.StatusCode.DATA_LOSS and "failed its check" in details


def test_a_status_without_any_proof_is_not_believed() -> None:
    code, details = asyncio.run(_status_seen(prove=False))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "did not prove it is a member" in details and "claimed DATA_LOSS" in details
