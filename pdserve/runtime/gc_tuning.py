"""Python's cyclic garbage collector, tuned for long-lived processes holding many objects.

With the defaults (a young collection every 700 net allocations, a full one as the survivors
grow by a quarter), a full collection walks every object the process holds: the store's block
records, the router's tokenizer and index mirror, a worker's model, engine and running
sequences. It stops the whole process meanwhile, so under load it becomes the tail of every
stream there (docs/perf-log.md has the pauses measured). Here: everything alive at startup is
frozen out of every collection, young collections run every 100,000 net allocations, and older
ones ten times rarer each, so full collections are rare and short; each collection that pauses
the process for long is logged, so an operator sees it. Every service, and the bench's load
generator, run with it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from pdserve import logs

log = logs.get("gc")

YOUNG_EVERY = 100_000  # net allocations between young collections (CPython's default: 700)
OLDER_EVERY = 10  # collections of one generation between those of the next (default: 10)
SLOW_MS = 20.0  # a collection at least this long is logged


class PauseWatch:
    """A gc callback that logs each collection that pauses the process for `slow_ms` or more."""

    def __init__(self, slow_ms: float = SLOW_MS, clock: Callable[[], float] = time.perf_counter):
        self.slow_ms = slow_ms
        self.clock = clock
        self._started = 0.0
        self.slow = 0  # collections logged so far

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        ms = (self.clock() - self._started) * 1e3
        if ms >= self.slow_ms:
            self.slow += 1
            log.warning("slow garbage collection", generation=info["generation"], ms=round(ms, 1),
                        collected=info["collected"])


def tune(slow_ms: float = SLOW_MS) -> PauseWatch:
    """Call once the process has built its long-lived state, before it serves; a second call
    changes nothing and returns the first one's watch."""
    installed = next((cb for cb in gc.callbacks if isinstance(cb, PauseWatch)), None)
    if installed is not None:
        return installed
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_EVERY, OLDER_EVERY, OLDER_EVERY)
    watch = PauseWatch(slow_ms)
    gc.callbacks.append(watch)
    return watch
