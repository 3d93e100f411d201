"""The cluster tier below DRAM: a Mooncake Store shared by every store node.

Blocks leaving this node's DRAM tier are copied into a registered staging buffer and written to
the cluster (`batch_put_from`) by a thread of their own; a get whose hash chain runs past the
local tiers fetches the rest (`batch_get_into`, into the same staging buffer) and the store
imports what verifies into local slots. Keys are `pdserve/<profile root>/<block hash>`: two
models or KV layouts never share one. Each object is the block's bytes, then a trailer: the
block's hash, the writer's checksum of the bytes and a seal of those two (write_trailer), then
zeros to a multiple of OBJECT_ALIGN. A fetched object is served only if it is the block asked
for, whole: its trailer names the key's hash, its seal holds and its bytes match the checksum,
which the store then records for the block. The hash is what ties an object to its key: a read
that outlives the master's object lease may find the memory reused by another key's put (every
object has one size), and that object is whole and self-consistent.

Nothing here waits on the cluster on the event loop's behalf: a spill with no staging room is
dropped (counted), a get's fetches are bounded together (`deadline`: `timeout_s`, or sooner its
caller's own deadline) and past it answer a miss, and a master that is
down or not up yet is a miss for every fetch until the client reaches it again: after a get the
master failed to answer, or one still running past its timeout, gets skip the cluster (a miss,
at once) rather than queue behind it.

Owns the Mooncake client, the staging buffer and its free list, the two threads that call the
client (its calls block) and the cluster counters.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import queue
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from pdserve import logs
from pdserve.kv.checksum import checksum_at
from pdserve.kv.hashing import HASH_BYTES
from pdserve.runtime import bind_host

log = logs.get("kvstore.cluster")

_NAMED = struct.Struct(f"<{HASH_BYTES}sQ")  # the trailer's block hash and checksum; then the seal (8 bytes)
TRAILER = _NAMED.size + 8  # 32 bytes after each object's block bytes
# Each object is padded to a multiple of this: mooncake_master refuses some puts of other sizes as
# a segment fills (4,000 spills into one 64 MiB segment: 64 KiB + 8-byte objects 8.3-8.6% refused,
# the newest blocks lost; padded to 2 KiB 0.2%; to 4 KiB none; docs/perf-log.md, S28).
OBJECT_ALIGN = 4096
RPC_FAIL = -900  # Mooncake's code for a master that did not answer
NOT_FOUND = -704  # Mooncake's code for a key it does not hold
BATCH, BATCH_WAIT_S = 64, 0.002  # a put carries up to BATCH blocks, waiting this long between arrivals
MASTER_HIGH_WATERMARK = 0.9  # mooncake_master evicts past this share of a segment (its default)
RETRY_S = 1.0  # after the master failed to answer a get, gets skip the cluster this long
ERROR_LOG_S = 10.0  # a failed fetch is logged at most this often
REPLY_MARGIN_S = 0.25  # a get stops waiting on the cluster this long before its caller's deadline


def object_nbytes(block_nbytes: int) -> int:
    """An object's size in the cluster: the block's bytes, its trailer, zeros to OBJECT_ALIGN."""
    return -(-(block_nbytes + TRAILER) // OBJECT_ALIGN) * OBJECT_ALIGN


def blocks_held(segment_bytes: int, block_nbytes: int) -> int:
    """How many blocks a segment of `segment_bytes` holds before the master evicts (it starts at
    MASTER_HIGH_WATERMARK full): objects are block_nbytes rounded up (object_nbytes)."""
    return int(segment_bytes * MASTER_HIGH_WATERMARK) // object_nbytes(block_nbytes)


def segment_bytes_holding(blocks: int, block_nbytes: int) -> int:
    """The smallest segment that holds `blocks` blocks before the master evicts (blocks_held's inverse)."""
    return math.ceil((blocks * object_nbytes(block_nbytes) + 1) / MASTER_HIGH_WATERMARK)


def object_key(profile_root: bytes, block_hash: bytes) -> str:
    """A block's key in the cluster: the hash profile's root (model and KV layout), then the hash."""
    return f"pdserve/{profile_root.hex()[:16]}/{block_hash.hex()}"


def write_trailer(address: int, block_nbytes: int, block_hash: bytes, checksum: int) -> None:
    """Seal the object at `address` (its block's bytes in place): the block's hash and checksum,
    then the seal, a checksum of those two (a read torn between two objects' trailers fails it)."""
    at = address + block_nbytes
    _NAMED.pack_into((ctypes.c_char * _NAMED.size).from_address(at), 0, block_hash, checksum)
    struct.pack_into("<Q", (ctypes.c_char * 8).from_address(at + _NAMED.size), 0, checksum_at(at, _NAMED.size))


def read_trailer(address: int, block_nbytes: int) -> tuple[bytes, int] | None:
    """The (block hash, checksum) the object at `address` was sealed with; None if its seal fails."""
    at = address + block_nbytes
    (seal,) = struct.unpack("<Q", ctypes.string_at(at + _NAMED.size, 8))
    if checksum_at(at, _NAMED.size) != seal:
        return None
    block_hash, checksum = _NAMED.unpack(ctypes.string_at(at, _NAMED.size))
    return block_hash, checksum


@dataclass(frozen=True)
class ClusterConfig:
    master: str  # host:port of mooncake_master
    local_host: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    segment_bytes: int = 0  # memory this node gives the cluster (0: it only uses it)
    buffer_bytes: int = 64 << 20  # the staging buffer, shared by spills and fetches
    timeout_s: float = 2.0  # longest a get waits on the cluster, all its fetches together


@dataclass
class ClusterCounters:
    """Each count has one writer: `spill_dropped`, `fetch_timeouts` and `unreachable` the event
    loop, `spilled` and `put_failures` the put thread, the fetch figures the get thread.
    `connected`: set up, and the master answered the last call that says (a get, a write that
    landed or failed RPC_FAIL: a write refused otherwise leaves it as it was)."""

    connected: bool = False
    spilled: int = 0  # blocks written to the cluster
    put_failures: int = 0  # writes the cluster refused (full, no handle, master down)
    spill_dropped: int = 0  # blocks not written: no staging room, or not connected
    fetched: int = 0  # blocks fetched and verified
    fetch_misses: int = 0  # blocks asked for and not there (or not reachable)
    fetch_timeouts: int = 0
    corrupt: int = 0  # fetched objects refused (not the key's block, or failing their checksum): removed there
    unreachable: int = 0  # gets that found the cluster not connected (not asked)
    fetch_errors: int = 0  # fetches that ended on a failure other than NOT_FOUND (logged with its code)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Fetched:
    """One verified block in the staging buffer, until `ClusterTier.done_with` returns it."""

    key: bytes
    checksum: int
    view: torch.Tensor
    slot: int


class ClusterTier:
    def __init__(self, cfg: ClusterConfig, profile_root: bytes, block_nbytes: int, client=None):
        self.cfg = cfg
        self.block_nbytes = block_nbytes
        self.stride = object_nbytes(block_nbytes)
        self.profile_root = profile_root
        self.counters = ClusterCounters()
        n = cfg.buffer_bytes // self.stride
        if n < 2:
            raise ValueError(f"--cluster-buffer-bytes {cfg.buffer_bytes} holds fewer than 2 blocks of "
                             f"{block_nbytes} bytes")
        self.staging = torch.zeros(n * self.stride, dtype=torch.uint8)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            self._free.put(i)
        self.num_slots = n
        self._client = client  # set once connected
        self._writes: queue.SimpleQueue[tuple[bytes, int] | None] = queue.SimpleQueue()
        self.index = None  # a ClusterSink (the node's RedisIndex): told what was written and what missed
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="cluster-get")
        self._closed = threading.Event()
        self._stuck = None  # a get that ran past its timeout and has not returned: gets skip the cluster
        self._skip_until = 0.0  # (monotonic) the master failed a get: gets skip the cluster until then
        self._error_logged = -ERROR_LOG_S  # (monotonic) when a failed fetch was last logged
        threading.Thread(target=self._write_loop, name="cluster-put", daemon=True).start()
        if client is None:
            threading.Thread(target=self._connect_loop, name="cluster-connect", daemon=True).start()
        else:
            self._ready(client)

    def capacity_blocks(self) -> int:
        """How many blocks this node's segment holds before the master evicts."""
        return blocks_held(self.cfg.segment_bytes, self.block_nbytes)

    def key(self, block_hash: bytes) -> str:
        return object_key(self.profile_root, block_hash)

    def _address(self, slot: int) -> int:
        return self.staging.data_ptr() + slot * self.stride

    def _view(self, slot: int) -> torch.Tensor:
        return self.staging[slot * self.stride : slot * self.stride + self.block_nbytes]

    # -- connecting ------------------------------------------------------------------------
    def _connect_loop(self) -> None:
        """Set the client up, retrying until the master answers (setup itself waits a while)."""
        from mooncake.store import MooncakeDistributedStore

        while not self._closed.is_set():
            client = MooncakeDistributedStore()
            with bind_host.confined(self.cfg.local_host):  # its transfer engine's ports on the host
                rc = client.setup(self.cfg.local_host, self.cfg.metadata_server, self.cfg.segment_bytes,
                                  16 << 20, self.cfg.protocol, "", self.cfg.master)
            if rc == 0:
                self._ready(client)
                return
            log.warning("cluster client setup failed (master unreachable, or see its log above); local tiers "
                        "serve alone meanwhile, retrying", master=self.cfg.master, rc=rc)
            self._closed.wait(1.0)

    def _ready(self, client) -> None:
        rc = client.register_buffer(self.staging.data_ptr(), self.staging.numel())
        if rc != 0:
            raise RuntimeError(f"cluster: registering the staging buffer failed ({rc})")
        self._client = client
        self.counters.connected = True
        log.info("cluster tier connected", master=self.cfg.master, staging_blocks=self.num_slots,
                 segment_bytes=self.cfg.segment_bytes)

    @property
    def connected(self) -> bool:
        return self._client is not None

    def close(self) -> None:
        self._closed.set()
        self._writes.put(None)
        self._reads.shutdown(wait=False, cancel_futures=True)

    # -- writing ---------------------------------------------------------------------------
    def spill(self, block_hash: bytes, checksum: int, view: torch.Tensor) -> None:
        """A committed block leaving DRAM: staged and queued for the cluster, or dropped (counted)
        when not connected or the staging buffer is full. Never waits."""
        if self._client is None:
            self.counters.spill_dropped += 1
            return
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            self.counters.spill_dropped += 1
            return
        self._view(slot).copy_(view)
        write_trailer(self._address(slot), self.block_nbytes, block_hash, checksum)
        self._writes.put((block_hash, slot))

    def _write_loop(self) -> None:
        while True:
            first = self._writes.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < BATCH:
                try:  # (a spill is off every request's path: waiting a moment for a fuller batch is free)
                    item = self._writes.get(timeout=BATCH_WAIT_S)
                except queue.Empty:
                    break
                if item is None:
                    self._writes.put(None)
                    break
                batch.append(item)
            hashes, slots = [h for h, _ in batch], [s for _, s in batch]
            keys = [self.key(h) for h in hashes]
            try:
                codes = self._client.batch_put_from(keys, [self._address(s) for s in slots], [self.stride] * len(slots))
            except Exception:  # noqa: BLE001 - a failed write is a dropped block, never a stuck thread
                log.exception("cluster put failed")
                codes = [-1] * len(keys)
            finally:
                for s in slots:
                    self._free.put(s)
            ok = sum(c == 0 for c in codes)
            if RPC_FAIL in codes or ok:
                self.counters.connected = RPC_FAIL not in codes
            self.counters.spilled += ok
            self.counters.put_failures += len(codes) - ok
            if self.index is not None and ok:
                self.index.cluster_stored([h for h, c in zip(hashes, codes, strict=True) if c == 0])

    # -- reading ---------------------------------------------------------------------------
    def deadline(self, time_remaining: float | None) -> float:
        """When a get stops waiting on the cluster (monotonic), however many fetches it makes:
        `timeout_s` from now, or REPLY_MARGIN_S before its caller's deadline (`time_remaining`
        seconds from now; None: none) if that comes first, so the cluster costs a miss, never the get."""
        timeout_s = self.cfg.timeout_s
        if time_remaining is not None:
            timeout_s = min(timeout_s, time_remaining - REPLY_MARGIN_S)
        return time.monotonic() + timeout_s

    async def fetch(self, hashes: Sequence[bytes], deadline: float | None = None) -> list[Fetched]:
        """The leading run of `hashes` the cluster holds and that verifies, staged here until
        `done_with`. At most the staging buffer's worth (a quarter of it: spills keep room).
        Nothing (a timeout) once `deadline` (monotonic; None: `timeout_s` from now) has passed."""
        if not hashes:
            return []
        if self._client is None or (self._stuck is not None and not self._stuck.done()) or (
                time.monotonic() < self._skip_until):
            self.counters.unreachable += 1
            return []
        wait_s = (deadline if deadline is not None else time.monotonic() + self.cfg.timeout_s) - time.monotonic()
        if wait_s <= 0:
            self.counters.fetch_timeouts += 1
            return []
        slots = []
        for _ in range(min(len(hashes), max(1, self.num_slots // 4))):
            try:
                slots.append(self._free.get_nowait())
            except queue.Empty:
                break
        if not slots:
            return []
        job = self._reads.submit(self._get, list(hashes[: len(slots)]), slots)
        try:
            run = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), wait_s)
        except TimeoutError:
            self.counters.fetch_timeouts += 1
            job.add_done_callback(lambda _: self._give_back(slots))  # the thread may still write into them
            if not job.cancel():  # running (a queued one never runs, holding slots, behind a hung read)
                self._stuck = job
            return []
        except BaseException:
            job.add_done_callback(lambda _: self._give_back(slots))
            raise
        self._give_back(slots[len(run):])
        return run

    def _get(self, hashes: list[bytes], slots: list[int]) -> list[Fetched]:
        """On the read thread: fetch, then verify each object is its key's block, whole."""
        keys = [self.key(h) for h in hashes]
        try:
            sizes = self._client.batch_get_into(keys, [self._address(s) for s in slots], [self.stride] * len(slots))
        except Exception:  # noqa: BLE001
            log.exception("cluster get failed")
            sizes = [RPC_FAIL] * len(keys)
        if sizes and sizes[0] == RPC_FAIL:
            self._skip_until = time.monotonic() + RETRY_S
        self.counters.connected = not sizes or sizes[0] != RPC_FAIL
        out: list[Fetched] = []
        if self.index is not None:  # not there (a failed call says nothing of what is)
            self.index.cluster_missing([h for h, size in zip(hashes, sizes, strict=True) if size == NOT_FOUND])
        for h, key, slot, size in zip(hashes, keys, slots, sizes, strict=True):
            if size != self.stride:
                self.counters.fetch_misses += len(hashes) - len(out)
                if size != NOT_FOUND:
                    self._fetch_failed(key, size)
                break
            address = self._address(slot)
            checksum = checksum_at(address, self.block_nbytes)
            sealed = read_trailer(address, self.block_nbytes)
            if sealed != (h, checksum):
                self.counters.corrupt += 1
                self.counters.fetch_misses += len(hashes) - len(out) - 1
                log.warning("an object fetched from the cluster was refused: removed there", key=key,
                            why="torn trailer" if sealed is None else "another block's object" if sealed[0] != h
                            else "bytes failing their checksum")
                self._client.remove(key, True)
                if self.index is not None:
                    self.index.cluster_missing([h])
                break
            out.append(Fetched(h, checksum, self._view(slot), slot))
        self.counters.fetched += len(out)
        if self.index is not None and out:  # (read recently: the master evicts it later, as the index trims)
            self.index.cluster_stored([f.key for f in out])
        return out

    def _fetch_failed(self, key: str, code: int) -> None:
        """A read that failed for another reason than the key not being there: counted, and
        logged (at most every ERROR_LOG_S) with Mooncake's code, as a miss hides it otherwise."""
        self.counters.fetch_errors += 1
        now = time.monotonic()
        if now - self._error_logged >= ERROR_LOG_S:
            self._error_logged = now
            log.warning("a cluster fetch failed: counted as a miss", key=key, code=code,
                        errors=self.counters.fetch_errors)

    def done_with(self, run: Sequence[Fetched]) -> None:
        """The store has copied these out: their staging slots are free again."""
        self._give_back([f.slot for f in run])

    def _give_back(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._free.put(s)
