"""Cluster-tier rows of `pdserve bench kvstore --cluster`: the store's cluster tier against a raw
`MooncakeDistributedStore` moving the same bytes, in the same run, at the same layout.

Both run in this process and move blocks into (and back from) the segment a second process lends
the cluster, with a real `mooncake_master`. Tier put = `spill` of each block (the copy into the
registered staging buffer and its checksum trailer) until the tier's put thread has stored them
all (`batch_put_from`, batches of 64); tier get = `fetch` of the chain in rounds (a quarter of the
staging buffer each, as the store asks) with every block verified against its trailer. Raw = one
`batch_put_from` / `batch_get_into` of the same blocks from a registered buffer, nothing else.
Fresh keys each repeat (a key already there is not written again), removed afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import time

import torch

from pdserve.kv.checksum import checksums_at
from pdserve.kv.hashing import root_hash
from pdserve.kv.layout import HashProfile
from pdserve.runtime.launch import MooncakeMaster, die_with_parent

GB = 1e9

# The process lending the cluster its segment: sets a client up and waits to be told to stop.
_SEGMENT_HOLDER = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("ready" if rc == 0 else f"failed {rc}", flush=True)
sys.stdin.read()
"""


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{os.getpid()}:{tag}:{i}".encode(), digest_size=16).digest() for i in range(n)]


def _raw_client(master: str, buffer: torch.Tensor):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
        raise RuntimeError("raw mooncake client setup failed")
    if client.register_buffer(buffer.data_ptr(), buffer.numel()) != 0:
        raise RuntimeError("raw mooncake client: registering its buffer failed")
    return client


async def _tier_put(tier, hashes: list[bytes], blocks: torch.Tensor, sums: list[int]) -> float:
    done0 = tier.counters.spilled + tier.counters.put_failures
    t0 = time.perf_counter()
    for h, block, s in zip(hashes, blocks, sums, strict=True):
        tier.spill(h, s, block)
    while tier.counters.spilled + tier.counters.put_failures - done0 < len(hashes):
        await asyncio.sleep(0.0005)
    elapsed = time.perf_counter() - t0
    if tier.counters.put_failures:
        raise RuntimeError(f"cluster tier: {tier.counters.put_failures} puts failed")
    return elapsed


async def _tier_get(tier, hashes: list[bytes]) -> float:
    t0 = time.perf_counter()
    got = 0
    while got < len(hashes):
        run = await tier.fetch(hashes[got:])
        if not run:
            raise RuntimeError(f"cluster tier: fetched {got} of {len(hashes)} blocks")
        got += len(run)
        tier.done_with(run)
    return time.perf_counter() - t0


async def _row(tier, raw, raw_buf: torch.Tensor, profile: HashProfile, tokens: int, repeats: int) -> dict:
    lay = profile.layout
    n = tokens // lay.block_size
    nbytes = lay.block_nbytes
    blocks = raw_buf[: n * nbytes].view(n, nbytes)
    blocks.copy_(torch.randint(0, 256, (n, nbytes), dtype=torch.uint8))
    addrs = [blocks.data_ptr() + i * nbytes for i in range(n)]
    sums = checksums_at(addrs, nbytes)
    tier_put, tier_get, raw_put, raw_get = [], [], [], []
    for r in range(repeats):
        hashes, raw_keys = _keys(f"tier{tokens}:{r}", n), [k.hex() for k in _keys(f"raw{tokens}:{r}", n)]
        # Alternating which goes first: neither always finds the segment warmer.
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                tier_put.append(await _tier_put(tier, hashes, blocks, sums))
                tier_get.append(await _tier_get(tier, hashes))
            else:
                t0 = time.perf_counter()
                codes = raw.batch_put_from(raw_keys, addrs, [nbytes] * n)
                raw_put.append(time.perf_counter() - t0)
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"raw put failed: {sorted(set(codes))}")
                t0 = time.perf_counter()
                sizes = raw.batch_get_into(raw_keys, addrs, [nbytes] * n)
                raw_get.append(time.perf_counter() - t0)
                if any(s != nbytes for s in sizes):
                    raise RuntimeError(f"raw get failed: {sorted(set(sizes))}")
        for key in [tier.key(h) for h in hashes] + raw_keys:
            raw.remove(key, True)
    total = n * nbytes
    med = statistics.median
    row = {"layout": "7b" if lay.num_layers == 32 else "tiny", "tokens": tokens, "blocks": n, "bytes": total,
           "repeats": repeats, "torch_threads": torch.get_num_threads(),
           "tier_put_gbps": total / med(tier_put) / GB, "tier_get_gbps": total / med(tier_get) / GB,
           "raw_put_gbps": total / med(raw_put) / GB, "raw_get_gbps": total / med(raw_get) / GB}
    row["put_vs_raw"] = row["tier_put_gbps"] / row["raw_put_gbps"]
    row["get_vs_raw"] = row["tier_get_gbps"] / row["raw_get_gbps"]
    return row


async def _rows(profile: HashProfile, tokens_list: list[int], repeats: int, master: str) -> list[dict]:
    from services.kvstore.cluster import ClusterConfig, ClusterTier, object_nbytes

    lay = profile.layout
    most = max(tokens_list) // lay.block_size
    staging = (most + 1) * object_nbytes(lay.block_nbytes)
    tier = ClusterTier(ClusterConfig(master, "127.0.0.1", "P2PHANDSHAKE", "tcp", 0, staging, 30.0),
                       root_hash(profile), lay.block_nbytes)
    raw_buf = torch.zeros(most * lay.block_nbytes, dtype=torch.uint8)
    raw = _raw_client(master, raw_buf)
    try:
        deadline = time.monotonic() + 60
        while not tier.connected:
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster tier did not connect to the master")
            await asyncio.sleep(0.05)
        return [await _row(tier, raw, raw_buf, profile, t, repeats) for t in tokens_list]
    finally:
        tier.close()


def per_token_costs(cluster: list[dict], store_rows: list[dict]) -> None:
    """Adds to each cluster row what a token's KV costs to get, in microseconds: from the cluster
    tier, and from a node's own store (its row of the same layout and size, same run). What
    recomputing it costs is measured beside them (recompute_cost.py); `pdserve bench compare
    --store-nodes` reports the router's fitted figures for all three."""
    for r in cluster:
        per_token = r["bytes"] / r["tokens"]
        r["cluster_get_us_per_token"] = per_token / (r["tier_get_gbps"] * GB) * 1e6
        local = next((s for s in store_rows if (s["layout"], s["tokens"]) == (r["layout"], r["tokens"])), None)
        if local is not None:
            r["store_get_us_per_token"] = per_token / (local["store_get_gbps"] * GB) * 1e6


def cluster_rows(profile: HashProfile, tokens_list: list[int], repeats: int) -> list[dict]:
    """The rows, with a master and a segment holder of their own (stopped before returning)."""
    from services.kvstore.cluster import object_nbytes

    lay = profile.layout
    segment = max(256 << 20, 3 * max(tokens_list) // lay.block_size * object_nbytes(lay.block_nbytes))
    master = MooncakeMaster().start()
    threads = torch.get_num_threads()
    holder = subprocess.Popen([*die_with_parent(), sys.executable, "-c", _SEGMENT_HOLDER, master.address, str(segment)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = holder.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the segment holder did not start: {line!r}")
        # The tier copies blocks into its staging buffer with torch on one thread, as in the store
        # process (services/kvstore/__main__.py says why); a copy team of two here slowed the
        # tier's own puts (docs/perf-log.md, S47).
        torch.set_num_threads(1)
        return asyncio.run(_rows(profile, tokens_list, repeats, master.address))
    finally:
        torch.set_num_threads(threads)
        holder.stdin.close()
        holder.terminate()
        holder.wait(10)
        master.stop()
