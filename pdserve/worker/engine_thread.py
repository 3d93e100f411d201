"""EngineThread: the one thread that touches an `LLMEngine`; async handlers never run torch.

Handlers `call()` closures that run between engine steps and get their result back as an
awaitable; each request's token events (and, for prefill, its progress) arrive on an asyncio
queue opened with `open_stream()`.

A step that raises fails the requests it was running (an `EngineFailed` on their streams) and
the engine goes on serving the rest. An engine that cannot go on (steps failing over and over,
an abort that fails, a step stuck past its bound) is dead: every waiter gets `Unavailable`,
and `on_death` is told so the process can stop serving and exit for its supervisor.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve import logs
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sequence import TokenEvent
from pdserve.errors import PdserveError, Unavailable

T = TypeVar("T")
log = logs.get("worker.engine")

MAX_FAILED_STEPS = 3  # in a row: past this the failures are the engine's, not one request's


@dataclass(frozen=True)
class Progress:
    num_computed_tokens: int


class EngineFailed(PdserveError):
    """A step running this request raised: the request was aborted (INTERNAL)."""


@dataclass(frozen=True)
class Failure:
    """On a request's stream: the engine failed it; its consumer raises `error`."""

    error: Exception


class EngineThread:
    """Owns the engine thread and the per-request event queues (those live on the event loop)."""

    def __init__(self, engine: LLMEngine, on_death: Callable[[str], None] | None = None):
        self.engine = engine
        self.on_death = on_death
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.load: dict[str, int] = engine.load()
        self.steps = 0
        self.failed_steps = 0  # in a row
        self.step_started: float | None = None  # monotonic, while a step runs
        self.dead = ""  # why the engine stopped, once it has

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        if self.dead:
            raise Unavailable(f"this worker's engine has stopped ({self.dead}); it is restarting")
        future = self._loop.create_future()
        self._commands.put((fn, future))
        return await future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        if self.dead:
            q.put_nowait(Failure(Unavailable(f"this worker's engine has stopped ({self.dead})")))
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def stuck_for(self) -> float:
        """Seconds the current step has run (0 between steps)."""
        started = self.step_started
        return time.monotonic() - started if started is not None else 0.0

    def die(self, reason: str) -> None:
        """Stop for good (from the loop or the engine thread): fail every waiter, tell `on_death`."""
        if self.dead:
            return
        self.dead = reason
        self._stopped.set()
        log.error("engine stopped", reason=reason)
        self._loop.call_soon_threadsafe(self._fail_all, reason)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        starved = False  # the last step scheduled nothing (its head waits for pages): only a command can change that
        while not self._stopped.is_set():
            self._drain_commands(block=starved or not self.engine.has_work())
            self.load = self.engine.load()  # before the step too: a long one must not hide its work
            if self._stopped.is_set() or not self.engine.has_work():
                continue
            self.step_started = time.monotonic()
            try:
                events = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fails the step's requests, not the worker
                self.step_started = None
                self._step_failed(e)
                continue
            self.step_started = None
            starved = not self.engine.last_batch
            self.failed_steps = 0
            self.steps += 1
            self._publish(events, dict(self.engine.last_progress))
            self.load = self.engine.load()

    def _step_failed(self, e: Exception) -> None:
        batch = list(self.engine.last_batch)
        self.failed_steps += 1
        log.exception("engine step failed: its requests are aborted", requests=batch[:8], in_a_row=self.failed_steps)
        try:
            for rid in batch:  # (pages kept until each one's handler aborts it: it may be shipping them)
                self.engine.halt(rid)
        except Exception as abort_error:  # noqa: BLE001
            self.die(f"aborting a failed step's requests failed: {abort_error!r}")
            return
        error = EngineFailed(f"the engine failed while running this request ({type(e).__name__}: {e}); it was "
                             "aborted")
        self._loop.call_soon_threadsafe(self._deliver, [(rid, Failure(error)) for rid in batch])
        if self.failed_steps >= MAX_FAILED_STEPS:
            self.die(f"{self.failed_steps} steps in a row failed, the last with {type(e).__name__}: {e}")

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

    # -- event loop ------------------------------------------------------------------------
    def _deliver(self, items: list) -> None:
        for request_id, item in items:
            q = self._streams.get(request_id)
            if q is not None:
                q.put_nowait(item)

    def _fail_all(self, reason: str) -> None:
        error = Unavailable(f"this worker's engine has stopped ({reason})")
        for q in self._streams.values():
            q.put_nowait(Failure(error))
        while True:  # commands the thread will never run
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _resolve(item[1], None, error)
        if self.on_death is not None:
            self.on_death(reason)


def next_event(item: Any) -> Any:
    """A stream item, or the failure it carries raised."""
    if isinstance(item, Failure):
        raise item.error
    return item


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the awaiting handler was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
