"""Prefix-index change events: what the index writers (each prefill worker, the store) append to
one Redis stream beside each change they make to their index key, so routers can mirror the
index in memory instead of asking Redis on every request (as Dynamo's KV router is fed by KV
events). Redis keeps the truth; a mirror that misses an event re-reads the owner's key.

An event is a delta (hashes added, hashes removed) or a reset ("re-read my key": sent when the
owner rewrote its whole key). Each owner numbers its events; a gap tells the mirror it missed one.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio.client import Pipeline

from pdserve.cluster.keys import INDEX_EVENTS_MAXLEN, INDEX_TTL_S, RedisKeys

HASH_BYTES = 16  # block hashes are 16 bytes; events carry them packed, back to back
STORE_OWNER = "store:"  # + node: a store node's own tiers
CLUSTER_OWNER = "cluster:"  # + node: that node's changes to the (shared) cluster index
WORKER_OWNER = "worker:"


def worker_owner(worker_id: str) -> str:
    return WORKER_OWNER + worker_id


def store_owner(node: str) -> str:
    return STORE_OWNER + node


def cluster_owner(node: str) -> str:
    return CLUSTER_OWNER + node


@dataclass(frozen=True)
class IndexEvent:
    owner: str  # store_owner(node), cluster_owner(node) or worker_owner(id)
    seq: int  # per owner, +1 per event; restarts with the owner (whose first event is a reset)
    reset: bool  # the owner rewrote its key: re-read it whole
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()

    def fields(self) -> dict[str, bytes | str | int]:
        return {"owner": self.owner, "seq": self.seq, "reset": int(self.reset),
                "added": _pack(self.added), "removed": _pack(self.removed)}

    @classmethod
    def parse(cls, fields: dict[bytes, bytes]) -> IndexEvent:
        return cls(fields[b"owner"].decode(), int(fields[b"seq"]), fields[b"reset"] == b"1",
                   _unpack(fields[b"added"]), _unpack(fields[b"removed"]))


def _pack(hashes: tuple[bytes, ...]) -> bytes:
    """Only block hashes: the store also indexes per-request tail keys, which no router looks up."""
    return b"".join(h for h in hashes if len(h) == HASH_BYTES)


def _unpack(data: bytes) -> tuple[bytes, ...]:
    if len(data) % HASH_BYTES:
        raise ValueError(f"index event of {len(data)} bytes is not a run of {HASH_BYTES}-byte hashes")
    return tuple(data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES))


class EventWriter:
    """Numbers one owner's events and queues each on the pipeline that changes its key (a
    transaction, so a mirror that snapshots the key and then tails the stream sees each change
    once, in order)."""

    def __init__(self, keys: RedisKeys, owner: str):
        self.keys = keys
        self.owner = owner
        self._seq = 0

    def take_seq(self) -> int:
        """The next event's number, for a writer that appends the event itself (a script)."""
        self._seq += 1
        return self._seq

    def queue(self, pipe: Pipeline, *, reset: bool = False, added=(), removed=()) -> None:
        event = IndexEvent(self.owner, self.take_seq(), reset, tuple(added), tuple(removed))
        pipe.xadd(self.keys.index_events(), event.fields(), maxlen=INDEX_EVENTS_MAXLEN, approximate=True)
        pipe.expire(self.keys.index_events(), INDEX_TTL_S)  # (a deployment that is gone leaves no stream)
