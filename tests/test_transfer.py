"""The data plane on its own: two real transfer engines in this process, moving registered memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kv.transfer import Span, Transfer, TransferError


@pytest.fixture(scope="module")
def engines():
    a, b = Transfer(), Transfer()
    yield a, b


@pytest.fixture(autouse=True)
def unregistered_after(request):
    """Each test's buffers are unregistered when it ends (before they are freed: a later buffer
    at an overlapping address could not be registered)."""
    yield
    if "engines" in request.fixturenames:
        for engine in request.getfixturevalue("engines"):
            engine.unregister_all()


def test_slices_move_bit_exact_both_ways_and_adjacent_ones_as_one(engines):
    a, b = engines
    theirs = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    ours = torch.zeros_like(theirs)
    a.register(theirs)
    b.register(ours)
    at, ot = theirs.data_ptr(), ours.data_ptr()
    spans = [Span(ot, at, 4096), Span(ot + 4096, at + 4096, 4096), Span(ot + 65536, at + 131072, 8192)]
    assert b.read(a.segment, spans) == 2  # the first two are adjacent on both sides
    assert torch.equal(ours[:8192], theirs[:8192]) and torch.equal(ours[65536:73728], theirs[131072:139264])
    assert int(ours[8192:65536].count_nonzero()) == 0 and int(ours[73728:].count_nonzero()) == 0
    ours.fill_(7)
    assert b.write(a.segment, [Span(ot + 100, at + 500_000, 3000)]) == 1
    assert int((theirs[500_000:503_000] == 7).sum()) == 3000
    assert b.read(a.segment, []) == 0


def test_a_write_has_landed_when_it_returns_however_many_slices_it_takes(engines):
    """The engine's status call reads only the first task of a batch (and frees the batch once
    that one is done): a batch of several slices says done while the others still move. So a
    write is done when every slice is, each in a batch of its own; checked here at once, with
    nothing between the write's return and the look at the peer's memory."""
    a, b = engines
    run, runs = 512 * 1024, 8
    theirs = torch.zeros(2 * runs * run, dtype=torch.uint8)
    ours = torch.empty(runs * run, dtype=torch.uint8)
    a.register(theirs)
    b.register(ours)
    # Not adjacent remotely: one slice per run.
    spans = [Span(ours.data_ptr() + i * run, theirs.data_ptr() + 2 * i * run, run) for i in range(runs)]
    for value in (1, 2, 3, 4, 5):
        ours.fill_(value)
        assert b.write(a.segment, spans) == runs
        landed = [int((theirs[2 * i * run : (2 * i + 1) * run] == value).sum()) for i in range(runs)]
        assert landed == [run] * runs


def test_a_failed_transfer_raises_with_its_cause(engines):
    a, b = engines
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    b.register(buf)
    with pytest.raises(TransferError, match=r"failed \(failed; 1 slices, 4096 bytes\)"):
        b.read(a.segment, [Span(buf.data_ptr(), 12345678, 4096)])  # not memory the peer registered
    with pytest.raises(TransferError, match=r"127\.0\.0\.1:1 failed \(submit refused"):
        b.read("127.0.0.1:1", [Span(buf.data_ptr(), 12345678, 4096)])  # no such peer


@pytest.mark.parametrize("impl", ["c", "numpy"])
def test_block_spans_merge_runs_adjacent_on_both_sides_only(impl):
    from pdserve.kv import transfer

    if impl == "c":
        assert transfer._spans_module() is not None, "the C helper must build here (setup installs gcc, python3-dev)"
        block_spans = transfer.block_spans
    else:
        block_spans = transfer.block_spans_numpy
    n = 4096
    pairs = [(0, 8 * n), (n, 9 * n), (2 * n, 10 * n),  # one run of three
             (3 * n, 20 * n),  # adjacent locally only: a new span
             (5 * n, 21 * n),  # adjacent remotely only: a new span
             (6 * n, 22 * n), (7 * n, 23 * n)]  # and it runs on
    local, remote = [a for a, _ in pairs], [b for _, b in pairs]
    spans = [Span(0, 8 * n, 3 * n), Span(3 * n, 20 * n, n), Span(5 * n, 21 * n, 3 * n)]
    assert block_spans(local, remote, n) == spans
    assert block_spans(local, np.array(remote, "<u8"), n) == spans  # as an answer's addresses come
    assert block_spans(np.array(local, np.uint64), np.array(remote, "<u8")[::-1][::-1], n) == spans
    assert all(type(x) is int for s in block_spans(local, np.array(remote, "<u8"), n) for x in vars(s).values())
    assert block_spans(local, remote, n) == transfer.coalesce([Span(a, b, n) for a, b in pairs])
    # Only the blocks in the wanted state move; the others split runs (a block that does not
    # move is a gap): blocks 1 and 5 stay.
    states = bytes([1, 2, 1, 1, 1, 2, 1])
    assert block_spans(local, remote, n, states, 1) == [
        Span(0, 8 * n, n), Span(2 * n, 10 * n, n), Span(3 * n, 20 * n, n), Span(5 * n, 21 * n, n),
        Span(7 * n, 23 * n, n)]
    assert block_spans(local, remote, n, states, 2) == [Span(n, 9 * n, n), Span(6 * n, 22 * n, n)]
    assert block_spans(local, remote, n, states, 3) == []
    assert block_spans([n], [0], n) == [Span(n, 0, n)]  # address 0 is an address like any other
    assert block_spans([2**64 - n], [0], n) == [Span(2**64 - n, 0, n)]
    assert block_spans([], [], n) == []
    with pytest.raises(ValueError, match="block_runs: 2 local addresses for 1 remote ones"):
        block_spans([0, n], [0], n)
    with pytest.raises(ValueError, match="block_runs: 1 states for 2 blocks"):
        block_spans([0, n], [0, n], n, b"\x01", 1)
    with pytest.raises((TypeError, ValueError, OverflowError)):
        block_spans([-1], [0], n)


def test_a_move_is_paced_by_the_fastest_recent_rate_of_moves_of_a_mib_or_more():
    import itertools
    import time

    from pdserve.kv.pacing import FINE_S, FIRST_S, MAX_S, PACED_BYTES, Pace

    def first_sleep(pace: Pace, nbytes: int, rate: float):
        """The first sleep, and the bounds it must lie in: 80% of the expected time from the start."""
        start = time.perf_counter()
        sleeps = pace.sleeps(nbytes, start)
        before = time.perf_counter()
        first = next(sleeps)
        after = time.perf_counter()
        aim = 0.8 * nbytes / rate
        assert max(0.0, aim - (after - start)) <= first <= aim - (before - start)
        return sleeps, start

    big = 64 << 20
    pace = Pace()
    doubling = [FIRST_S * 2**i for i in range(4)] + [MAX_S] * 2
    assert list(itertools.islice(pace.sleeps(big, time.perf_counter()), 6)) == doubling  # no history
    pace.observe(PACED_BYTES - 1, 1e-6)  # small moves teach nothing
    assert list(itertools.islice(pace.sleeps(big, time.perf_counter()), 6)) == doubling
    for rate in (2e9, 4e9, 1e9):  # bytes/s; the fastest is taken (expected: 16.8 ms)
        pace.observe(big, big / rate)
    sleeps, _ = first_sleep(pace, big, 4e9)
    # Near the expected end: looks from 30 µs apart, each gap half as long again, to 200 µs.
    near = [FINE_S, FINE_S * 1.5, FINE_S * 1.5**2, FINE_S * 1.5**3, FINE_S * 1.5**4, MAX_S, MAX_S]
    assert list(itertools.islice(sleeps, 7)) == pytest.approx(near)
    assert list(itertools.islice(pace.sleeps(PACED_BYTES - 1, time.perf_counter()), 2)) == doubling[:2]  # unpaced
    for _ in range(8):  # only the last 8 rates count
        pace.observe(big, big / 1e9)
    first_sleep(pace, big, 1e9)
