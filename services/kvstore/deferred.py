"""Bookkeeping a control call's answer does not wait for, run right after the answer is sent.

A commit's answer is its count; moving its blocks into the eviction order, telling the index
and waking watchers can follow the answer instead of preceding it (measured: a 64-block
commit's answer went out 60-65 µs sooner, of ~140 µs in the store). The store is
single-threaded, and the control socket runs a call's deferred work before it reads the next
frame, so no call ever sees the store with work still pending. Outside a control-socket call
(the unary RPCs, the reaper, tests calling the store), deferred work runs at once.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve import logs

log = logs.get("kvstore.deferred")


class Deferred:
    """Owns the work held back for the control call being answered, if there is one."""

    def __init__(self) -> None:
        self._held: list[tuple[Callable[..., None], tuple]] | None = None

    def __call__(self, fn: Callable[..., None], *args) -> None:
        """fn(*args): after the answer while a control call is answered, else now."""
        if self._held is None:
            fn(*args)
        else:
            self._held.append((fn, args))

    def hold(self) -> None:
        """A control call begins: hold its bookkeeping until `run`."""
        self._held = []

    def run(self) -> None:
        """The answer is sent: run what was held, in order. One that fails is logged and the
        rest still run (a store stopped halfway through its bookkeeping would be worse)."""
        held, self._held = self._held, None
        for fn, args in held or ():
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - see the docstring
                log.exception("deferred store bookkeeping failed", step=getattr(fn, "__qualname__", repr(fn)))
