"""The data plane: this process's Mooncake Transfer Engine, with slice coalescing.

One `TransferEngine` per process (it owns a listening RPC port). Memory that takes part in a
transfer, on either side, must be registered first. A run of blocks adjacent both locally and
remotely moves as one slice: at ~45 µs per slice here, coalescing is what makes transfers fast.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve import logs
from pdserve.errors import Unavailable
from pdserve.runtime import bind_host

log = logs.get("kv.transfer")


FIRST_SLEEP_S, MAX_SLEEP_S = 20e-6, 1e-3  # polls of a move in flight: 20 µs apart, doubling to 1 ms
# The largest slice: the engine moves the slices of a transfer side by side, so a 128 MiB move as
# 16 MiB slices took 1.5-2.2 GB/s where one slice took 1.3 (loopback TCP, 2 cores, one session).
SLICE_BYTES = 16 << 20


class TransferError(Unavailable):
    """A move that failed or could not start: the peer (a store, most often) is down or gone, so
    its callers answer UNAVAILABLE, as for any unreachable service."""


# What an async submit returns when it could not start: 0, or -1 as the engine's unsigned batch id.
_NO_BATCH = (0, 2**64 - 1)


@dataclass(frozen=True)
class Span:
    local: int  # address in this process's registered memory
    remote: int  # address in the peer's registered memory
    nbytes: int

    def blocks(self, block_nbytes: int) -> range:
        """The local addresses of the blocks of `block_nbytes` this span covers."""
        return range(self.local, self.local + self.nbytes, block_nbytes)


def block_spans(local: Sequence[int], remote: Sequence[int], nbytes: int, moves: Sequence[bool] | None = None
                ) -> list[Span]:
    """Spans for blocks of `nbytes`, block i from local[i] to remote[i], neighbours adjacent on
    both sides merged (order kept): a span per run, not per block. With `moves`, only the
    blocks marked True move (the others split runs)."""
    if len(local) != len(remote):
        raise ValueError(f"block_spans: {len(local)} local addresses for {len(remote)} remote ones")
    if moves is not None and len(moves) != len(local):
        raise ValueError(f"block_spans: {len(moves)} flags for {len(local)} blocks")
    picked = zip(local, remote, strict=True) if moves is None else (
        (a, b) for a, b, m in zip(local, remote, moves, strict=True) if m)
    return coalesce([Span(int(a), int(b), nbytes) for a, b in picked])


def coalesce(spans: Sequence[Span]) -> list[Span]:
    """Merge neighbours that are adjacent on both sides (order kept), up to SLICE_BYTES a span."""
    out: list[Span] = []
    for s in spans:
        last = out[-1] if out else None
        if (last is not None and last.local + last.nbytes == s.local and last.remote + last.nbytes == s.remote
                and last.nbytes + s.nbytes <= SLICE_BYTES):
            last = out[-1]
            out[-1] = Span(last.local, last.remote, last.nbytes + s.nbytes)
        else:
            out.append(s)
    return out


class Transfer:
    """Owns this process's transfer engine and the list of memory it registered."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp"):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # pragma: no cover - install problem
            raise TransferError(
                f"Mooncake Transfer Engine unavailable ({e}); install mooncake-transfer-engine-non-cuda "
                "(CPU) or mooncake-transfer-engine (CUDA), and Debian's libibverbs1"
            ) from e
        self.engine = TransferEngine()
        with bind_host.confined(host):  # its ports on `host`, not on every address
            rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransferError(f"transfer engine failed to initialize on {host} ({protocol}): rc={rc}")
        self.segment = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []

    def register(self, tensor: torch.Tensor) -> None:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({nbytes} bytes) failed: rc={rc}")
        self._registered.append((ptr, nbytes))

    def unregister(self, tensor: torch.Tensor) -> None:
        """Before freeing it: a later buffer at an overlapping address could not be registered."""
        ptr = tensor.data_ptr()
        self.engine.unregister_memory(ptr)
        self._registered = [(p, n) for p, n in self._registered if p != ptr]

    def unregister_all(self) -> None:
        for ptr, _ in self._registered:
            self.engine.unregister_memory(ptr)
        self._registered.clear()

    def read(self, peer: str, spans: Sequence[Span], on_done: Callable[[Span], None] | None = None) -> int:
        """Copy remote -> local; returns the number of slices used. Blocking: call off the loop.
        on_done(span) runs (in this thread) as soon as a span (neighbours of `spans` merged) has
        landed, while the others still move."""
        return self._move(peer, spans, write=False, on_done=on_done)

    def write(self, peer: str, spans: Sequence[Span], on_done: Callable[[Span], None] | None = None) -> int:
        """Copy local -> remote; returns the number of slices used. Blocking. on_done(span) as for
        `read`: a span's bytes, just read by the engine, are still in the CPU's cache then."""
        return self._move(peer, spans, write=True, on_done=on_done)

    def _move(self, peer: str, spans: Sequence[Span], write: bool,
              on_done: Callable[[Span], None] | None = None) -> int:
        """Submit each slice (at most SLICE_BYTES: the engine moves several at once) as a batch of
        its own, then poll them, sleeping between polls (from 20 µs, doubling to 1 ms): the
        engine's sync calls spin on the status for the whole move, a CPU's worth of work that, on
        a shared core, the engine step beside it would lose.

        One slice per batch is for correctness, not speed: the engine's status call reads the
        first task of a batch only (and frees the batch once that one is done), so a batch of
        several slices reports done while the others still move (measured: 8 x 512 KiB in one
        batch, "done" with 1.3-2 MiB not yet landed in 29 of 30 writes)."""
        merged = coalesce(spans)
        pieces = [(i, piece) for i, span in enumerate(merged) for piece in _pieces(span)]
        if not pieces:
            return 0
        left = Counter(i for i, _ in pieces)  # span -> its pieces still moving
        submit = self.engine.batch_transfer_async_write if write else self.engine.batch_transfer_async_read
        errors: list[str] = []
        failed: list[tuple[int, Span]] = []

        def landed(i: int) -> None:
            left[i] -= 1
            if not left[i] and on_done is not None:
                on_done(merged[i])  # (the others move meanwhile)

        for attempt in range(2):
            todo, failed = failed if attempt else pieces, []
            pending: list[tuple[int, int, Span]] = []  # (batch, span, slice)
            for i, piece in todo:
                batch = submit(peer, [piece.local], [piece.remote], [piece.nbytes])
                if batch in _NO_BATCH:
                    errors.append("submit refused")
                    break
                pending.append((batch, i, piece))
            sleep_s = FIRST_SLEEP_S
            while pending:
                waiting = []
                for batch, i, piece in pending:
                    status = self.engine.transfer_check_status(batch)  # 1 done, 0 running, -1 failed, -2 timed out
                    if status == 0:
                        waiting.append((batch, i, piece))
                    elif status == 1:
                        landed(i)
                    elif status == -1:
                        failed.append((i, piece))
                    else:
                        errors.append("timed out")
                if len(waiting) == len(pending):
                    time.sleep(sleep_s)
                    sleep_s = min(2 * sleep_s, MAX_SLEEP_S)
                pending = waiting
            if errors or not failed:
                break
            # A failed slice is tried once more, on a new connection: the engine drops a session
            # that failed, and a pooled one can be stale (its peer restarted on the same port).
            log.warning("transfer slices failed; retrying them once", peer=peer, slices=len(failed))
        if errors or failed:
            what = ", ".join(sorted(set(errors + ["failed"] * bool(failed))))
            raise TransferError(f"transfer {'to' if write else 'from'} {peer} failed ({what}; {len(pieces)} slices, "
                                f"{sum(p.nbytes for _, p in pieces)} bytes)")
        return len(pieces)


def _pieces(span: Span) -> list[Span]:
    """A span as slices of at most SLICE_BYTES."""
    return [Span(span.local + at, span.remote + at, min(SLICE_BYTES, span.nbytes - at))
            for at in range(0, span.nbytes, SLICE_BYTES)]
