"""Block pool: page allocation with reference counts and a prefix cache keyed by block hash."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from pdserve import logs
from pdserve.kv.hashing import BlockHash

log = logs.get("engine.block_pool")


class BlockPool:
    """Owns every page's ref count and hash. Owned by the scheduler alone.

    A page is in exactly one of: in use (ref_count > 0), evictable (ref_count 0 but still
    holding a cached block, LRU order), or free (ref_count 0, no hash). `on_evict(page, hash)`,
    when set, is told of each cached block just before its page is reused: the page still holds it.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_hash: dict[int, BlockHash] = {}
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"out of KV pages: want {num_blocks}, free {self.num_free_blocks}")
        out = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)  # least recently used
                block_hash = self._block_hash.pop(block_id)
                del self._hash_to_block[block_hash]
                if self.on_evict is not None:
                    try:
                        self.on_evict(block_id, block_hash)
                    except Exception:  # noqa: BLE001 - a copy lost is a later cache miss, never a failed step
                        log.exception("evicted page's on_evict hook failed: its block is not kept", page=block_id)
            self.ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def match_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Pages holding the longest cached prefix of `hashes` (no ref counts change)."""
        out = []
        if not self.enable_prefix_caching:
            return out
        for h in hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def acquire(self, block_ids: list[int]) -> None:
        """Take one more reference on cached pages (a prefix hit)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Freed in reverse so a sequence's tail is evicted first."""
        for block_id in reversed(block_ids):
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"double free of KV page {block_id}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if block_id in self._block_hash:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that `block_id` holds the full block `block_hash` (first holder wins)."""
        if not self.enable_prefix_caching or block_hash in self._hash_to_block:
            return
        if block_id in self._block_hash:
            raise RuntimeError(f"KV page {block_id} already caches another block")
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._block_hash.get(block_id)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._hash_to_block)
