"""BlockStore: puts, commits, gets and watches of blocks, under leases that pin them.

Single-threaded by design: only the server's event loop calls it, so it needs no locks. Where
blocks live, their eviction and their moves between tiers are `tiers.TieredBlocks`'s.
Invariants:
- a block is pinned (pins > 0) while a writer holds it uncommitted, while a read lease holds it,
  and (for a per-request tail) until its TTL lapses; pinned blocks are never evicted, nor moved,
  so a lease holds its blocks' ids (rows of the block table, see table.py);
- a DRAM hit is served from DRAM and promoted to the device tier when its last reader releases.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from pdserve.errors import InvalidArgument, NotFound
from services.kvstore.deferred import Deferred
from services.kvstore.entries import DEVICE, DRAM, NO_ROWS, Counters, Lease, SlotRef, Slots, SlotState, Watcher
from services.kvstore.events import IndexSink, NullIndexSink
from services.kvstore.leases import Leases
from services.kvstore.memory import TierMemory
from services.kvstore.table import NO_BLOCK, BlockView, Hashes, pack, unpack
from services.kvstore.tiers import TieredBlocks
from services.kvstore.watches import Watches

__all__ = ["DEVICE", "DRAM", "BlockStore", "SlotRef", "Slots", "SlotState"]
_WRITE, _PRESENT = bytes([SlotState.WRITE]), bytes([SlotState.PRESENT])  # a column of n: times n


class BlockStore:
    """Owns the leases, the held tails and the watchers of one store process; its blocks are
    `self.blocks`'s."""

    def __init__(self, device: TierMemory, dram: TierMemory, default_lease_s: float = 10.0,
                 index: IndexSink | None = None, clock=time.monotonic):
        self.counters = Counters()
        self.blocks = TieredBlocks(device, dram, index or NullIndexSink(), self.counters)
        # The blocks' own state, named here too (the same objects; `blocks` owns them).
        self.table, self.evictable, self.tiers = self.blocks.table, self.blocks.evictable, self.blocks.tiers
        self.block_nbytes = device.block_nbytes
        self.clock = clock
        self.leases = Leases(default_lease_s, clock)
        self.held_tails: dict[bytes, float] = {}  # committed tails pinned by their TTL -> when it ends
        self.watchers = Watches()
        self.deferred = Deferred()  # bookkeeping a control call's answer does not wait for

    def block(self, key: bytes) -> BlockView:
        """One block's state (KeyError: not here)."""
        return self.table.view(key)

    def locate(self, key: bytes) -> tuple[str, int]:
        """(tier, slot) of a block here; only while it is pinned does that stay true."""
        i = self.table.row(key)
        if i == NO_BLOCK:
            raise KeyError(key)
        return self.table.tier_of(i), self.table.slot_of(i)

    @property
    def index(self) -> IndexSink:
        return self.blocks.index

    @index.setter
    def index(self, sink: IndexSink) -> None:  # the Redis mirror is made after the store it mirrors
        self.blocks.index = sink

    # -- put -------------------------------------------------------------------------------
    def allocate_put(self, hashes: np.ndarray | Sequence[bytes], tail_key: bytes | None, lease_ms: int,
                     request_id: str, writer_keeps_copy: bool = False,
                     hold_ms: int = 0) -> tuple[Lease, Slots]:
        """Slots for the blocks not yet here (WRITE), the others as PRESENT or PENDING.
        `hashes`: packed (table.pack) or one bytes object each.

        writer_keeps_copy: new blocks are copies of the writer's cache, evicted before any other
        block (oldest copies first). Otherwise (an offload, or any other put) new blocks and
        blocks already here are the most recently used, and no longer copies: the writer let go.
        Either way the blocks already here count as used now.

        hold_ms > 0 (a handoff): the blocks present or written here stay pinned under a hold
        lease (`lease.hold_id`) until it is released or lapses, hold_ms after the last commit;
        releasing the write lease uncommitted (the writer failed) releases the hold too."""
        t = self.table
        if tail_key is not None and tail_key in t.tails:
            raise InvalidArgument(f"tail key {tail_key.decode(errors='replace')!r} is already in use")
        packed = pack(hashes)
        looked = t.index.lookup_unique(packed)
        if looked is None:
            raise InvalidArgument("block hashes repeat within one put")
        found, n_here = looked  # each hash's row, or -1: not here
        if n_here:
            here = found >= 0
            present, new_packed = found[here], packed[~here]
        else:  # the common put: every block is new
            present, new_packed = None, packed
        # Making room must not evict the blocks of this very put that are already here.
        if present is not None:
            self.blocks.pin(present)
        try:
            rows = self.blocks.allocate(len(new_packed) + (tail_key is not None))
        finally:
            if present is not None:
                self.blocks.unpin(present)
        lease = self.leases.new("write", lease_ms, request_id)
        lease.named, lease.tail_key = packed, tail_key
        # The new blocks go in the table after the answer (the slots are the rows' own).
        self.deferred(t.add, new_packed, rows, 1, writer_keeps_copy, tail_key)  # (pins=1: the writer's)
        lease.pinned = rows
        if present is None:
            all_rows = rows
            out = t.slots(rows, _WRITE * len(rows))
        else:
            found[~here] = rows[: len(new_packed)]
            all_rows = np.concatenate([found, rows[len(new_packed):]])  # (the tail's, if any)
            out = self._put_slots(all_rows, ~here, present, writer_keeps_copy)
        if hold_ms > 0:  # what this put writes, and what is here already (not another's writes)
            hold = self.leases.new("hold", hold_ms, request_id)
            hold.hold_s = hold_ms / 1000
            held = np.frombuffer(out.states, np.uint8, len(packed)) != SlotState.PENDING
            hold.held, hold.held_keys = all_rows[: len(packed)][held], packed[held]
            self.deferred(self.blocks.pin, hold.held)
            lease.hold_id = hold.lease_id
        if not len(lease.pinned):
            self.leases.close(lease)
        return lease, out

    def _put_slots(self, rows: np.ndarray, new: np.ndarray, present: np.ndarray, writer_keeps_copy: bool) -> Slots:
        """`rows`: each key's (hashes, then the tail); `new`: which hashes this put writes."""
        t = self.table
        if not writer_keeps_copy:
            kept = present[t.committed[present]]
            if len(kept):
                self.blocks.keep(kept)
        new = np.concatenate([new, np.ones(len(rows) - len(new), np.bool_)])  # a tail is always new
        states = np.where(new, SlotState.WRITE, np.where(t.committed[rows], SlotState.PRESENT, SlotState.PENDING))
        return t.slots(rows, states.astype(np.uint8).tobytes())

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
        t = self.table
        if keys is None:
            rows = lease.pinned  # the blocks it wrote that are still uncommitted
        else:
            keys = list(keys)
            if lease.all_keys is None:
                lease.all_keys = {*unpack(lease.named), *([lease.tail_key] if lease.tail_key is not None else [])}
            for key in keys:
                if key not in lease.all_keys:
                    raise NotFound(f"block {key.hex()} is not part of write lease {lease_id!r}")
            hash_rows = iter(t.index.lookup(pack([k for k in keys if k != lease.tail_key])).tolist())
            rows_named = [t.tails[k] if k == lease.tail_key else next(hash_rows) for k in keys]
            # Keys it named but did not write (present, or another writer's) are not its to commit.
            mine = set(lease.pinned.tolist())
            rows = np.array(list(dict.fromkeys(i for i in rows_named if i in mine)), np.int64)
        blocks = rows  # (not the tail)
        if lease.tail_key is not None:
            tail = t.tails.get(lease.tail_key, NO_BLOCK)
            if tail != NO_BLOCK and tail in rows:  # the writer's pin becomes the TTL pin
                blocks = rows[rows != tail]
                t.committed[tail] = True
                self.held_tails[lease.tail_key] = self.clock() + self.leases.seconds(tail_ttl_ms)
        count = len(rows)
        if count:  # what it wrote and has not committed yet (rows: a part of lease.pinned)
            lease.pinned = lease.pinned[~np.isin(lease.pinned, rows)] if keys is not None else NO_ROWS
            self.deferred(self._committed, blocks, rows)
        self.counters.bytes_written += count * self.block_nbytes
        hold = self.leases.get(lease.hold_id)
        if hold is not None:
            hold.deadline = max(hold.deadline, self.clock() + hold.hold_s)
        closed = not len(lease.pinned)
        if closed:
            self.leases.close(lease)
        return count, closed

    def _committed(self, blocks: np.ndarray, rows: np.ndarray) -> None:
        """A commit's bookkeeping, after its answer: the blocks (not a tail) lose their writer's
        pin and join the eviction order, the index hears of them, their watchers get them."""
        if len(blocks):
            self.blocks.commit(blocks)
            self.index.committed(Hashes(self.table.keys[blocks]), self.table.tiers_of(blocks))
        if self.watchers:
            self._notify(rows.tolist())

    # -- get -------------------------------------------------------------------------------
    def get(self, hashes: np.ndarray | Sequence[bytes], tail_key: bytes | None, lease_ms: int,
            request_id: str) -> tuple[Lease | None, Slots, SlotRef | None]:
        t = self.table
        rows = t.index.prefix(pack(hashes), t.committed)  # the longest committed prefix's
        if rows is None:
            raise InvalidArgument("block hashes repeat within one get")
        n = len(rows)
        tail = t.tails.get(tail_key, NO_BLOCK) if tail_key is not None else NO_BLOCK
        if tail != NO_BLOCK and not t.committed[tail]:
            tail = NO_BLOCK
        counters = self.counters
        counters.hits += n
        counters.misses += len(hashes) - n
        self.index.looked_up(n, len(hashes) - n)
        if not n and tail == NO_BLOCK:
            return None, t.slots(rows, b""), None
        lease = self.leases.new("read", lease_ms, request_id)
        n_dram = self._pin_for_read(lease, rows)
        counters.tier_hits[DEVICE] += n - n_dram
        counters.tier_hits[DRAM] += n_dram
        slots = t.slots(rows, _PRESENT * n)
        if tail == NO_BLOCK:
            return lease, slots, None
        self._pin_for_read(lease, np.array([tail], np.int64))
        lease.tail_key = tail_key  # (a read lease: the tail it pins, consumed at release)
        return lease, slots, self.blocks.slot_ref(tail)

    def _pin_for_read(self, lease: Lease, rows: np.ndarray) -> int:
        """Pin blocks for a reader (out of the LRU while pinned; back at its recent end when
        unpinned); a DRAM hit is promoted once its last reader lets go. Returns the DRAM hits."""
        n_dram = self.blocks.pin(rows, for_read=True)
        lease.pinned = np.concatenate([lease.pinned, rows]) if len(lease.pinned) else rows
        self.counters.bytes_read += len(rows) * self.block_nbytes
        return n_dram

    # -- watch -----------------------------------------------------------------------------
    def watch(self, hashes: np.ndarray | Sequence[bytes], tail_key: bytes | None, lease_ms: int,
              request_id: str) -> Watcher:
        """Register interest; already-committed keys are queued at once, others on commit."""
        packed = pack(hashes)
        keys = [*unpack(packed), *([tail_key] if tail_key is not None else [])]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys repeat within one watch")
        lease = self.leases.new("read", lease_ms, request_id)
        lease.watching = True
        watcher = Watcher(lease, {k: i for i, k in enumerate(keys)})
        t = self.table
        rows = t.index.lookup(packed).tolist()
        if tail_key is not None:
            rows.append(t.tails.get(tail_key, NO_BLOCK))
        ready: list[int] = []
        for key, i in zip(keys, rows, strict=True):
            if i != NO_BLOCK and t.committed[i]:
                ready.append(i)
            else:
                self.watchers.wait(key, watcher)
        hits = len(ready) - (tail_key is not None and rows[-1] in ready)
        if ready:
            self._deliver(watcher, ready)
        self.counters.hits += hits
        self.index.looked_up(hits, 0)
        return watcher

    def _deliver(self, watcher: Watcher, rows: list[int]) -> None:
        self._pin_for_read(watcher.lease, np.array(rows, np.int64))
        for i in rows:
            ref = self.blocks.slot_ref(i)
            if self.table.is_tail[i]:
                watcher.lease.tail_key = ref.key  # (consumed at release, as a get's)
            watcher.queue.put_nowait((watcher.wanted.pop(ref.key), ref))

    def _notify(self, rows: list[int]) -> None:
        """Newly committed blocks: to each watcher waiting on them, in one delivery."""
        ready: dict[int, tuple[Watcher, list[int]]] = {}
        for i in rows:
            for watcher in self.watchers.take(self.table.key(i)):
                if watcher.lease.lease_id in self.leases:
                    ready.setdefault(id(watcher), (watcher, []))[1].append(i)
        for watcher, mine in ready.values():
            self._deliver(watcher, mine)

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
        t = self.table
        if lease.kind == "hold":  # (a block its writer failed to write went since: skipped)
            live = lease.held[(t.keys[lease.held] == lease.held_keys).all(axis=1) & ~t.is_tail[lease.held]]
            self.deferred(self.blocks.unpin, live)
            return len(live), 0
        if lease.kind == "write" and lease.hold_id in self.leases:
            self.release(lease.hold_id)  # the writer failed: nobody will read this handoff
        rows = lease.pinned  # each still here: pinned, so neither evicted nor dropped
        if lease.kind == "write":
            self.deferred(self.blocks.drop, rows)
            return 0, len(rows)
        consumed = lease.tail_key is not None and self.held_tails.pop(lease.tail_key, None) is not None
        self.deferred(self._unpin_read, rows, t.tails[lease.tail_key] if consumed else NO_BLOCK)
        return len(rows), 0

    def _unpin_read(self, rows: np.ndarray, consumed_tail: int) -> None:
        """A read lease's release, after its answer. A per-request tail is read once: its TTL
        pin goes with its reader's, and so does the tail."""
        if consumed_tail != NO_BLOCK:
            self.table.pins[consumed_tail] -= 1
        self.blocks.unpin(rows)

    def reap(self) -> int:
        """Lapse leases past their deadline and tails past their TTL; returns how many leases."""
        now = self.clock()
        lapsed = self.leases.lapsed(now)
        for lease_id in lapsed:
            self.release(lease_id)
        tails = [k for k, expires in self.held_tails.items() if expires < now]
        for key in tails:
            del self.held_tails[key]
        if tails:
            self.blocks.unpin(np.array([self.table.tails[k] for k in tails], np.int64))
        return len(lapsed)
