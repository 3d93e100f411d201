"""The block store against a reference model of its eviction rules, applied one block at a time
(the store works a call's blocks out at once: demotions into a full DRAM tier, copies first,
promotions on release). Random puts, gets and releases; after each, both must hold the same
blocks in the same tiers and the same eviction orders, exactly."""

from __future__ import annotations

import random

import pytest

from pdserve.kv.checksum import checksum_of
from services.kvstore.memory import TierMemory
from services.kvstore.store import DEVICE, DRAM, BlockStore, SlotState


class ReferenceTiers:
    """The rules, one block at a time, over keys (a model for this test, not the store's code)."""

    def __init__(self, device: int, dram: int):
        self.free = {DEVICE: device, DRAM: dram}
        self.tier: dict[bytes, str] = {}
        self.copy: dict[bytes, bool] = {}
        self.order = {DEVICE: ([], []), DRAM: ([], [])}  # per tier: copies, the rest (first to evict first)

    def ids(self, tier: str) -> list[bytes]:
        return [*self.order[tier][0], *self.order[tier][1]]

    def _append(self, key: bytes) -> None:
        self.order[self.tier[key]][0 if self.copy[key] else 1].append(key)

    def _remove(self, key: bytes) -> None:
        for queue in self.order[self.tier[key]]:
            if key in queue:
                queue.remove(key)

    def _pop(self, tier: str) -> bytes:
        copies, rest = self.order[tier]
        return copies.pop(0) if copies else rest.pop(0)

    def _drop(self, key: bytes) -> None:
        self.free[self.tier.pop(key)] += 1
        del self.copy[key]

    def put(self, keys: list[bytes], copy: bool) -> None:
        """Pin the blocks here already, place the new ones, let go; an offload (not a copy) makes
        the present ones the store's own, most recently used."""
        present = [k for k in keys if k in self.tier]
        for key in present:
            self._remove(key)
        new = [k for k in keys if k not in self.tier]
        self._place(new, copy)
        for key in present:
            self._append(key)
        if not copy:
            for key in present:
                self._remove(key)
                self.copy[key] = False
                self._append(key)
        for key in new:  # committed
            self._append(key)

    def _place(self, keys: list[bytes], copy: bool) -> None:
        n, free = len(keys), self.free
        if free[DEVICE] >= n:
            where = [DEVICE] * n
        else:
            room_dram = free[DRAM] + len(self.ids(DRAM))
            n_dev = min(n, free[DEVICE] + len(self.ids(DEVICE)))
            while free[DEVICE] < n_dev:
                victim = self._pop(DEVICE)
                if room_dram == 0:
                    self._drop(victim)
                    continue
                if free[DRAM] == 0:
                    self._drop(self._pop(DRAM))
                free[DEVICE] += 1
                free[DRAM] -= 1
                self.tier[victim] = DRAM
                self._append(victim)
            while free[DRAM] < n - n_dev:
                self._drop(self._pop(DRAM))
            where = [DEVICE] * n_dev + [DRAM] * (n - n_dev)
        for key, tier in zip(keys, where, strict=True):
            self.tier[key], self.copy[key] = tier, copy
            free[tier] -= 1

    def read(self, keys: list[bytes]) -> None:
        """Pinned by a reader, then released: back at the recent end; a DRAM hit is promoted."""
        for key in keys:
            self._remove(key)
        for key in keys:
            self._append(key)
            if self.tier[key] == DRAM and (self.free[DEVICE] or self.ids(DEVICE)):
                self._remove(key)
                if self.free[DEVICE]:
                    self.free[DEVICE] -= 1
                    self.free[DRAM] += 1
                else:
                    victim = self._pop(DEVICE)
                    self.tier[victim] = DRAM
                    self._append(victim)
                self.tier[key] = DEVICE
                self._append(key)


@pytest.mark.parametrize("seed", range(12))
def test_the_store_evicts_demotes_and_promotes_exactly_as_the_reference(seed):
    """The reference above is the store's specification: after every step, the same blocks in
    the same tiers and the same eviction orders, every slot either free or a block's, no pins."""
    rng = random.Random(seed)
    device, dram = rng.choice([(8, 4), (16, 0), (12, 12), (6, 20)])
    store = BlockStore(TierMemory("device", device, 8), TierMemory("dram", dram, 8))
    model = ReferenceTiers(device, dram)
    chains: list[list[bytes]] = []
    for step in range(300):
        if chains and rng.random() < 0.4:
            chain = rng.choice(chains)
            prefix = []
            for key in chain:  # the longest prefix stored
                if key not in model.tier:
                    break
                prefix.append(key)
            lease, blocks, _ = store.get("r", chain, None, 0, "r")
            assert [b.key for b in blocks] == prefix
            if lease is not None:
                store.release("r", lease.lease_id)
            model.read(prefix)
        else:
            n = rng.randint(1, min(device + dram, 10))
            chain = [bytes([seed, step % 256, step // 256, i]) * 4 for i in range(n)]
            if chains and rng.random() < 0.3:  # a longer prompt over a stored one (some of it gone)
                old = rng.choice(chains)
                kept = rng.randint(1, min(len(old), device + dram - 1))
                chain = old[:kept] + chain[: device + dram - kept]  # (never more than the store holds)
            copy = rng.random() < 0.5
            lease, slots = store.allocate_put("w", chain, None, 0, "w", writer_keeps_copy=copy)
            new = [s.block for s in slots if s.state == SlotState.WRITE]
            if new:
                sums = [checksum_of(store.blocks.view(b)) for b in new]
                store.commit("w", lease.lease_id, [b.key for b in new], sums)
            model.put(chain, copy)
            chains.append(chain)
        blocks = store.blocks.blocks()
        assert {b.key: b.tier for b in blocks} == model.tier, step
        for tier in (DEVICE, DRAM):
            assert store.blocks.order(tier) == model.ids(tier), (step, tier)
            slots = sorted(b.slot for b in blocks if b.tier == tier)
            assert len(set(slots)) == len(slots) and store.tiers[tier].allocator.num_free == model.free[tier]
        assert all(b.pins == 0 and b.committed for b in blocks) and len(store.leases) == 0
