"""The store's leases: ids, deadlines, and the ones recently closed.

A closed lease is remembered (the last 4,096) so that a commit or release repeated after it
closed is answered as done, not as unknown. What a lease pins is the store's business."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

from pdserve.errors import NotFound
from services.kvstore.entries import Lease

CLOSED_REMEMBERED = 4096


class Leases:
    """Owns the open leases of one store, by id."""

    def __init__(self, default_s: float, clock: Callable[[], float]):
        self.default_s = default_s
        self.clock = clock
        self._open: dict[str, Lease] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._open

    def seconds(self, lease_ms: int) -> float:
        """A requested length; 0 asks for the store's default."""
        return lease_ms / 1000 if lease_ms > 0 else self.default_s

    def new(self, kind: str, lease_ms: int, request_id: str) -> Lease:
        lease = Lease(f"{kind[0]}{next(self._ids)}", kind, self.clock() + self.seconds(lease_ms), request_id)
        self._open[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease | None:
        return self._open.get(lease_id)

    def closed(self, lease_id: str) -> bool:
        """Closed lately (not lapsed out of memory, nor never opened)."""
        return lease_id in self._closed

    def close(self, lease: Lease) -> None:
        self._open.pop(lease.lease_id, None)
        self._closed[lease.lease_id] = None
        while len(self._closed) > CLOSED_REMEMBERED:
            self._closed.popitem(last=False)

    def renew(self, lease_id: str, lease_ms: int) -> float:
        lease = self._open.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id!r} is unknown or lapsed")
        lease.deadline = self.clock() + self.seconds(lease_ms)
        return lease.deadline

    def lapsed(self, now: float) -> list[str]:
        """Open leases past their deadline; a live Watch stream keeps its lease from lapsing."""
        return [lid for lid, lease in self._open.items() if lease.deadline < now and not lease.watching]
