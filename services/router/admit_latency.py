"""How long a decode worker takes to admit a request, as this router times it.

A disaggregated request's prefill is sent once decode has admitted it, so that wait is part of
its TTFT, and the part that grows when what a decode worker runs out of is CPU rather than KV
blocks: at the pinned overload replay decode admission took 313-628 ms at p50 and 2-2.8 s at
p90, most of every TTFT, while the prefill estimate knew nothing of it (docs/perf-log.md, S43).
The TTFT estimate adds this figure for the decode worker a request would go to.
"""

from __future__ import annotations

import itertools
import time

from services.router.recent import RecentMedian


class AdmitLatency:
    """One decode worker's admissions as this router timed them: when each one still waiting was
    sent, and what the recent ones took. Owned by the worker's `WorkerView`."""

    HORIZON_S = 1.0  # an admission counts this long: the figure follows load within a second

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[int, float] = {}  # ticket -> when sent (oldest first)
        self._recent = RecentMedian(self.HORIZON_S, clock=clock)  # ms each took
        self._tickets = itertools.count()

    def sent(self) -> int:
        """A request was sent: its ticket, for `admitted` and `ended`."""
        ticket = next(self._tickets)
        self._waiting[ticket] = self._clock()
        return ticket

    def admitted(self, ticket: int) -> None:
        sent = self._waiting.pop(ticket, None)
        if sent is not None:
            self._recent.add((self._clock() - sent) * 1e3)

    def ended(self, ticket: int) -> None:
        """The request ended (admitted or not): no longer waiting."""
        self._waiting.pop(ticket, None)

    def estimate_ms(self) -> float:
        """The median of the admissions of the last HORIZON_S, or how long the oldest request
        still waiting has waited when that is longer; 0 when there is neither (it cannot latch:
        `RecentMedian`)."""
        oldest = (self._clock() - next(iter(self._waiting.values()))) * 1e3 if self._waiting else 0.0
        return max(self._recent.value(), oldest)
