"""What the store client answers: plain dataclasses made from the store's messages (no
protobuf leaves pdserve.kvclient)."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field

from pdserve.kv.layout import HashProfile
from pdserve.v1 import kvstore_pb2 as pb

WRITE, PRESENT, PENDING = pb.SLOT_STATE_WRITE, pb.SLOT_STATE_PRESENT, pb.SLOT_STATE_PENDING


@dataclass(frozen=True)
class PutResult:
    written: int  # blocks this call wrote
    present: int  # already stored
    pending: int  # another writer is writing them
    slices: int  # transfer-engine slices used


@dataclass(frozen=True)
class GetResult:
    num_blocks: int  # prefix blocks read and verified (the tail not counted)
    has_tail: bool
    slices: int
    corrupt: int = 0  # blocks that failed their checksum (not read: the prefix ends before the first)


@dataclass(frozen=True)
class StoreInfo:
    segment: str  # the store's transfer-engine peer name
    unix_address: str  # its gRPC address for clients on its host ("" when it offers none)
    profile: HashProfile
    block_nbytes: int
    device_capacity_blocks: int
    dram_capacity_blocks: int
    device_kind: str
    node: str = "local"  # the store node's name


@dataclass(frozen=True)
class Released:
    unpinned: int  # blocks a read or hold lease let go of
    reclaimed: int  # uncommitted slots of a write lease, fenced before reuse


@dataclass(frozen=True)
class TierStats:
    tier: str  # "device" | "dram"
    capacity_blocks: int
    used_blocks: int  # held, being written, or fenced
    pinned_blocks: int
    hits: int
    evictions: int
    promotions: int
    duplicate_blocks: int  # handoff copies their writer still caches


@dataclass(frozen=True)
class ClusterStats:
    """The cluster tier below DRAM, as one store node sees it (see ClusterStats in kvstore.proto)."""

    connected: bool
    spilled: int
    put_failures: int
    spill_dropped: int
    fetched: int
    fetch_misses: int
    fetch_timeouts: int
    corrupt: int
    unreachable: int
    fetch_errors: int


@dataclass(frozen=True)
class StoreStats:
    tiers: list[TierStats]
    hits: int
    misses: int
    bytes_written: int
    bytes_read: int
    active_leases: int
    watchers: int
    redis_connected: bool
    corrupt_blocks: int  # blocks found failing their checksum, dropped
    fenced_blocks: int  # slots quarantined now
    cluster: ClusterStats | None = None  # None: the store has no cluster tier
    calls: dict[str, int] = field(default_factory=dict)  # calls taken since it started, by method name

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.tiers if t.tier == name)


_TIER_NAME = {pb.TIER_DEVICE: "device", pb.TIER_DRAM: "dram"}


def stats_from_pb(m: pb.StatsResponse) -> StoreStats:
    tiers = [TierStats(_TIER_NAME[t.tier], t.capacity_blocks, t.used_blocks, t.pinned_blocks, t.hits, t.evictions,
                       t.promotions, t.duplicate_blocks) for t in m.tiers]
    return StoreStats(tiers, m.hits, m.misses, m.bytes_written, m.bytes_read, m.active_leases, m.watchers,
                      m.redis_connected, m.corrupt_blocks, m.fenced_blocks,
                      ClusterStats(**{f: getattr(m.cluster, f) for f in ClusterStats.__dataclass_fields__})
                      if m.HasField("cluster") else None, dict(m.calls))


@dataclass(frozen=True, slots=True)
class Slots:
    """The slots of one answer, as columns (entry i is block i)."""

    addresses: list[int]
    states: list[int]  # pb.SlotState values
    tiers: list[int]  # pb.Tier values
    checksums: list[int]  # the writer's checksums (answers to readers; empty for a put's)

    def __len__(self) -> int:
        return len(self.addresses)

    def __getitem__(self, i: slice) -> Slots:
        return Slots(self.addresses[i], self.states[i], self.tiers[i], self.checksums[i])


def _u64s(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def slots_from_pb(m: pb.SlotList) -> Slots:
    n = len(m.states)
    if len(m.addresses) != 8 * n or len(m.tiers) != n or len(m.checksums) not in (0, 8 * n):
        raise ValueError(f"malformed slot list from the store: {len(m.addresses)} bytes of addresses, {n} states, "
                         f"{len(m.tiers)} tiers, {len(m.checksums)} bytes of checksums")
    return Slots(_u64s(m.addresses), list(m.states), list(m.tiers), _u64s(m.checksums))


@dataclass
class Allocation:
    lease_id: str
    hashes: list[bytes]
    slots: Slots  # one per hash, then the tail's
    has_tail: bool
    hold_lease_id: str = ""  # the store's hold on these blocks for their reader (allocate's hold_ms)
    commits: list[asyncio.Future] = field(default_factory=list)  # commits sent, their answers not awaited


@dataclass(frozen=True)
class WatchBatch:
    lease_id: str
    indices: list[int]  # positions in the watched hashes; len(hashes) for the tail
    slots: Slots


@dataclass(frozen=True)
class Pinned:
    lease_id: str  # empty when nothing was found
    slots: Slots  # the longest stored prefix
    tail_address: int | None = None
    tail_checksum: int = 0
    from_cluster: int = 0  # the last ones of `slots` the store fetched from the cluster tier for this call
