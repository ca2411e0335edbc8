"""Streaming and cancellation for the router's HTTP API: a request whose client disconnects is
cancelled at once (its cleanup aborts the generation on every worker), and server-sent events
(framed by sse_event) from an async iterator that is cancelled the moment the connection goes."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response


SSE_DONE = b"data: [DONE]\n\n"   # OpenAI's end of a stream


def sse_event(payload: dict) -> bytes:
    """One server-sent event: compact JSON on one data line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ClientGone(Exception):
    """The client disconnected; its work was cancelled."""


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await awaitable, cancelling it if the client disconnects meanwhile (then ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel_all([task, watcher])
        raise
    if task.done():
        await cancel_all([watcher])
        return task.result()
    await cancel_all([task])
    raise ClientGone()


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(coros: list[Awaitable]) -> list[Any]:
    """All results; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await cancel_all([t for t in tasks if not t.done()])


class SSEResponse(Response):
    """text/event-stream from an async iterator of bytes. The iterator runs as a task next to a
    watch on the connection: when the client disconnects, the task is cancelled at once (its
    cleanup aborts the requests), even while no event is due."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:   # no body, so no Content-Length
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            async with contextlib.aclosing(self.events) as events:
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        body = asyncio.create_task(pump())
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_all([body, watcher])   # a finished task stays as it is
        if not body.cancelled() and body.exception() is not None:
            if not isinstance(body.exception(), OSError):   # a write to a closed connection is a disconnect
                raise body.exception()
