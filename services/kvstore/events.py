"""What the store tells the outside world about its contents (the prefix index in Redis)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.kvstore.entries import Entry


class IndexSink(Protocol):
    """Receives every change of where blocks live. Must not block: called on the event loop."""

    def committed(self, entries: Sequence[Entry]) -> None:
        """Prefix blocks newly committed, each in its entry's tier. The sink may read the keys
        and tiers later (off the caller's path): any later move or drop is told after this."""

    def moved(self, key: bytes, tier: str) -> None: ...

    def dropped(self, key: bytes) -> None: ...

    def looked_up(self, hits: int, misses: int) -> None: ...


class NullIndexSink:
    def committed(self, entries: Sequence[Entry]) -> None:
        pass

    def moved(self, key: bytes, tier: str) -> None:
        pass

    def dropped(self, key: bytes) -> None:
        pass

    def looked_up(self, hits: int, misses: int) -> None:
        pass
