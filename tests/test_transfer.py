"""The data plane on its own: two real transfer engines in this process, moving registered memory."""

from __future__ import annotations

import grpc
import pytest
import torch

from pdserve.errors import status_for
from pdserve.kvclient.transfer import Span, Transfer, TransferError


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


def test_a_long_span_moves_as_slices_side_by_side_and_each_span_is_told_as_it_lands(engines):
    from pdserve.kvclient.transfer import SLICE_BYTES

    a, b = engines
    n = 2 * SLICE_BYTES + 4096
    theirs = torch.randint(0, 256, (n + 8192,), dtype=torch.uint8)
    ours = torch.zeros(n + 8192, dtype=torch.uint8)
    a.register(theirs)
    b.register(ours)
    at, ot = theirs.data_ptr(), ours.data_ptr()
    landed: list[Span] = []
    spans = [Span(ot, at, n), Span(ot + n + 4096, at + n + 4096, 4096)]  # (not adjacent: two spans)
    assert b.read(a.segment, spans, on_done=landed.append) == 4  # the first as three slices
    assert torch.equal(ours[:n], theirs[:n]) and torch.equal(ours[n + 4096 : n + 8192], theirs[n + 4096 : n + 8192])
    assert sorted(landed, key=lambda s: s.local) == spans  # each once, whole
    ours.fill_(9)
    theirs.zero_()
    seen: list[tuple[Span, int]] = []  # each span given to `on_done`, and how much of it had landed then
    done = lambda s: seen.append((s, int((theirs[s.remote - at : s.remote - at + s.nbytes] == 9).sum())))  # noqa: E731
    assert b.write(a.segment, [Span(ot, at, n), Span(ot + n + 4096, at + n + 4096, 4096)], done) == 4
    assert int((theirs[:n] == 9).sum()) == n and int((theirs[n + 4096 : n + 8192] == 9).sum()) == 4096
    assert sorted(seen, key=lambda x: x[0].local) == [(spans[0], n), (spans[1], 4096)]  # each once, whole, landed


def test_a_failed_transfer_raises_with_its_cause(engines):
    a, b = engines
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    b.register(buf)
    with pytest.raises(TransferError, match=r"failed \(failed; 1 slices, 4096 bytes\)"):
        b.read(a.segment, [Span(buf.data_ptr(), 12345678, 4096)])  # not memory the peer registered
    with pytest.raises(TransferError, match=r"127\.0\.0\.1:1 failed \(submit refused") as err:
        b.read("127.0.0.1:1", [Span(buf.data_ptr(), 12345678, 4096)])  # no such peer
    assert status_for(err.value) == grpc.StatusCode.UNAVAILABLE  # (a service answers it so, not INTERNAL)


class FirstStatusFails:
    """A stand-in for the engine (a fake, for the retry logic above it): the real engine moves
    the bytes, but the first `fails` status checks read "failed", as a pooled session to a peer
    that restarted on the same port does."""

    def __init__(self, engine, fails: int):
        self.engine, self.fails = engine, fails

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def transfer_check_status(self, batch):
        status = self.engine.transfer_check_status(batch)
        if status != 0 and self.fails > 0:
            self.fails -= 1
            return -1
        return status


@pytest.mark.parametrize("fails", [1, 2])
def test_a_failed_slice_is_tried_once_more_then_the_transfer_fails(engines, fails):
    a, b = engines
    theirs = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    ours = torch.zeros_like(theirs)
    a.register(theirs)
    b.register(ours)
    real, b.engine = b.engine, FirstStatusFails(b.engine, fails)
    landed: list[Span] = []
    span = Span(ours.data_ptr(), theirs.data_ptr(), 1 << 16)
    try:
        if fails == 1:
            assert b.read(a.segment, [span], on_done=landed.append) == 1
            assert torch.equal(ours, theirs) and landed == [span]
            ours.fill_(7)
            b.engine.fails, done = 1, []
            assert b.write(a.segment, [span], lambda s: done.append((s, torch.equal(ours, theirs)))) == 1
            assert done == [(span, True)]  # once, after the slice tried once more has landed
        else:
            with pytest.raises(TransferError, match=r"failed \(failed; 1 slices, 65536 bytes\)"):
                b.read(a.segment, [span], on_done=landed.append)
            assert landed == []
    finally:
        b.engine = real


def test_block_spans_merge_runs_adjacent_on_both_sides_only():
    from pdserve.kvclient.transfer import block_spans, coalesce

    n = 4096
    pairs = [(0, 8 * n), (n, 9 * n), (2 * n, 10 * n),  # one run of three
             (3 * n, 20 * n),  # adjacent locally only: a new span
             (5 * n, 21 * n),  # adjacent remotely only: a new span
             (6 * n, 22 * n), (7 * n, 23 * n)]  # and it runs on
    local, remote = [a for a, _ in pairs], [b for _, b in pairs]
    spans = [Span(0, 8 * n, 3 * n), Span(3 * n, 20 * n, n), Span(5 * n, 21 * n, 3 * n)]
    assert block_spans(local, remote, n) == spans
    assert block_spans(local, remote, n) == coalesce([Span(a, b, n) for a, b in pairs])
    # Only the blocks that move do; the others split runs (a block that does not move is a gap):
    # blocks 1 and 5 stay.
    moves = [True, False, True, True, True, False, True]
    assert block_spans(local, remote, n, moves) == [
        Span(0, 8 * n, n), Span(2 * n, 10 * n, n), Span(3 * n, 20 * n, n), Span(5 * n, 21 * n, n),
        Span(7 * n, 23 * n, n)]
    assert block_spans(local, remote, n, [not m for m in moves]) == [Span(n, 9 * n, n), Span(6 * n, 22 * n, n)]
    assert block_spans(local, remote, n, [False] * 7) == []
    assert block_spans([n], [0], n) == [Span(n, 0, n)]  # address 0 is an address like any other
    assert block_spans([2**64 - n], [0], n) == [Span(2**64 - n, 0, n)]
    assert block_spans([], [], n) == []
    with pytest.raises(ValueError, match="block_spans: 2 local addresses for 1 remote ones"):
        block_spans([0, n], [0], n)
    with pytest.raises(ValueError, match="block_spans: 1 flags for 2 blocks"):
        block_spans([0, n], [0, n], n, [True])
