"""What the store tells the outside world about its contents (the prefix index in Redis)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class IndexSink(Protocol):
    """Receives every change of where blocks live. Must not block: called on the event loop."""

    def committed(self, keys: Sequence[bytes], tiers: Sequence[str]) -> None:
        """Prefix blocks newly committed, key i in tier i. The sink keeps both sequences (the
        caller never changes them) and may read them later, off the caller's path: any later
        move or drop is told after this."""

    def moved(self, key: bytes, tier: str) -> None: ...

    def dropped(self, key: bytes) -> None: ...

    def looked_up(self, hits: int, misses: int) -> None: ...


class NullIndexSink:
    def committed(self, keys: Sequence[bytes], tiers: Sequence[str]) -> None:
        pass

    def moved(self, key: bytes, tier: str) -> None:
        pass

    def dropped(self, key: bytes) -> None:
        pass

    def looked_up(self, hits: int, misses: int) -> None:
        pass
