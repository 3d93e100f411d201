"""The block checksum every writer sends and every reader verifies: xxh3-64 of a block's bytes.

One pass at memory speed (about 11 GB/s on one core here, the same as the hand-written C sum it
replaces), from a well-kept library, and the GIL is released while it runs, so a checksum can
overlap a transfer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import xxhash


def checksum_of(block: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes."""
    return xxhash.xxh3_64_intdigest(block.view(torch.uint8).numpy())


def checksum_at(address: int, nbytes: int) -> int:
    """xxh3-64 of `nbytes` of this process's memory at `address` (a registered buffer's block)."""
    return xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(address))


def checksums_at(addresses: Sequence[int], nbytes: int) -> list[int]:
    return [checksum_at(a, nbytes) for a in addresses]


def mismatches(addresses: Sequence[int], nbytes: int, expected: Sequence[int]) -> list[int]:
    """Positions of the blocks whose bytes fail their expected checksum."""
    return [i for i, (a, c) in enumerate(zip(addresses, expected, strict=True)) if checksum_at(a, nbytes) != c]
