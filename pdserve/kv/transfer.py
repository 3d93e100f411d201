"""The data plane: this process's Mooncake Transfer Engine, with slice coalescing.

One `TransferEngine` per process (it owns a listening RPC port). Memory that takes part in a
transfer, on either side, must be registered first. A run of blocks adjacent both locally and
remotely moves as one slice: at ~45 µs per slice here, coalescing is what makes transfers fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class TransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class Span:
    local: int  # address in this process's registered memory
    remote: int  # address in the peer's registered memory
    nbytes: int


def coalesce(spans: Sequence[Span]) -> list[Span]:
    """Merge neighbours that are adjacent on both sides (order kept)."""
    out: list[Span] = []
    for s in spans:
        if out and out[-1].local + out[-1].nbytes == s.local and out[-1].remote + out[-1].nbytes == s.remote:
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

    def read(self, peer: str, spans: Sequence[Span]) -> int:
        """Copy remote -> local; returns the number of slices used. Blocking: call off the loop."""
        return self._move(peer, spans, write=False)

    def write(self, peer: str, spans: Sequence[Span]) -> int:
        """Copy local -> remote; returns the number of slices used. Blocking."""
        return self._move(peer, spans, write=True)

    def _move(self, peer: str, spans: Sequence[Span], write: bool) -> int:
        merged = coalesce(spans)
        if not merged:
            return 0
        local = [s.local for s in merged]
        remote = [s.remote for s in merged]
        sizes = [s.nbytes for s in merged]
        if len(merged) == 1:
            fn = self.engine.transfer_sync_write if write else self.engine.transfer_sync_read
            rc = fn(peer, local[0], remote[0], sizes[0])
        else:
            fn = self.engine.batch_transfer_sync_write if write else self.engine.batch_transfer_sync_read
            rc = fn(peer, local, remote, sizes)
        if rc != 0:
            raise TransferError(f"transfer {'to' if write else 'from'} {peer} failed (rc={rc}, "
                                f"{len(merged)} slices, {sum(sizes)} bytes)")
        return len(merged)
