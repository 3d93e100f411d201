"""BlockStore: puts, commits, gets and watches of blocks, under leases that pin them.

Single-threaded by design: only the server's event loop calls it, so it needs no locks. Where
blocks live, their eviction and their moves between tiers are `tiers.TieredBlocks`'s.
Invariants:
- an entry is pinned (pins > 0) while a writer holds it uncommitted, while a read lease holds it,
  and (for a per-request tail) until its TTL lapses; pinned entries are never evicted;
- a DRAM hit is served from DRAM and promoted to the device tier when its last reader releases.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from itertools import repeat

from pdserve.errors import InvalidArgument, NotFound
from services.kvstore.entries import DEVICE, DRAM, Counters, Entry, Lease, SlotRef, Slots, SlotState, Watcher
from services.kvstore.events import IndexSink, NullIndexSink
from services.kvstore.leases import Leases
from services.kvstore.memory import TierMemory
from services.kvstore.tiers import TieredBlocks
from services.kvstore.watches import Watches

__all__ = ["DEVICE", "DRAM", "BlockStore", "SlotRef", "Slots", "SlotState"]


class BlockStore:
    """Owns the leases, the held tails and the watchers of one store process; its blocks are
    `self.blocks`'s."""

    def __init__(self, device: TierMemory, dram: TierMemory, default_lease_s: float = 10.0,
                 index: IndexSink | None = None, clock=time.monotonic):
        self.counters = Counters()
        self.blocks = TieredBlocks(device, dram, index or NullIndexSink(), self.counters)
        # The blocks' own state, named here too (the same objects; `blocks` owns them).
        self.entries, self.evictable, self.tiers = self.blocks.entries, self.blocks.evictable, self.blocks.tiers
        self.block_nbytes = device.block_nbytes
        self.clock = clock
        self.leases = Leases(default_lease_s, clock)
        self.held_tails: set[bytes] = set()  # committed tails pinned by their TTL: all `reap` looks at
        self.watchers = Watches()

    @property
    def index(self) -> IndexSink:
        return self.blocks.index

    @index.setter
    def index(self, sink: IndexSink) -> None:  # the Redis mirror is made after the store it mirrors
        self.blocks.index = sink

    # -- put -------------------------------------------------------------------------------
    def allocate_put(self, hashes: list[bytes], tail_key: bytes | None, lease_ms: int,
                     request_id: str, writer_keeps_copy: bool = False,
                     hold_ms: int = 0) -> tuple[Lease, Slots]:
        """Slots for the blocks not yet here (WRITE), the others as PRESENT or PENDING.

        writer_keeps_copy: new blocks are copies of the writer's cache, evicted before any other
        block (oldest copies first). Otherwise (an offload, or any other put) new blocks and
        blocks already here are the most recently used, and no longer copies: the writer let go.
        Either way the blocks already here count as used now.

        hold_ms > 0 (a handoff): the blocks present or written here stay pinned under a hold
        lease (`lease.hold_id`) until it is released or lapses, hold_ms after the last commit;
        releasing the write lease uncommitted (the writer failed) releases the hold too."""
        entries = self.entries
        if tail_key is not None and tail_key in entries:
            raise InvalidArgument(f"tail key {tail_key.decode(errors='replace')!r} is already in use")
        named = set(hashes)
        if len(named) != len(hashes):
            raise InvalidArgument("block hashes repeat within one put")
        keys = [*hashes, tail_key] if tail_key is not None else hashes
        # Which are here already, found from the put's side (a dict's keys & a small set).
        here = entries.keys() & named
        present = [entries[h] for h in hashes if h in here] if here else []
        new_keys = [k for k in keys if k not in here] if here else keys
        # Making room must not evict the blocks of this very put that are already here.
        for entry in present:
            self.blocks.pin(entry)
        try:
            placed = self.blocks.allocate(len(new_keys))
        finally:
            for entry in present:
                self.blocks.unpin(entry)
        lease = self.leases.new("write", lease_ms, request_id)
        if tail_key is not None:
            named.add(tail_key)
        lease.all_keys = named
        # New: in no eviction order yet, so pinned (the writer's pin) without _pin's look-up;
        # built a tier's run at a time, with their slots' columns.
        addresses: list[int] = []
        tiers: list[str] = []
        done = 0
        for tier, slots in placed:
            run = new_keys[done : done + len(slots)]
            done += len(slots)
            made = list(map(Entry, run, repeat(tier), slots, repeat(1), repeat(writer_keeps_copy)))
            entries.update(zip(run, made, strict=True))
            lease.pinned += made
            base, nbytes = self.blocks.base[tier], self.block_nbytes
            addresses += [base + slot * nbytes for slot in slots]
            tiers += repeat(tier, len(slots))
        new_entries = lease.pinned  # every entry this put made, in its order
        deque(map(setattr, new_entries, repeat("next"), new_entries[1:]), maxlen=0)  # each one's next (a loop in C)
        if tail_key is not None:
            entries[tail_key].is_tail = True
        new = set(new_keys) if present else None  # None: every block is new
        if new is None:  # the common put: its columns are built above
            out = Slots(new_keys, addresses, tiers, [SlotState.WRITE] * len(new_keys))
        else:
            out = Slots.of([self._put_ref(entries[key], key in new, writer_keeps_copy) for key in keys])
        if hold_ms > 0:  # what this put writes, and what is here already (not another's writes)
            hold = self.leases.new("hold", hold_ms, request_id)
            hold.hold_s = hold_ms / 1000
            hold.held = [entries[h] for h in hashes if new is None or h in new or entries[h].committed]
            for entry in hold.held:
                self.blocks.pin(entry)
            lease.hold_id = hold.lease_id
        if not lease.pinned:
            self.leases.close(lease)
        return lease, out

    def _put_ref(self, entry: Entry, new: bool, writer_keeps_copy: bool) -> SlotRef:
        if not new and entry.committed and not writer_keeps_copy:
            self.blocks.keep(entry)
        return self.blocks.slot_ref(entry, SlotState.WRITE if new else SlotState.PRESENT if entry.committed
                             else SlotState.PENDING)

    def commit(self, lease_id: str, keys: Iterable[bytes] | None = None,
               tail_ttl_ms: int = 0) -> tuple[int, bool]:
        """Commit written blocks; returns (newly committed, lease closed). Idempotent."""
        lease = self.leases.get(lease_id)
        if lease is None:
            if self.leases.closed(lease_id):
                return 0, True
            raise NotFound(f"write lease {lease_id!r} is unknown or lapsed: its slots were reclaimed; put again")
        if lease.kind != "write":
            raise InvalidArgument(f"lease {lease_id!r} is a read lease")
        if keys is None:
            wanted = lease.pinned  # the entries it wrote that are still uncommitted
        else:
            keys = list(keys)
            for key in keys:
                if key not in lease.all_keys:
                    raise NotFound(f"block {key.hex()} is not part of write lease {lease_id!r}")
            # Keys it named but did not write (present, or another writer's) are not its to commit.
            mine = {e.key: e for e in lease.pinned}
            wanted = [mine[k] for k in keys if k in mine]
        evictable, notify = self.evictable, bool(self.watchers)
        done: list[Entry] = []
        tail: Entry | None = None
        for entry in wanted:
            if entry.committed:
                continue  # a key named twice in this call
            entry.committed = True
            if entry.is_tail:
                tail = entry
                entry.tail_held = True  # the writer's pin becomes the TTL pin
                entry.tail_expires = self.clock() + self.leases.seconds(tail_ttl_ms)
                self.held_tails.add(entry.key)
            else:
                # _unpin of the writer's pin, inline: never read while uncommitted, the entry
                # has no promotion pending and is no tail.
                entry.pins -= 1
                if entry.pins == 0:
                    evictable[entry.tier].add(entry)
                done.append(entry)
            if notify:
                self._notify(entry)
        count = len(done) + (tail is not None)
        if done:
            self.index.committed(done)
        self.counters.bytes_written += count * self.block_nbytes
        if count:
            lease.pinned = [e for e in lease.pinned if not e.committed] if keys is not None else []
        hold = self.leases.get(lease.hold_id)
        if hold is not None:
            hold.deadline = max(hold.deadline, self.clock() + hold.hold_s)
        closed = not lease.pinned
        if closed:
            self.leases.close(lease)
        return count, closed

    # -- get -------------------------------------------------------------------------------
    def get(self, hashes: list[bytes], tail_key: bytes | None, lease_ms: int,
            request_id: str) -> tuple[Lease | None, Slots, SlotRef | None]:
        entries = self.entries
        found: list[Entry] = []
        entry = None
        for h in hashes:
            # The block after one is most often the next of the same put (see Entry.next):
            # followed there rather than looked up (objects made together lie together in memory).
            after = entry.next if entry is not None else None
            entry = after if after is not None and after.key == h and not after.dropped else entries.get(h)
            if entry is None or not entry.committed:
                break
            found.append(entry)
        tail = entries.get(tail_key) if tail_key is not None else None
        if tail is not None and not tail.committed:
            tail = None
        counters, n = self.counters, len(found)
        counters.hits += n
        counters.misses += len(hashes) - n
        self.index.looked_up(n, len(hashes) - n)
        if not found and tail is None:
            return None, Slots([], [], [], []), None
        lease = self.leases.new("read", lease_ms, request_id)
        # _pin_for_read of each block, a loop at a time (a prefix block is never a tail).
        tiers = [e.tier for e in found]
        self.blocks.pin_all(found, tiers)
        n_dram = tiers.count(DRAM)
        counters.tier_hits[DEVICE] += n - n_dram
        counters.tier_hits[DRAM] += n_dram
        if n_dram:  # promoted when its last reader lets go
            for e in found:
                if e.tier == DRAM:
                    e.promote_on_release = True
        base, nbytes = self.blocks.base, self.block_nbytes
        addresses = [base[tier] + e.slot * nbytes for e, tier in zip(found, tiers, strict=True)]
        keys = hashes[:n]
        lease.pinned = found
        counters.bytes_read += n * nbytes
        if tail is not None:
            self._pin_for_read(lease, tail)
        tail_ref = self.blocks.slot_ref(tail) if tail else None
        return lease, Slots(keys, addresses, tiers, [SlotState.PRESENT] * n), tail_ref

    def _pin_for_read(self, lease: Lease, entry: Entry) -> None:
        self.blocks.pin(entry)  # out of the LRU while pinned; back in at its recent end when unpinned
        lease.pinned.append(entry)
        self.counters.bytes_read += self.block_nbytes
        if entry.tier == DRAM and not entry.is_tail:
            entry.promote_on_release = True

    # -- watch -----------------------------------------------------------------------------
    def watch(self, hashes: list[bytes], tail_key: bytes | None, lease_ms: int,
              request_id: str) -> Watcher:
        """Register interest; already-committed keys are queued at once, others on commit."""
        keys = [*hashes, *([tail_key] if tail_key is not None else [])]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys repeat within one watch")
        lease = self.leases.new("read", lease_ms, request_id)
        lease.watching = True
        watcher = Watcher(lease, {k: i for i, k in enumerate(keys)})
        hits = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.committed:
                hits += key != tail_key
                self._deliver(watcher, entry)
            else:
                self.watchers.wait(key, watcher)
        self.counters.hits += hits
        self.index.looked_up(hits, 0)
        return watcher

    def _deliver(self, watcher: Watcher, entry: Entry) -> None:
        self._pin_for_read(watcher.lease, entry)
        watcher.queue.put_nowait((watcher.wanted.pop(entry.key), self.blocks.slot_ref(entry)))

    def _notify(self, entry: Entry) -> None:
        for watcher in self.watchers.take(entry.key):
            if watcher.lease.lease_id in self.leases:
                self._deliver(watcher, entry)

    def end_watch(self, watcher: Watcher, release: bool) -> None:
        """The Watch stream ended: stop waiting; release its pins too when the client is gone."""
        self.watchers.forget(watcher)
        watcher.lease.watching = False
        if release:
            self.release(watcher.lease.lease_id)
        else:
            watcher.lease.deadline = max(watcher.lease.deadline, self.clock() + self.leases.default_s)

    # -- leases ----------------------------------------------------------------------------
    def release(self, lease_id: str) -> tuple[int, int]:
        """End a lease: unpin what it read; reclaim what it wrote but never committed."""
        lease = self.leases.get(lease_id)
        if lease is None:
            if self.leases.closed(lease_id):
                return 0, 0
            raise NotFound(f"lease {lease_id!r} is unknown or lapsed")
        self.leases.close(lease)
        unpinned = reclaimed = 0
        if lease.kind == "hold":
            for entry in lease.held:
                if not entry.dropped:  # (its writer failed since, and it was reclaimed)
                    self.blocks.unpin(entry)
                    unpinned += 1
            return unpinned, 0
        if lease.kind == "write" and lease.hold_id in self.leases:
            self.release(lease.hold_id)  # the writer failed: nobody will read this handoff
        for entry in lease.pinned:  # each still here: pinned, so neither evicted nor dropped
            if lease.kind == "write":
                entry.pins -= 1
                self.blocks.drop(entry)
                reclaimed += 1
            else:
                if entry.is_tail and entry.tail_held:
                    entry.tail_held = False  # a per-request tail is read once: consumed, it goes
                    self.held_tails.discard(entry.key)
                    entry.pins -= 1
                self.blocks.unpin(entry)
                unpinned += 1
        return unpinned, reclaimed

    def reap(self) -> int:
        """Lapse leases past their deadline and tails past their TTL; returns how many."""
        now = self.clock()
        lapsed = self.leases.lapsed(now)
        for lease_id in lapsed:
            self.release(lease_id)
        tails = [e for k in self.held_tails if (e := self.entries[k]).tail_expires < now]
        for entry in tails:
            entry.tail_held = False
            self.held_tails.discard(entry.key)
            self.blocks.unpin(entry)
        return len(lapsed)
