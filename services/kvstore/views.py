"""Read-only views of a BlockStore's state, for Stats and the Redis index."""

from __future__ import annotations

from services.kvstore.store import BlockStore


def tier_stats(store: BlockStore, tier: str) -> dict:
    mem = store.tiers[tier]
    in_tier = [e for e in store.entries.values() if e.tier == tier]
    return {
        "capacity_blocks": mem.info.num_slots,
        "capacity_bytes": mem.nbytes,
        "used_blocks": len(in_tier),
        "pinned_blocks": sum(1 for e in in_tier if e.pins > 0),
        "hits": store.counters.tier_hits[tier],
        "evictions": store.counters.evictions[tier],
        "duplicate_blocks": sum(1 for e in in_tier if e.duplicate),
    }


def committed_blocks(store: BlockStore) -> list[tuple[bytes, str]]:
    """(key, tier) of every committed prefix block: what the Redis index is rebuilt from."""
    return [(e.key, e.tier) for e in store.entries.values() if e.committed and not e.is_tail]
