"""BlockStore: the store's protocol (puts, commits, gets, watches, leases, holds) over the blocks.

Single-threaded by design: only the server's event loop calls it, so it needs no locks. It
calls `BlockManager`'s verbs and never writes a block's fields itself. Every call that names a
lease checks that the lease is open and the caller's; nothing on an ended lease is answered as
done.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import NamedTuple

from pdserve.errors import FailedPrecondition, InvalidArgument, NotFound
from services.kvstore.blocks import DEVICE, DRAM, Block, BlockManager, Counters
from services.kvstore.events import IndexSink, NullIndexSink
from services.kvstore.leases import HoldLease, Lease, Leases, ReadLease, Watcher, WriteLease
from services.kvstore.memory import TierMemory

__all__ = ["DEVICE", "DRAM", "BlockStore", "Slot", "SlotState"]


class SlotState(enum.IntEnum):
    WRITE = 1  # yours: write the bytes, then commit
    PRESENT = 2  # stored already: do not write
    PENDING = 3  # another writer is writing it: do not write


class Slot(NamedTuple):
    block: Block
    state: SlotState


def _no_repeats(keys: Sequence[bytes], what: str) -> None:
    if len(set(keys)) != len(keys):
        raise InvalidArgument(f"block hashes repeat within one {what}")


class BlockStore:
    """Owns the leases, the committed tails' TTLs and the waiting watchers of one store process;
    its blocks are `self.blocks`'s."""

    def __init__(self, device: TierMemory, dram: TierMemory, default_lease_s: float = 10.0,
                 index: IndexSink | None = None, clock=time.monotonic, fence_s: float = 30.0,
                 max_lease_s: float = 300.0, max_leases_per_client: int = 4096, below=None):
        self.counters = Counters()
        self.blocks = BlockManager(device, dram, index or NullIndexSink(), self.counters, fence_s, clock, below)
        self.tiers = self.blocks.tiers
        self.block_nbytes = device.block_nbytes
        self.clock = clock
        self.leases = Leases(default_lease_s, clock, max_lease_s, max_leases_per_client)
        self.tail_ttls: dict[bytes, tuple[Block, float]] = {}  # committed tails pinned by their TTL, until when
        self.waiting: dict[bytes, list[Watcher]] = {}  # key -> the watchers waiting for its commit

    @property
    def index(self) -> IndexSink:
        return self.blocks.index

    @index.setter
    def index(self, sink: IndexSink) -> None:  # the Redis mirror is made after the store it mirrors
        self.blocks.index = sink

    # -- put -------------------------------------------------------------------------------
    def allocate_put(self, owner: str, hashes: Sequence[bytes], tail_key: bytes | None, lease_ms: int,
                     request_id: str, writer_keeps_copy: bool = False,
                     hold_ms: int = 0) -> tuple[WriteLease, list[Slot]]:
        """Slots for the blocks not yet here (WRITE), the others as PRESENT or PENDING, then the
        tail's. writer_keeps_copy: the new blocks are copies of the writer's cache, which
        it hands back when its cache evicts them (evicted first, never written to the cluster
        tier); otherwise the committed blocks already here become the store's own. hold_ms > 0
        (a handoff): what is present or written here stays pinned under a hold lease until it is
        released or lapses, hold_ms after the put's last commit."""
        _no_repeats(hashes, "put")
        self.leases.admit(owner, 1 + (hold_ms > 0), lease_ms=lease_ms, hold_ms=hold_ms)
        blocks = self.blocks
        if tail_key is not None and blocks.tail(tail_key) is not None:
            raise InvalidArgument(f"tail key {tail_key.decode(errors='replace')!r} is already in use")
        present = [b for h in hashes if (b := blocks.get(h)) is not None]
        blocks.pin(present)  # making room must not evict this put's own blocks
        try:
            new = blocks.allocate([h for h in hashes if blocks.get(h) is None], writer_keeps_copy, tail_key)
        finally:
            blocks.unpin(present)
        mine = {b.key: b for b in new}
        slots = [Slot(mine[h], SlotState.WRITE) if h in mine else
                 Slot(b, SlotState.PRESENT if b.committed else SlotState.PENDING)
                 for h in hashes for b in [mine.get(h) or blocks.get(h)]]
        if tail_key is not None:
            slots.append(Slot(new[-1], SlotState.WRITE))
        if not writer_keeps_copy:
            blocks.keep([b for b in present if b.committed])
        lease = self.leases.open(WriteLease, owner, lease_ms, request_id, uncommitted=dict(mine),
                                 named=frozenset(hashes), tail_key=tail_key)
        if tail_key is not None:
            lease.uncommitted[tail_key] = new[-1]
        if hold_ms > 0:
            held = [s.block for s in slots[: len(hashes)] if s.state != SlotState.PENDING]
            blocks.pin(held)
            hold = self.leases.open(HoldLease, owner, hold_ms, request_id, blocks=held, hold_s=hold_ms / 1000)
            lease.hold_id = hold.lease_id
        if not lease.uncommitted:
            self.leases.end(lease, "been committed in full")
        return lease, slots

    def commit(self, owner: str, lease_id: str, hashes: Sequence[bytes], checksums: Sequence[int],
               tail: bool = False, tail_checksum: int = 0, tail_ttl_ms: int = 0) -> tuple[int, bool]:
        """Commit written blocks, each with its writer's checksum; returns (committed, lease closed)."""
        lease = self.leases.find(lease_id, owner, WriteLease)
        if len(checksums) != len(hashes):
            raise InvalidArgument(f"commit: {len(checksums)} checksums for {len(hashes)} blocks")
        _no_repeats(hashes, "commit")
        ttl_s = self.leases.seconds(tail_ttl_ms, "tail_ttl_ms")
        for h in hashes:
            if h not in lease.uncommitted:
                why = "was never part of it" if h not in lease.named else "is not one it writes, or is committed"
                raise FailedPrecondition(f"block {h.hex()} of write lease {lease_id!r} {why}")
        if tail and (lease.tail_key is None or lease.tail_key not in lease.uncommitted):
            raise FailedPrecondition(f"write lease {lease_id!r} has no uncommitted tail")
        done = [lease.uncommitted.pop(h) for h in hashes]
        self.blocks.commit(done, checksums)
        if tail:
            block = lease.uncommitted.pop(lease.tail_key)
            self.blocks.commit([block], [tail_checksum])
            self.tail_ttls[lease.tail_key] = (block, self.clock() + ttl_s)
            done.append(block)
        self.counters.bytes_written += len(done) * self.block_nbytes
        if lease.hold_id in self.leases:
            hold = self.leases.find(lease.hold_id, None, HoldLease)
            hold.deadline = max(hold.deadline, self.clock() + hold.hold_s)
        self._notify(done)
        closed = not lease.uncommitted
        if closed:
            self.leases.end(lease, "been committed in full")
        return len(done), closed

    # -- get and watch ---------------------------------------------------------------------
    def get(self, owner: str, hashes: Sequence[bytes], tail_key: bytes | None, lease_ms: int,
            request_id: str, streaming: bool = False) -> tuple[ReadLease | None, list[Block], Block | None]:
        """Pin the longest committed prefix of `hashes` (and the tail) under a read lease.
        streaming: the store sends the bytes itself (GetBytes), and the lease lasts as long as
        that stream does (it cannot lapse under a slow reader: the slots would be reused)."""
        _no_repeats(hashes, "get")
        prefix = [self.blocks.get(h) for h in hashes[: self.committed_run(hashes)]]
        tail = self.blocks.tail(tail_key) if tail_key is not None else None
        if tail is not None and not tail.committed:
            tail = None
        self._count_lookup(len(prefix), len(hashes) - len(prefix))
        if not prefix and tail is None:
            return None, [], None
        lease = self.leases.open(ReadLease, owner, lease_ms, request_id, watching=streaming)
        self._pin_for(lease, prefix + ([tail] if tail is not None else []))
        return lease, prefix, tail

    def committed_run(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are committed here (a look, no pins, no counts)."""
        n = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.committed:
                break
            n += 1
        return n

    def adopt(self, before: Sequence[bytes], keys: Sequence[bytes], checksums: Sequence[int], data) -> int:
        """Blocks fetched from the tier below that continue the local run `before`: placed and
        committed without evicting `before`'s blocks. Returns how many were placed."""
        held = [b for h in before if (b := self.blocks.get(h)) is not None and b.committed]
        self.blocks.pin(held)
        try:
            placed = self.blocks.adopt(keys, checksums, data)
        finally:
            self.blocks.unpin(held)
        self._notify([self.blocks.get(k) for k in keys[:placed]])
        return placed

    def _count_lookup(self, hits: int, misses: int) -> None:
        self.counters.hits += hits
        self.counters.misses += misses
        self.index.looked_up(hits, misses)

    def _pin_for(self, lease: ReadLease, blocks: list[Block]) -> None:
        n_dram = self.blocks.pin(blocks, for_read=True)
        lease.blocks += blocks
        for b in blocks:
            if b.is_tail:
                lease.tail = b
        n_tail = sum(b.is_tail for b in blocks)
        self.counters.tier_hits[DRAM] += n_dram
        self.counters.tier_hits[DEVICE] += len(blocks) - n_tail - n_dram
        self.counters.bytes_read += len(blocks) * self.block_nbytes

    def watch(self, owner: str, hashes: Sequence[bytes], tail_key: bytes | None, lease_ms: int,
              request_id: str) -> Watcher:
        """Register interest; committed blocks are delivered at once, the others as committed."""
        keys = [*hashes, *([tail_key] if tail_key is not None else [])]
        _no_repeats(keys, "watch")
        lease = self.leases.open(ReadLease, owner, lease_ms, request_id, watching=True)
        watcher = Watcher(lease, {k: i for i, k in enumerate(keys)})
        ready = []
        for k in keys:
            b = self.blocks.tail(k) if k == tail_key else self.blocks.get(k)
            if b is not None and b.committed:
                ready.append(b)
            else:
                self.waiting.setdefault(k, []).append(watcher)
        hits = sum(not b.is_tail for b in ready)
        self._count_lookup(hits, 0)
        self._deliver(watcher, ready)
        return watcher

    def _deliver(self, watcher: Watcher, blocks: list[Block]) -> None:
        if not blocks:
            return
        self._pin_for(watcher.lease, blocks)
        for b in blocks:
            watcher.queue.put_nowait((watcher.wanted.pop(b.key), b))

    def _notify(self, committed: list[Block]) -> None:
        """Newly committed blocks: to each watcher waiting on them, in one delivery each."""
        ready: dict[int, tuple[Watcher, list[Block]]] = {}
        for b in committed:
            for watcher in self.waiting.pop(b.key, ()):
                if watcher.lease.lease_id in self.leases:
                    ready.setdefault(id(watcher), (watcher, []))[1].append(b)
        for watcher, blocks in ready.values():
            self._deliver(watcher, blocks)

    def end_watch(self, watcher: Watcher) -> None:
        """The Watch stream ended (the reader is done or gone): stop waiting, and end its lease."""
        for key in watcher.wanted:
            waiting = self.waiting.get(key, [])
            if watcher in waiting:
                waiting.remove(watcher)
                if not waiting:
                    del self.waiting[key]
        watcher.lease.watching = False
        if watcher.lease.lease_id in self.leases:
            self._end(watcher.lease, "ended with its watch")

    def num_waiting(self) -> int:
        return sum(len(w) for w in self.waiting.values())

    # -- leases ----------------------------------------------------------------------------
    def renew(self, owner: str, lease_id: str, lease_ms: int) -> float:
        return self.leases.renew(lease_id, owner, lease_ms)

    def release(self, owner: str, lease_id: str) -> tuple[int, int]:
        """End a lease (a hold by anyone who has its id): reads unpin; a write's uncommitted
        blocks are fenced. Returns (unpinned, fenced)."""
        return self._end(self.leases.find(lease_id, owner), "been released")

    def _end(self, lease: Lease, how: str, fence: bool = True) -> tuple[int, int]:
        self.leases.end(lease, how)
        if isinstance(lease, WriteLease):
            if lease.hold_id in self.leases:  # the writer failed: nobody will read this handoff
                self._end(self.leases.find(lease.hold_id, None), how)
            left = list(lease.uncommitted.values())
            lease.uncommitted.clear()
            if not fence:
                return 0, self.blocks.drop_unwritten(left)
            return 0, self.blocks.fence(left)
        self.blocks.unpin(lease.blocks)
        if isinstance(lease, ReadLease) and lease.tail is not None:
            # A per-request tail is read once: its TTL pin goes with its reader's, and so does it.
            held = self.tail_ttls.get(lease.tail.key)
            if held is not None and held[0] is lease.tail:
                del self.tail_ttls[lease.tail.key]
                self.blocks.unpin([lease.tail])
        return len(lease.blocks), 0

    def abandon(self, lease: WriteLease) -> None:
        """The store's own write (PutBytes) failed: no stale writer exists, no fence is needed."""
        if lease.lease_id in self.leases:
            self._end(lease, "been abandoned", fence=False)

    def report_corrupt(self, owner: str, lease_id: str, hashes: Sequence[bytes], tail: bool) -> int:
        """A reader's blocks failed their checksum: those whose stored copy fails it too are
        dropped (never found again). Returns how many."""
        lease = self.leases.find(lease_id, owner, ReadLease)
        mine = {b.key: b for b in lease.blocks}
        named = [mine.get(h) for h in hashes] + ([lease.tail] if tail else [])
        if None in named:
            raise NotFound(f"read lease {lease_id!r} does not hold every block reported")
        bad = [b for b in named if not b.detached and not self.blocks.verify(b)]
        self.drop_corrupt(bad)
        return len(bad)

    def drop_corrupt(self, blocks: Sequence[Block]) -> None:
        """Blocks whose stored bytes failed their checksum: never found again, each slot freed
        once its last reader lets go. A tail's TTL pin goes at once: a new tail put under the
        same key meanwhile gets a TTL of its own."""
        for b in blocks:
            self.blocks.detach(b)
            held = self.tail_ttls.get(b.key) if b.is_tail else None
            if held is not None and held[0] is b:
                del self.tail_ttls[b.key]
                self.blocks.unpin([b])

    def reap(self) -> int:
        """Lapse leases past their deadline, tails past their TTL, and free fenced slots whose
        quarantine is over; returns how many leases lapsed."""
        now = self.clock()
        lapsed = self.leases.lapsed(now)
        for lease in lapsed:
            if lease.lease_id in self.leases:  # (a write's hold lapsing with it was ended by it)
                self._end(lease, "lapsed")
        for key, (tail, expires) in list(self.tail_ttls.items()):
            if expires < now:
                del self.tail_ttls[key]
                self.blocks.unpin([tail])
        self.blocks.reap_fenced()
        return len(lapsed)

    # -- views -----------------------------------------------------------------------------
    def tier_stats(self, tier: str) -> dict:
        mem = self.tiers[tier]
        mine = [b for b in self.blocks.blocks() if b.tier == tier]
        return {
            "capacity_blocks": mem.info.num_slots,
            "capacity_bytes": mem.nbytes,
            "used_blocks": mem.info.num_slots - mem.allocator.num_free,  # held, written, or fenced
            "pinned_blocks": sum(b.pins > 0 for b in mine),
            "hits": self.counters.tier_hits[tier],
            "evictions": self.counters.evictions[tier],
            "duplicate_blocks": sum(b.writer_copy and b.committed for b in mine),
        }

    def committed_blocks(self) -> list[tuple[bytes, str]]:
        """(key, tier) of every committed prefix block: what the Redis index is rebuilt from."""
        return [(b.key, b.tier) for b in self.blocks.blocks() if b.committed and not b.is_tail]
