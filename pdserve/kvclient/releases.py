"""Lease releases a client does not wait for, sent in as few calls as the store's answers allow;
and renewals that keep a lease alive."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from pdserve import logs
from pdserve.v1 import kvstore_pb2 as pb

log = logs.get("kv.client")
# A lease the store ended already (lapsed, or with its watch) is no failure to release.
ALREADY_ENDED = ("NOT_FOUND", "FAILED_PRECONDITION")
RENEW_RETRY_S = 0.1  # after a renewal the store did not answer: the lease runs out meanwhile


def keep_alive(renew: Callable[[], Awaitable], lease_id: str, lease_ms: int) -> asyncio.Task:
    """Call `renew` every third of the lease's length until the returned task is cancelled or the
    lease has ended; a renewal the store did not answer (slow, or away for a moment) is tried
    again at once, not a third of a lease later."""
    async def renew_forever() -> None:
        wait_s = lease_ms / 3000
        while True:
            await asyncio.sleep(wait_s)
            try:
                await renew()
                wait_s = lease_ms / 3000
            except grpc.aio.AioRpcError as e:
                if e.code().name in ALREADY_ENDED:
                    return  # closed (fully committed) or lapsed: nothing left to keep
                log.warning("lease renewal failed; trying again", lease_id=lease_id, code=e.code().name)
                wait_s = RENEW_RETRY_S

    return asyncio.ensure_future(renew_forever())


class ReleaseBatcher:
    """Owns the leases asked to be released and not yet sent, and the one task sending them:
    those asked for while a call is on its way go together in the next (one call for many under
    load). `send` makes one ReleaseLease call for a list of lease ids."""

    def __init__(self, send: Callable[[list[str]], Awaitable[pb.ReleaseLeaseResponse]]):
        self._send = send
        self._pending: list[str] = []
        self._task: asyncio.Task | None = None

    def add(self, lease_id: str) -> None:
        self._pending.append(lease_id)
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def drain(self) -> None:
        """Wait until everything added so far has been sent (or given up on)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        try:
            await asyncio.sleep(0)  # what else this moment releases goes in the same call
            while self._pending:
                ids, self._pending = self._pending, []
                try:
                    resp = await self._send(ids)
                except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - the next ones still go
                    if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                        raise  # this task itself is cancelled (its loop is closing)
                    # (A call cut short by its channel closing under it is not this task's cancellation.)
                    log.warning("lease release failed; the store lapses them on its own", leases=len(ids),
                                error=str(e) or type(e).__name__)
                    continue
                for r in resp.refused:
                    if r.code not in ALREADY_ENDED:
                        log.warning("lease release refused; the store lapses it on its own", lease_id=r.lease_id,
                                    code=r.code, message=r.message)
        finally:
            self._task = None  # (no await since the loop's last check: nothing queued is stranded)
