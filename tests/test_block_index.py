"""The store's hash index: the C table against the dict one, key by key, through churn at full
load (linear probing's deletions shift entries back: a wrong shift loses or misfiles keys)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.kvstore.block_index import DictBlockIndex, NativeBlockIndex
from services.kvstore.table import pack


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2  # structured, not random: the mixing must spread them


def test_the_c_index_answers_as_the_dict_one_through_churn_at_full_load():
    rng = random.Random(7)
    capacity = 500
    native, ref = NativeBlockIndex(capacity), DictBlockIndex(capacity)
    universe = [_key(i) for i in range(2000)]
    held: set[bytes] = set()
    for _ in range(400):
        probe = rng.sample(universe, 64)
        assert native.lookup(pack(probe)).tolist() == ref.lookup(pack(probe)).tolist()
        rows, found = native.lookup_unique(pack(probe))  # (a sample: no repeats)
        assert rows.tolist() == ref.lookup(pack(probe)).tolist() and found == len(held & set(probe))
        op = rng.random()
        if op < 0.45 and len(held) < capacity:
            new = [k for k in rng.sample(universe, 80) if k not in held][: capacity - len(held)]
            rows = np.array([rng.randrange(10**6) for _ in new], np.int64)
            native.insert(pack(new), rows)
            ref.insert(pack(new), rows)
            held.update(new)
        elif op < 0.9 and held:
            gone = rng.sample(sorted(held), min(len(held), rng.randint(1, 80)))
            native.remove(pack(gone))
            ref.remove(pack(gone))
            held.difference_update(gone)
        elif held:
            moved = rng.sample(sorted(held), min(len(held), 30))
            rows = np.array([rng.randrange(10**6) for _ in moved], np.int64)
            native.update(pack(moved), rows)
            ref.update(pack(moved), rows)
        assert len(native) == len(ref) == len(held)
    everything = pack(universe)
    assert native.lookup(everything).tolist() == ref.lookup(everything).tolist()


def test_the_index_refuses_what_would_corrupt_it_and_finds_repeats():
    index = NativeBlockIndex(4)
    keys = pack([_key(1), _key(2)])
    index.insert(keys, np.array([5, 6]))
    with pytest.raises(RuntimeError, match="already indexed"):
        index.insert(pack([_key(3), _key(1)]), np.array([7, 8]))
    with pytest.raises(RuntimeError, match="capacity"):
        index.insert(pack([_key(i) for i in range(10, 14)]), np.arange(4))
    with pytest.raises(RuntimeError, match="not indexed"):
        index.remove(pack([_key(9)]))
    for impl in (index, DictBlockIndex(4)):
        assert impl.lookup_unique(pack([_key(1), _key(2), _key(3), _key(2)])) is None  # here, repeated
        assert impl.lookup_unique(pack([_key(9), _key(1), _key(9)])) is None  # not here, repeated
    rows, found = index.lookup_unique(pack([_key(1), _key(9), _key(3)]))
    assert (rows.tolist(), found) == ([5, -1, 7], 2)
    rows, found = DictBlockIndex(4).lookup_unique(pack([_key(1), _key(2)]))
    assert (rows.tolist(), found) == ([-1, -1], 0)
    assert index.lookup(pack([_key(1), _key(2), _key(3), _key(4)])).tolist() == [5, 6, 7, -1]


@pytest.mark.parametrize("kind", [NativeBlockIndex, DictBlockIndex])
def test_a_prefix_stops_at_the_first_block_missing_or_uncommitted_and_refuses_a_repeat(kind):
    index = kind(8)
    index.insert(pack([_key(i) for i in range(5)]), np.array([4, 3, 2, 1, 0]))
    committed = np.array([True, False, True, True, True, False, False, False])  # row 1 (_key(3)) is not
    assert index.prefix(pack([_key(0), _key(1), _key(2), _key(3), _key(4)]), committed).tolist() == [4, 3, 2]
    assert index.prefix(pack([_key(4), _key(9), _key(0)]), committed).tolist() == [0]
    assert index.prefix(pack([_key(0), _key(1), _key(0)]), committed) is None
    assert index.prefix(pack([_key(0), _key(3), _key(0)]), committed).tolist() == [4]  # the repeat is past it
    assert index.prefix(pack([]), committed).tolist() == []


@pytest.mark.parametrize("kind", [NativeBlockIndex, DictBlockIndex])
def test_a_long_prefix_stops_where_its_chain_does_across_the_look_up_chunks(kind):
    """The C look-ups go 16 keys at a time: a prefix ends at the first block missing, uncommitted
    or repeated, wherever that falls among the chunks."""
    index = kind(64)
    keys = [_key(i) for i in range(40)]
    index.insert(pack(keys), np.arange(40))
    committed = np.ones(64, np.bool_)
    assert index.prefix(pack(keys), committed).tolist() == list(range(40))
    committed[20] = False
    assert index.prefix(pack(keys), committed).tolist() == list(range(20))
    assert index.prefix(pack([*keys[:33], keys[3], *keys[33:]]), np.ones(64, np.bool_)) is None  # key 33 repeats 3
    assert index.prefix(pack([*keys[:17], _key(99), keys[0]]), np.ones(64, np.bool_)).tolist() == list(range(17))
    assert index.prefix(pack([keys[16]] * 2), np.ones(64, np.bool_)) is None
    rows, found = index.lookup_unique(pack([*keys[30:], _key(99), *keys[:20]]))
    assert (rows.tolist(), found) == ([*range(30, 40), -1, *range(20)], 30)
    assert index.lookup_unique(pack([*keys[:18], keys[17]])) is None


def test_the_c_functions_check_their_arguments_before_reading_them():
    """The extension module reads a call's keys and rows from buffers: too short, not contiguous,
    or too few arguments is a Python error, never a read past the end."""
    from services.kvstore.block_index import library

    lib, index = library(), NativeBlockIndex(8)
    out = np.empty(8, np.int64)
    keys = pack([_key(1), _key(2)])
    with pytest.raises(ValueError, match=r"block_index_lookup: argument 0 holds 32 bytes, 48 needed for 3"):
        lib.block_index_lookup(keys, 3, *index._table, out)
    with pytest.raises(ValueError, match="not C-contiguous"):
        lib.block_index_lookup(np.zeros((2, 4), np.uint64)[:, ::2], 2, *index._table, out)
    with pytest.raises(ValueError, match="rows_queue: argument 0 holds 8 bytes, 16 needed"):
        lib.rows_queue(np.zeros(1, np.int64), 2, 0, 0, 0, 1, 0, 0)
    with pytest.raises(TypeError, match=r"block_index_remove takes 5 arguments \(2 given\)"):
        lib.block_index_remove(keys, 2)
    with pytest.raises(ValueError, match="a negative count"):
        lib.block_index_lookup(keys, -1, *index._table, out)
    lib.block_index_lookup(keys, 2, *index._table, out)
    assert out[:2].tolist() == [-1, -1]
