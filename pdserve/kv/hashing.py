"""The one block-hash function. Router, prefill, decode and store all call `block_hashes`.

hash(block) = H(parent_hash, token ids of the block, extra), a chain over full blocks only.
The chain's root is derived from the hash profile (model fingerprint, KV layout incl. dtype and
block size), so two workers with different profiles never produce the same hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

from pdserve.kv.layout import HashProfile

BlockHash = NewType("BlockHash", bytes)  # 16 bytes
HASH_BYTES = 16
_DOMAIN = b"pdserve.block.v1"


def root_hash(profile: HashProfile) -> BlockHash:
    return BlockHash(hashlib.blake2b(_DOMAIN + profile.key().encode(), digest_size=HASH_BYTES).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


def block_hashes(
    token_ids: Sequence[int],
    profile: HashProfile,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, from block index `start` on.

    `parent` must be the hash of block `start - 1` (or None when start == 0).
    """
    if (start == 0) != (parent is None):
        raise ValueError("block_hashes: pass the parent hash exactly when start > 0")
    bs = profile.block_size
    prev = parent if parent is not None else root_hash(profile)
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) // bs):
        prev = hash_block(prev, token_ids[i * bs : (i + 1) * bs])
        out.append(prev)
    return out
