"""A worker's membership of a router (``--router ADDR``): join it, follow the member entry the
router keeps for this worker, and join again whenever the stream breaks, so a restarted router
gets its membership back. The router removing the worker (state REMOVED) ends it: the worker
does not join again until it is restarted or added back by an operator.

The Join call proves the cluster token like every internal call (the proof names the router's
address and this Join), and the router must prove it back before anything it says is read
(services/common/security.py). The cluster token lets a worker join itself only: the router refuses
(PERMISSION_DENIED) an address on another host than the one the call comes from, and every other
membership change wants its admin token, which workers never hold."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from pdserve.v1 import membership_pb2, membership_pb2_grpc
from pdserve.services.common.grpc_setup import options as channel_options
from pdserve.services.common.security import Credentials

log = logging.getLogger(__name__)

RETRY_S = 0.5          # the first re-join after a broken stream; doubled up to MAX_RETRY_S
MAX_RETRY_S = 5.0
SILENCE_S = 15.0       # a Join stream silent this long is broken (the router sends every 5 s)


async def keep_joined(router: str, request: Callable[[], membership_pb2.JoinRequest],
                      credentials: Credentials) -> None:
    """Hold the worker's membership of router until it removes the worker (or the task is
    cancelled, when the worker stops). request() is asked at each join: the role may have
    changed since the last (Worker.SetRole)."""
    channel = credentials.channel(router, channel_options())
    stub = membership_pb2_grpc.MembershipStub(channel)
    delay, state = RETRY_S, None
    try:
        while True:
            join = request()
            call = stub.Join(join)
            try:
                while True:
                    member = await asyncio.wait_for(call.read(), SILENCE_S)
                    if member is grpc.aio.EOF:
                        raise ConnectionError("the router ended the Join stream")
                    delay = RETRY_S
                    if member.state != state:
                        state = member.state
                        log.info("member of the router at %s as %s: %s", router, join.address,
                                 membership_pb2.MemberState.Name(state))
                    if state == membership_pb2.MEMBER_STATE_REMOVED:
                        log.warning("removed by the router at %s: not joining again", router)
                        return
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError) as exc:
                why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc) \
                    or "no member entry"
                level = logging.ERROR if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
                    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED) else logging.INFO
                log.log(level, "membership of the router at %s: %s; joining again in %.1fs", router, why, delay)
                state = None
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_S)
    finally:
        await channel.close()
