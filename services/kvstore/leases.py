"""The store's leases: small typed records, random ids, deadlines, owners.

A read or write lease belongs to the client that opened it (its `owner`, the client id it
sent); a hold lease is a capability: the handoff passes its id to the reader, and whoever has
it may release it. Ids are 128 random bits, so none can be guessed. A lease that ended is
remembered (the last few thousand) with how it ended, so that a late call on it is refused with
a reason rather than as unknown; nothing on an ended lease is ever answered as done.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from services.kvstore.blocks import Block

ENDED_REMEMBERED = 4096


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: str
    owner: str
    request_id: str
    deadline: float


@dataclass(slots=True, eq=False)
class WriteLease(Lease):
    uncommitted: dict[bytes, Block] = field(default_factory=dict)  # key -> the block it still has to commit
    named: frozenset[bytes] = frozenset()  # every key the put named (its own writes or not)
    tail_key: bytes | None = None
    hold_id: str = ""  # the hold on this put's blocks, if any


@dataclass(slots=True, eq=False)
class ReadLease(Lease):
    blocks: list[Block] = field(default_factory=list)  # those it pins, the tail included
    tail: Block | None = None
    watching: bool = False  # a live stream (Watch, GetBytes) keeps it from lapsing: it ends with the stream


@dataclass(slots=True, eq=False)
class HoldLease(Lease):
    blocks: list[Block] = field(default_factory=list)
    hold_s: float = 0.0  # how long it outlives the put's last commit


@dataclass(eq=False)
class Watcher:
    lease: ReadLease
    wanted: dict[bytes, int]  # key -> index in the request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class Leases:
    """Owns the open leases of one store, by id, and the memory of recently ended ones."""

    def __init__(self, default_s: float, clock: Callable[[], float], max_s: float = 300.0,
                 max_per_owner: int = 4096):
        self.default_s = default_s
        self.max_s = max_s
        self.max_per_owner = max_per_owner
        self.clock = clock
        self._open: dict[str, Lease] = {}
        self._per_owner: Counter[str] = Counter()  # open leases by owner (a caller's bound)
        self._ended: OrderedDict[str, str] = OrderedDict()  # lease id -> how it ended

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._open

    def seconds(self, lease_ms: int, what: str = "lease_ms") -> float:
        """A requested length; 0 asks for the store's default. Bounded, so that no one call can
        hold memory for long: a holder that needs longer renews."""
        if lease_ms > self.max_s * 1000:
            raise InvalidArgument(f"{what} {lease_ms} is over this store's maximum {int(self.max_s * 1000)}: "
                                  "renew the lease instead")
        return lease_ms / 1000 if lease_ms > 0 else self.default_s

    def admit(self, owner: str, count: int = 1, **lengths_ms: int) -> None:
        """Refuse, before anything is allocated, what `open` would refuse: too long a lease, or
        one more lease than `owner` may hold."""
        for what, ms in lengths_ms.items():
            self.seconds(ms, what)
        if self._per_owner[owner] + count > self.max_per_owner:
            raise ResourceExhausted(f"client {owner!r} already holds {self._per_owner[owner]} open leases, this "
                                    "store's limit per client: release some first")

    def open(self, kind: type[Lease], owner: str, lease_ms: int, request_id: str, **fields) -> Lease:
        self.admit(owner, lease_ms=lease_ms)
        seconds = self.seconds(lease_ms)
        lease = kind(secrets.token_hex(16), owner, request_id, self.clock() + seconds, **fields)
        self._open[lease.lease_id] = lease
        self._per_owner[owner] += 1
        return lease

    def find(self, lease_id: str, owner: str | None, kind: type[Lease] | tuple[type[Lease], ...] = Lease) -> Lease:
        """The open lease `lease_id`, checked to be `owner`'s (None: a hold's capability is enough)
        and of `kind`; refused clearly otherwise."""
        lease = self._open.get(lease_id)
        if lease is None:
            how = self._ended.get(lease_id)
            if how is None:
                raise NotFound(f"lease {lease_id!r} is unknown")
            raise FailedPrecondition(f"lease {lease_id!r} has {how}: nothing more can be done under it")
        if owner is not None and not isinstance(lease, HoldLease) and lease.owner != owner:
            raise PermissionDenied(f"lease {lease_id!r} belongs to another client")
        if not isinstance(lease, kind):
            raise FailedPrecondition(f"lease {lease_id!r} is a {type(lease).__name__}, not what this call needs")
        return lease

    def end(self, lease: Lease, how: str) -> None:
        if self._open.pop(lease.lease_id, None) is not None:
            self._per_owner[lease.owner] -= 1
            if not self._per_owner[lease.owner]:
                del self._per_owner[lease.owner]
        self._ended[lease.lease_id] = how
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def renew(self, lease_id: str, owner: str, lease_ms: int) -> float:
        lease = self.find(lease_id, owner)
        lease.deadline = self.clock() + self.seconds(lease_ms)
        return lease.deadline

    def lapsed(self, now: float) -> list[Lease]:
        """Open leases past their deadline; a live Watch stream keeps its lease from lapsing."""
        return [lease for lease in self._open.values()
                if lease.deadline < now and not (isinstance(lease, ReadLease) and lease.watching)]
