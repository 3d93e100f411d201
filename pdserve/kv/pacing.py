"""When to look at a transfer again: the sleeps between a transfer's status polls.

A transfer is polled, sleeping between looks (the engine's own sync calls spin a core for the
whole move). A move of 1 MiB or more is paced by how fast such moves to that peer in that
direction went lately: one sleep to 80% of its expected time, then looks from 30 µs apart, each
gap half as long again as the last (to 200 µs), so its end is seen within tens of µs rather
than up to 200 µs after, and the poller wakes less (measured: a 4 MiB write looked at 5-6 times
instead of 9-11, a 16 MiB one 12 times instead of 30; the moves' times in A/B runs were within
this host's noise, ±10%). Without history, looks double from 20 µs to 200 µs apart.

Sleeps this short need a fine timer: a thread's timer slack (50 µs by default on Linux) is
added to each of its sleeps, so the threads that poll set theirs to 1 µs.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Iterator

FIRST_S, MAX_S = 20e-6, 2e-4  # without history: 20 µs, then twice as long each time, at most 200 µs
FINE_S = 30e-6  # looks near the expected end
PACED_BYTES = 1 << 20  # moves this large or larger are paced by their expected time
_PR_SET_TIMERSLACK = 29
_fine = threading.local()


def fine_timer_slack() -> None:
    """Timer slack of 1 µs for this thread's sleeps (Linux; elsewhere nothing changes)."""
    if getattr(_fine, "done", False):
        return
    _fine.done = True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: sleeps keep their platform's precision


class Pace:
    """Owns the recent rates of moves of one kind (a peer, a direction) of at least 1 MiB: a
    smaller move's time is mostly its fixed cost, not its size."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=8)

    def sleeps(self, nbytes: int, start: float) -> Iterator[float]:
        """The sleeps between looks at a move of `nbytes` that began at `start` (perf_counter).
        Its expected time is at the fastest recent rate: a sleep that ends before the move does
        costs a look; one that ends after it costs the move's latency."""
        expected = nbytes / max(self._rates) if self._rates and nbytes >= PACED_BYTES else 0.0
        delay = FIRST_S
        if expected > 4 * FINE_S:
            yield max(0.0, start + 0.8 * expected - time.perf_counter())
            delay = FINE_S
        while True:  # (near the expected end, looks 30 µs apart, then half as often again each time)
            yield delay
            delay = min(delay * (1.5 if expected else 2), MAX_S)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A move of `nbytes` took `seconds` (as seen: its end may have been seen late)."""
        if nbytes >= PACED_BYTES and seconds > 0:
            self._rates.append(nbytes / seconds)
