"""Background asyncio tasks of the services' long-lived helpers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from pdserve import logs

log = logs.get("pdserve.runtime.tasks")


async def cancel_and_wait(task: asyncio.Task | None, timeout_s: float = 5.0) -> None:
    """Cancel a background loop and wait until it has ended, so nothing it does lands after;
    bounded, like every wait: a loop that will not end is left behind, and said so."""
    if task is None:
        return
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=timeout_s)
    if not done:
        log.warning("a background task did not end when cancelled",
                                                  task=task.get_name(), waited_s=timeout_s)
        return
    if not task.cancelled():
        task.exception()  # retrieved: a failure was the task's own to report; stopping it is all asked here


class Backoff:
    """How long a background loop waits after a failure it did not expect, before it tries again
    (it logs the failure and carries on: a helper whose task ended would leave its service running
    without it, unnoticed): doubling from `first_s` up to `max_s`, and back to `first_s` once a try
    succeeds."""

    def __init__(self, first_s: float = 0.5, max_s: float = 5.0):
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s

    def failed(self) -> float:
        """The wait before the next try (each one longer, up to `max_s`)."""
        wait_s, self._next_s = self._next_s, min(self._next_s * 2, self.max_s)
        return wait_s

    def succeeded(self) -> None:
        self._next_s = self.first_s


async def to_thread_to_end(fn: Callable, *args):
    """`fn(*args)` in a thread, awaited to its end even when the caller is cancelled (the
    cancellation is raised once it has ended). For work no one can stop midway that uses the
    caller's memory (a transfer landing bytes, a copy into KV pages): the caller must not hand
    that memory on while it may still be written."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([work])
        work.exception()  # (retrieved: the caller was cancelled, the work's own failure is moot)
        raise


async def bounded_close(client, timeout_s: float = 2.0) -> None:
    """Close a client (a Redis connection pool, a channel) without waiting on a dead peer forever."""
    try:
        await asyncio.wait_for(client.aclose(), timeout_s)
    except (TimeoutError, OSError):
        pass


async def measure_loop_lag(observe: Callable[[float], None], period_s: float = 0.02) -> None:
    """Until cancelled: how late this event loop wakes a sleep of `period_s`, in ms, to `observe`,
    i.e. how long any ready callback (a new request's handler among them) waits for the loop."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period_s)
        observe((loop.time() - t - period_s) * 1e3)
