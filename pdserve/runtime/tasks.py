"""Background asyncio tasks of the services' long-lived helpers."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background loop and wait until it has ended, so nothing it does lands after."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
