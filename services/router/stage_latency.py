"""How long a stage of a decode worker's requests takes lately, as this router times it.

Two stages a disaggregated request waits on besides prefill's own work, both timed per decode
worker (`WorkerView.admit`, `WorkerView.handoff`) and added by the router's SLO check:
- admission: prefill is sent once decode has admitted the request, so that wait is part of its
  TTFT, and the part that grows when what a decode worker runs out of is CPU rather than KV
  blocks (at the pinned overload replay 313-628 ms at p50 and 2-2.8 s at p90, most of every TTFT,
  while the prefill estimate knew nothing of it: docs/perf-log.md, S43);
- the handoff's completion after the first token: prefill streams its first token at once, but
  decode goes on only once the store has confirmed the last commits, which under load took longer
  than the prefill itself (S44). Left out of the check, the router admitted what its store and
  decode workers could not carry on with.
"""

from __future__ import annotations

import itertools
import time

from services.router.recent import RecentMedian


class StageLatency:
    """One stage of one decode worker's requests as this router timed it: when each one still in
    it started, and what the recent ones took. Owned by the worker's `WorkerView`."""

    HORIZON_S = 1.0  # a measurement counts this long: the figure follows load within a second

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[int, float] = {}  # ticket -> when it started (oldest first)
        self._recent = RecentMedian(self.HORIZON_S, clock=clock)  # ms each took
        self._tickets = itertools.count()

    def start(self) -> int:
        """A request entered the stage: its ticket, for `done` and `ended`."""
        ticket = next(self._tickets)
        self._waiting[ticket] = self._clock()
        return ticket

    def done(self, ticket: int) -> None:
        started = self._waiting.pop(ticket, None)
        if started is not None:
            self._recent.add((self._clock() - started) * 1e3)

    def ended(self, ticket: int) -> None:
        """The request ended (through the stage or not): no longer in it."""
        self._waiting.pop(ticket, None)

    def estimate_ms(self) -> float:
        """The median of what the last HORIZON_S measured, or how long the oldest request still
        in the stage has been when that is longer; 0 when there is neither (it cannot latch:
        `RecentMedian`)."""
        oldest = (self._clock() - next(iter(self._waiting.values()))) * 1e3 if self._waiting else 0.0
        return max(self._recent.value(), oldest)
