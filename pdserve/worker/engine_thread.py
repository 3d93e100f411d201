"""EngineThread: the one thread that touches an `LLMEngine`; async handlers never run torch.

Handlers `call()` closures that run between engine steps and get their result back as an
awaitable; each request's token events (and, for prefill, its progress) arrive on an asyncio
queue opened with `open_stream()`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sequence import TokenEvent

T = TypeVar("T")


@dataclass(frozen=True)
class Progress:
    num_computed_tokens: int


class EngineThread:
    """Owns the engine thread and the per-request event queues (those live on the event loop)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.load: dict[str, int] = engine.load()
        self.steps = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        future = self._loop.create_future()
        self._commands.put((fn, future))
        return await future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_commands(block=not self.engine.has_work())
            if self.engine.has_work():
                events = self.engine.step()
                self.steps += 1
                self._publish(events, dict(self.engine.last_progress))
            self.load = self.engine.load()

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            try:
                result: Any = fn(self.engine)
                self._loop.call_soon_threadsafe(_resolve, future, result, None)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                self._loop.call_soon_threadsafe(_resolve, future, None, e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, events: list[TokenEvent], progress: dict[str, int]) -> None:
        items = [(rid, Progress(n)) for rid, n in progress.items()] + [(ev.request_id, ev) for ev in events]
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list) -> None:
        for request_id, item in items:
            q = self._streams.get(request_id)
            if q is not None:
                q.put_nowait(item)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the awaiting handler was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
