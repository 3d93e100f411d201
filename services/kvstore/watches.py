"""Readers waiting for blocks not yet committed (KVStore.Watch): which watchers wait on which key."""

from __future__ import annotations

from services.kvstore.entries import Watcher


class Watches:
    """Owns the waiting lists, key -> its watchers in arrival order. The store delivers."""

    def __init__(self) -> None:
        self._waiting: dict[bytes, list[Watcher]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def count(self) -> int:
        """Waits outstanding (a watcher waiting on three keys counts three times)."""
        return sum(len(w) for w in self._waiting.values())

    def wait(self, key: bytes, watcher: Watcher) -> None:
        self._waiting.setdefault(key, []).append(watcher)

    def take(self, key: bytes) -> list[Watcher]:
        """The watchers of `key`, which no longer wait for it."""
        return self._waiting.pop(key, [])

    def forget(self, watcher: Watcher) -> None:
        """Stop waiting on every key the watcher still wants."""
        for key in watcher.wanted:
            waiting = self._waiting.get(key, [])
            if watcher in waiting:
                waiting.remove(watcher)
                if not waiting:
                    del self._waiting[key]
