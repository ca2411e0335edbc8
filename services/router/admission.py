"""The router's admission queue: requests wait here for decode capacity, highest priority first,
and within a priority, in fair shares between clients.

Only the request at the head of the queue looks for capacity, and only when a worker's status
changes (the pool's status streams wake it); the others wait on an event. Waiting therefore
costs no CPU and sends no RPCs, and a waiter holds no decode slot and no KV: only its request.
The bound is a count (``max_queued_requests``): a full queue refuses at once with a retry hint,
naming the limit, unless the newcomer outranks the lowest waiter, which is then refused in its
place. A wait has no deadline of its own unless the caller gives one (``queue_timeout_s``, the
client's deadline); a waiter whose client goes away is cancelled and leaves no hole.

A request that moves (a migration after a worker fault or an eviction) was admitted once: it
waits ahead of its class's newcomers, is never refused by a full queue (nor pushed out by a
higher class), and does not count towards the queue's bound.

A head that no worker takes for a reason of its own (a TPOT target only an emptier worker keeps)
steps aside (``Turn.step_aside``) until the workers' state changes: the next waiter is the head
meanwhile, so one request cannot hold up every request behind it. It keeps its place in the
order and counts towards the bound while aside.

Per-class state (virtual time, clients' tags) is dropped when a class has nobody waiting, so it
is bounded by the requests queued, however many distinct priorities arrive.

Order (``Ticket``): priority first (lower values first, as vLLM's ``priority``), then a fair tag
inside the priority class, then arrival. The tag is start-time fair queuing over the class's
clients: a client's next request is tagged one past the later of its own last tag and the class's
virtual time (the tag of the last request admitted), so two clients that keep the class busy are
served one for one whatever their sending rates, and a client that was idle starts at the
current virtual time (no credit saved up).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from pdserve.services.router.errors import RouterError

RATE_WINDOW_S = 30.0
MAX_CLIENT_TAGS = 4096   # clients remembered per class before the stale ones are dropped


@dataclass(frozen=True, slots=True)
class Ticket:
    """Who waits, and in which class: the admission queue's view of a request."""

    priority: int = 0     # lower first
    client: str = ""      # the fair-share key inside a priority class (OpenAI `user`)
    moved: bool = False   # a request placed before, moving after a fault or an eviction: it goes
                          # ahead of its class's newcomers, and a full queue never refuses it


@dataclass(order=True, slots=True)
class _Waiter:
    priority: int
    tag: int
    seq: int
    event: asyncio.Event = field(compare=False)
    ticket: Ticket = field(compare=False)
    evicted: bool = field(default=False, compare=False)
    gone: bool = field(default=False, compare=False)
    held: bool = field(default=False, compare=False)   # counted in the queue: waiting or aside, not gone


class AdmissionQueue:
    def __init__(self, max_waiting: int, rate_window_s: float = RATE_WINDOW_S) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.rate_window_s = rate_window_s
        self._waiting: list[_Waiter] = []    # a heap: the next head first
        self._head: _Waiter | None = None    # the one placing itself now
        self._seq = itertools.count()
        self._aside: list[_Waiter] = []         # heads that stepped aside until the workers change
        self._vtime: dict[int, int] = collections.defaultdict(int)          # class -> tag of its last head
        self._last_tag: dict[int, dict[str, int]] = collections.defaultdict(dict)   # class -> client -> tag
        self._in_class: collections.Counter[int] = collections.Counter()   # class -> its requests in the queue
        self._admitted: collections.deque[float] = collections.deque()   # recent admission times
        # Counts kept as waiters come and go (a burst of thousands costs O(1) each, not a scan):
        self._held = 0       # waiting or aside (the heap keeps gone ones until they surface: not counted)
        self._held_new = 0   # those of them that are newcomers (not moving): what max_waiting bounds

    def __len__(self) -> int:
        """Requests in the queue, the head and those aside included."""
        return self._held + (self._head is not None)

    def ahead_of(self, ticket: Ticket) -> int:
        """Requests that would be served before a newcomer with ticket (the head included)."""
        tag = self._tag(ticket, commit=False)
        return (self._head is not None) + sum(1 for w in self._waiting
                                              if not w.gone and (w.priority, w.tag) <= (ticket.priority, tag))

    def _hold(self, w: _Waiter, held: bool) -> None:
        """w is waiting or aside (held), or not (the head, or gone): keep the counts."""
        if w.held != held:
            step = 1 if held else -1
            self._held += step
            self._held_new += 0 if w.ticket.moved else step
            w.held = held

    # ---- rates ------------------------------------------------------------------------------
    def _prune(self, now: float) -> None:
        while self._admitted and now - self._admitted[0] > self.rate_window_s:
            self._admitted.popleft()

    def admission_rate(self) -> float:
        """Requests admitted per second over the recent window (0: none)."""
        self._prune(time.monotonic())
        return len(self._admitted) / self.rate_window_s

    def retry_after_s(self, ahead: int | None = None) -> float:
        """How long a refused caller should wait: the requests ahead over the recent admission rate."""
        rate = self.admission_rate()
        ahead = len(self) if ahead is None else ahead
        return min(60.0, max(1.0, ahead / rate if rate else 5.0))

    def full_error(self) -> RouterError:
        return RouterError("RESOURCE_EXHAUSTED", f"admission queue is full: {self.max_waiting} requests wait for "
                           f"decode capacity ({self.limit_text}); retry later", retry_after_s=self.retry_after_s())

    @property
    def limit_text(self) -> str:
        return f"max_queued_requests={self.max_waiting}, set by --max-queued-requests"

    # ---- order ------------------------------------------------------------------------------
    def _tag(self, ticket: Ticket, commit: bool = True) -> int:
        if ticket.moved:
            return 0   # before every newcomer's tag (each is past the class's virtual time, >= 0)
        tags = self._last_tag.get(ticket.priority, {})   # a look-up creates no class state
        tag = max(self._vtime.get(ticket.priority, 0), tags.get(ticket.client, 0)) + 1
        if commit:
            tags = self._last_tag[ticket.priority]
            tags[ticket.client] = tag
            if len(tags) > MAX_CLIENT_TAGS:   # clients at or behind the virtual time carry no credit: forget them
                vtime = self._vtime[ticket.priority]
                for client in [c for c, t in tags.items() if t <= vtime]:
                    del tags[client]
        return tag

    def _promote(self) -> None:
        """The next waiter becomes the head (if none is)."""
        while self._head is None and self._waiting:
            w = heapq.heappop(self._waiting)
            if w.gone:
                continue
            self._hold(w, False)
            self._head = w
            self._vtime[w.priority] = max(self._vtime[w.priority], w.tag)
            w.event.set()

    def _evict_lowest(self, ticket: Ticket) -> bool:
        """Make room for ticket by refusing the lowest waiter of a lower class (True if one was)."""
        if max(self._in_class, default=ticket.priority) <= ticket.priority:
            return False   # no lower class in the queue: nobody to refuse (and no scan of it)
        live = [w for w in self._waiting if not w.gone and not w.ticket.moved]
        if not live:
            return False
        worst = max(live, key=lambda w: (w.priority, w.tag, w.seq))
        if worst.priority <= ticket.priority:
            return False
        worst.evicted, worst.gone = True, True
        self._hold(worst, False)
        worst.event.set()
        return True

    def _live(self) -> int:
        """Newcomers held now (towards max_waiting): waiting, or aside."""
        return self._held_new

    @contextlib.asynccontextmanager
    async def turn(self, timeout: float | None, ticket: Ticket = Ticket(), bound: str = "") -> AsyncIterator["Turn"]:
        """Wait (up to timeout; None or inf: no limit) to be the head of the queue; the block runs
        as the head. bound: what set the timeout, for the error. RouterError RESOURCE_EXHAUSTED
        when the queue is full, when the wait times out, or when a request of a higher class took
        this one's place. A caller cancelled while it waits (its client went away) leaves the queue."""
        if (not ticket.moved and self._live() >= self.max_waiting and self._head is not None
                and not self._evict_lowest(ticket)):
            raise self.full_error()
        me = _Waiter(ticket.priority, self._tag(ticket), next(self._seq), asyncio.Event(), ticket)
        self._in_class[ticket.priority] += 1
        heapq.heappush(self._waiting, me)
        self._hold(me, True)
        self._promote()
        turn = Turn(self, me, timeout, bound)
        try:
            await turn.wait()
            yield turn
            now = time.monotonic()
            self._prune(now)   # at every admission: the record holds the last window, never more
            self._admitted.append(now)
        finally:
            me.gone = True
            self._hold(me, False)
            if me in self._aside:
                self._aside.remove(me)
            self._in_class[me.priority] -= 1
            if not self._in_class[me.priority]:   # nobody of this class left: forget its state
                for state in (self._in_class, self._vtime, self._last_tag):
                    state.pop(me.priority, None)
            if self._head is me:
                self._head = None
                self._promote()


class Turn:
    """A request's place in the admission queue while it is (or waits to be) the head."""

    def __init__(self, queue: AdmissionQueue, me: _Waiter, timeout: float | None, bound: str = "") -> None:
        self.queue, self.me, self.bound = queue, me, bound
        self.timeout = math.inf if timeout is None else timeout
        self.deadline = time.monotonic() + self.timeout   # inf: none

    def remaining(self) -> float | None:
        """Seconds left until the deadline (at least 0); None: no deadline."""
        return None if self.deadline == math.inf else max(0.0, self.deadline - time.monotonic())

    async def wait(self) -> None:
        """Until this request is the head; RouterError when the deadline passes or it was evicted."""
        queue, me = self.queue, self.me
        try:
            await asyncio.wait_for(me.event.wait(), self.remaining())
        except asyncio.TimeoutError:
            why = f"{self.bound}; " if self.bound else ""
            raise RouterError("RESOURCE_EXHAUSTED", f"no decode capacity within {self.timeout:.3g}s "
                              f"({why}{queue.ahead_of(me.ticket)} requests ahead)",
                              retry_after_s=queue.retry_after_s()) from None
        if me.evicted:
            raise RouterError("RESOURCE_EXHAUSTED", f"admission queue is full ({queue.limit_text}) and a request "
                              f"of a higher priority took this one's place; retry later",
                              retry_after_s=queue.retry_after_s())

    async def step_aside(self, changed: Callable[[float | None], Awaitable[object]]) -> None:
        """The head lets the next waiter be the head until changed(timeout) returns (the workers'
        state changed, or the deadline passed), then waits for its turn again, in its old place."""
        queue, me = self.queue, self.me
        if queue._head is me:
            queue._head = None
            me.event.clear()
            queue._aside.append(me)
            queue._hold(me, True)
            queue._promote()
        try:
            await changed(self.remaining())
        finally:
            if me in queue._aside:
                queue._aside.remove(me)
        if not me.gone:
            heapq.heappush(queue._waiting, me)
            queue._promote()
        await self.wait()


class PendingGate:
    """Requests between arrival and the admission queue (body being read, parsed, tokenized),
    over every front door together. Past the cap one more is refused at once, so a flood of
    requests (or of slow bodies) holds a bounded amount of memory and tokenizer work."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {limit}")
        self.limit = limit
        self.count = 0

    @contextlib.contextmanager
    def hold(self):
        if self.count >= self.limit:
            raise RouterError("RESOURCE_EXHAUSTED", f"{self.count} requests are being received and tokenized "
                              f"(max_pending_requests={self.limit}); retry later", retry_after_s=1.0)
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
