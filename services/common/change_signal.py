"""A wake-up for waiters on "something changed" (a worker's status, the pool's health): every
waiter wakes at the next change or its timeout. Waiting costs no CPU; a change with nobody
waiting is not remembered (a waiter re-reads the state it waits on)."""
from __future__ import annotations

import asyncio


class ChangeSignal:
    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        """Wake every waiter (call on the event loop)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, timeout: float | None = None) -> None:
        """Until the next notify, or timeout."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
