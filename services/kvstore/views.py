"""Read-only views of a BlockStore's state, for Stats and the Redis index."""

from __future__ import annotations

import numpy as np

from services.kvstore.store import BlockStore
from services.kvstore.table import unpack


def tier_stats(store: BlockStore, tier: str) -> dict:
    mem, table = store.tiers[tier], store.table
    rows = table.tier_range(tier)
    return {
        "capacity_blocks": mem.info.num_slots,
        "capacity_bytes": mem.nbytes,
        "used_blocks": mem.info.num_slots - mem.allocator.num_free,  # a slot taken holds a block
        "pinned_blocks": int(np.count_nonzero(table.pins[rows])),
        "hits": store.counters.tier_hits[tier],
        "evictions": store.counters.evictions[tier],
        "duplicate_blocks": int(np.count_nonzero(table.duplicate[rows])),
    }


def committed_blocks(store: BlockStore) -> list[tuple[bytes, str]]:
    """(key, tier) of every committed prefix block: what the Redis index is rebuilt from."""
    table = store.table
    rows = np.flatnonzero(table.committed & ~table.is_tail).tolist()
    return list(zip(unpack(table.keys[rows]), map(table.tier_of, rows), strict=True))
