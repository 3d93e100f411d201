"""`python -m services.kvstore`: the KV store process."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections import Counter

import torch

from pdserve import logs
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.store_index import RedisIndex
from pdserve.kv.hashing import root_hash
from pdserve.kv.layout import HashProfile, KVLayout
from pdserve.kvclient.transfer import Transfer
from pdserve.model.config import parse_dtype
from pdserve.runtime import bind_host, gc_tuning
from pdserve.runtime.server import build_server
from pdserve.runtime.service import parse_config, pin_cpus, run, write_port_file
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.cluster import ClusterConfig, ClusterTier
from services.kvstore.config import KVStoreConfig
from services.kvstore.memory import TierMemory
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.store import BlockStore

log = logs.get("kvstore")


def hash_profile(cfg: KVStoreConfig) -> HashProfile:
    if cfg.kv_layout:
        parts = cfg.kv_layout.split(",")
        if len(parts) != 5:
            raise ValueError(f"--kv-layout wants 'layers,kv_heads,block_size,head_dim,dtype', got {cfg.kv_layout!r}")
        layers, heads, block, dim = (int(x) for x in parts[:4])
        return HashProfile(cfg.model_fingerprint, KVLayout(layers, heads, block, dim, parts[4]))
    from pdserve.engine.mock_runner import served_profile
    from pdserve.model.spec import describe

    return served_profile(describe(cfg.model, parse_dtype(cfg.dtype)), cfg.block_size, mock=cfg.engine == "mock")


async def main() -> None:
    cfg = parse_config(KVStoreConfig, "python -m services.kvstore")
    bind_host.require(cfg.te_host)
    pin_cpus(cfg.cpus)
    # The store's own copies move one block at a time (between tiers, into a staging buffer):
    # torch's OpenMP team split each and then spun waiting for the next, CPU taken from the
    # workers and the router on the same host (docs/perf-log.md, S39). One thread: no team.
    torch.set_num_threads(1)
    profile = hash_profile(cfg)
    block_nbytes = profile.layout.block_nbytes
    device = TierMemory("device", cfg.device_bytes // block_nbytes, block_nbytes)
    dram = TierMemory("dram", cfg.dram_bytes // block_nbytes, block_nbytes)
    transfer = Transfer(cfg.te_host, cfg.te_protocol)
    transfer.register(device.buffer)
    transfer.register(dram.buffer)
    cluster = None
    if cfg.cluster_store == "mooncake":
        cluster = ClusterTier(ClusterConfig(cfg.cluster_master, cfg.te_host, cfg.cluster_metadata,
                                            cfg.cluster_protocol, cfg.cluster_segment_bytes,
                                            cfg.cluster_buffer_bytes, cfg.cluster_timeout_ms / 1000),
                              root_hash(profile), block_nbytes)
    store = BlockStore(device, dram, default_lease_s=cfg.lease_ms / 1000, fence_s=cfg.fence_ms / 1000,
                       max_lease_s=cfg.max_lease_ms / 1000, max_leases_per_client=cfg.max_leases_per_client,
                       below=cluster.spill if cluster is not None else None)
    keys = RedisKeys.for_url(cfg.redis_url, cfg.key_prefix)
    index = RedisIndex(cfg.redis_url, keys, store.committed_blocks, node=cfg.node)
    store.index = index
    if cluster is not None:
        cluster.index = index
        index.cluster_capacity_blocks = cluster.capacity_blocks()
    # (abstract Unix sockets are Linux's; the name is unique to this process)
    unix = f"unix-abstract:pdserve-kvstore-{uuid.uuid4().hex}" if cfg.unix and sys.platform == "linux" else ""
    servicer = KVStoreServicer(store, profile, transfer.segment, device.info.kind, cfg.max_blocks_per_request,
                               redis_connected=lambda: index.connected, unix_address=unix, cluster=cluster,
                               node=cfg.node, calls=Counter())

    def register(server) -> list[str]:
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)
        return [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name]

    gc_tuning.tune()  # a store holds an object per block: default collections pause it for long
    handle = await build_server("kvstore", register, cfg.host, cfg.port, cfg.grace_s, also_at=(unix,) if unix else (),
                                calls=servicer.calls)
    stopped = handle.install_signal_handlers()
    index.start()
    reaper = asyncio.get_running_loop().create_task(_reap(store))
    log.info("kvstore ready", port=handle.port, unix_address=unix, segment=transfer.segment,
             block_nbytes=block_nbytes, device_blocks=device.info.num_slots, device_kind=device.info.kind,
             dram_blocks=dram.info.num_slots, layout=profile.layout.describe())
    await handle.set_serving()
    write_port_file(cfg.port_file, handle.port)
    await stopped.wait()
    reaper.cancel()
    if cluster is not None:
        cluster.close()
    try:
        await asyncio.wait_for(index.stop(), timeout=2.0)  # a last flush; Redis may be gone
    except TimeoutError:
        log.warning("redis index did not close in time")


async def _reap(store: BlockStore) -> None:
    while True:
        await asyncio.sleep(0.1)
        try:
            lapsed = store.reap()
        except Exception:  # noqa: BLE001 - a reaper that died would strand every lease after it
            log.exception("reaping leases failed; trying again")
            continue
        if lapsed:
            log.info("leases lapsed", count=lapsed)


if __name__ == "__main__":
    run("kvstore", main)
