"""The router's admission queue: requests wait here while no decode worker has room.

A request that finds no room waits, bounded in number and in time, and is woken when one of
this router's requests ends (or looks again every QUEUE_POLL_S: room another router freed
shows in the next heartbeat). A full queue is refused at once; so is a wait that ran out. Both
refusals say when to retry. So is a request that could only wait longer than it may (its TTFT
SLO's budget, or the queue timeout): the queue ahead of it over the rate at which queued
requests got room lately (Little's law) says how long it would wait, so it is told at once
rather than after waiting to be refused.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdserve.errors import ResourceExhausted, Unavailable

T = TypeVar("T")
QUEUE_POLL_S = 0.05


class NoRoom(ResourceExhausted):
    """No decode worker has room now (a request may queue for it). `budget_s`: how much longer
    the request may wait before its TTFT estimate plus its wait would pass the router's SLO."""

    budget_s: float = math.inf


class NoWorkers(NoRoom):
    """No decode worker is healthy at all: waited out like no room, then refused UNAVAILABLE."""


def _refused(e: NoRoom, message: str) -> Exception:
    return (Unavailable if isinstance(e, NoWorkers) else ResourceExhausted)(message)


class AdmissionQueue:
    """Owns the count of queued requests, when each got room lately, and the event that wakes them."""

    def __init__(self, max_queued: int, timeout_s: float, metrics) -> None:
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.queued = 0
        self._freed = asyncio.Event()  # set, and replaced, each time one of ours ends
        self._admitted: deque[float] = deque()  # when queued requests got room, over the last timeout_s

    def expected_wait_s(self) -> float:
        """How long one more queued request would wait: the requests ahead of it over the rate
        at which queued requests got room in the last `timeout_s`; 0 (no wait known) when none did."""
        now = time.monotonic()
        while self._admitted and self._admitted[0] < now - self.timeout_s:
            self._admitted.popleft()
        if not self._admitted:
            return 0.0
        rate = len(self._admitted) / max(now - self._admitted[0], QUEUE_POLL_S)
        return (self.queued + 1) / rate

    async def admit(self, attempt: Callable[[], Awaitable[T]], deadline: float) -> T:
        """`attempt()`'s result, trying again as room frees while it raises NoRoom."""
        try:
            return await attempt()
        except NoRoom as e:
            if self.queued >= self.max_queued:
                self.metrics.count("refused_queue_full")
                raise _refused(e, f"{e}, and {self.queued} requests are already queued for room: retry in "
                                  f"about {self.timeout_s * 1000:.0f} ms") from None
            wait_s, limit_s = self.expected_wait_s(), min(e.budget_s, self.timeout_s)
            if wait_s > limit_s:
                self.metrics.count("refused_expected_wait")
                may = "its TTFT SLO leaves" if e.budget_s < self.timeout_s else "the queue timeout allows"
                raise _refused(e, f"{e}, and behind the {self.queued} requests queued for room it would wait "
                                  f"about {wait_s * 1000:.0f} ms, longer than the {limit_s * 1000:.0f} ms {may}: "
                                  f"retry in about {wait_s * 1000:.0f} ms") from None
        self.queued += 1
        give_up = min(deadline, time.monotonic() + self.timeout_s)
        try:
            while True:
                freed = self._freed
                try:
                    await asyncio.wait_for(freed.wait(), max(0.0, min(QUEUE_POLL_S, give_up - time.monotonic())))
                except TimeoutError:
                    pass
                try:
                    admitted = await attempt()
                    self._admitted.append(time.monotonic())
                    return admitted
                except NoRoom as e:
                    if time.monotonic() >= give_up:
                        self.metrics.count("refused_queue_timeout")
                        raise _refused(e, f"{e} after {self.timeout_s:g} s in the admission queue: retry in "
                                          "about a second") from None
        finally:
            self.queued -= 1

    def room_freed(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()
