"""The router's admission queue: requests wait here while no decode worker has room.

A request that finds no room waits, bounded in number and in time, and is woken when one of
this router's requests ends (or looks again every QUEUE_POLL_S: room another router freed
shows in the next heartbeat). A full queue is refused at once; so is a wait that ran out. Both
refusals say when to retry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdserve.errors import ResourceExhausted, Unavailable

T = TypeVar("T")
QUEUE_POLL_S = 0.05


class NoRoom(ResourceExhausted):
    """No decode worker has room now (a request may queue for it)."""


class NoWorkers(NoRoom):
    """No decode worker is healthy at all: waited out like no room, then refused UNAVAILABLE."""


def _refused(e: NoRoom, message: str) -> Exception:
    return (Unavailable if isinstance(e, NoWorkers) else ResourceExhausted)(message)


class AdmissionQueue:
    """Owns the count of queued requests and the event that wakes them."""

    def __init__(self, max_queued: int, timeout_s: float, metrics) -> None:
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.queued = 0
        self._freed = asyncio.Event()  # set, and replaced, each time one of ours ends

    async def admit(self, attempt: Callable[[], Awaitable[T]], deadline: float) -> T:
        """`attempt()`'s result, trying again as room frees while it raises NoRoom."""
        try:
            return await attempt()
        except NoRoom as e:
            if self.queued >= self.max_queued:
                self.metrics.count("refused_queue_full")
                raise _refused(e, f"{e}, and {self.queued} requests are already queued for room: retry in "
                                  f"about {self.timeout_s * 1000:.0f} ms") from None
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
                    return await attempt()
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
