"""What the store tells the outside world about its contents (the prefix index in Redis)."""

from __future__ import annotations

from typing import Protocol


class IndexSink(Protocol):
    """Receives every change of where blocks live. Must not block: called on the event loop."""

    def committed(self, key: bytes, tier: str) -> None: ...

    def moved(self, key: bytes, tier: str) -> None: ...

    def dropped(self, key: bytes) -> None: ...

    def looked_up(self, hits: int, misses: int) -> None: ...


class NullIndexSink:
    def committed(self, key: bytes, tier: str) -> None:
        pass

    def moved(self, key: bytes, tier: str) -> None:
        pass

    def dropped(self, key: bytes) -> None:
        pass

    def looked_up(self, hits: int, misses: int) -> None:
        pass
