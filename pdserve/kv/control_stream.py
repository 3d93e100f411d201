"""The store's control calls as messages on one long-lived gRPC stream (KVStore.Control).

A unary grpc.aio call costs a round trip of about 0.55 ms on a busy 2-core host, a message on an
open stream about 0.3 ms; a small put makes two control calls around a transfer of a few ms, so
that difference is most of its overhead. Calls from any number of coroutines share the stream:
each gets a call id and waits for the response that echoes it. A failed call raises the
`grpc.aio.AioRpcError` the unary call would have raised (same code, same message), so callers
handle both alike. A broken stream fails the calls waiting on it with its error; the next call
opens a new one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc
from google.protobuf.message import Message

from pdserve import telemetry
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _seen(task: asyncio.Future) -> None:
    """A send's failure reaches its caller, or the caller has gone: either way it is seen."""
    if not task.cancelled():
        task.exception()


class _Stream:
    """One open Control call and the calls waiting for its answers."""

    def __init__(self, stub: kvstore_pb2_grpc.KVStoreStub):
        self.call = stub.Control()
        self.pending: dict[int, asyncio.Future] = {}
        self.write_lock = asyncio.Lock()  # one write at a time on a stream
        self.broken: grpc.aio.AioRpcError | None = None
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the store closed the control stream")
        try:
            async for response in self.call:
                future = self.pending.pop(response.call_id, None)
                if future is None or future.done():
                    continue  # its caller gave up (deadline, cancellation)
                if response.status_code:
                    code = _CODES.get(response.status_code, grpc.StatusCode.UNKNOWN)
                    future.set_exception(rpc_error(code, response.status_message))
                else:
                    future.set_result(response)
        except grpc.aio.AioRpcError as e:
            error = e
        finally:
            self.fail(error)

    async def send(self, message: pb.ControlRequest) -> None:
        async with self.write_lock:
            await self.call.write(message)

    async def ended(self, write_error: Exception) -> grpc.aio.AioRpcError:
        """Why the stream ended, after a write to it failed. grpc reports a failed write as
        INTERNAL ("Internal error from Core"); the reading side usually learns the real status
        (UNAVAILABLE: the store is gone). A write that fails means the stream is gone, so
        UNAVAILABLE when nothing better is known."""
        try:
            await asyncio.wait_for(asyncio.shield(self.reader), 0.5)
        except (TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        if self.broken is not None and self.broken.code() != grpc.StatusCode.INTERNAL:
            return self.broken
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"the control stream to the store ended ({write_error})")

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self.broken = error
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.pending.clear()

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        try:
            await self.reader
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        self.fail(rpc_error(grpc.StatusCode.CANCELLED, "the store client was closed"))


class ControlStream:
    """Owns this client's Control stream (opened on first use, reopened after a break)."""

    def __init__(self, stub: Callable[[], kvstore_pb2_grpc.KVStoreStub]):
        self._stub = stub
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    async def call(self, name: str, request: Message, timeout_s: float) -> Message:
        """Send one control call (`name`: its field in ControlRequest) and return its response."""
        stream = self._stream
        if stream is None or stream.broken is not None:
            with telemetry.detached():  # the stream serves every request: it belongs to no one trace
                stream = self._stream = _Stream(self._stub())
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        stream.pending[call_id] = future
        try:
            try:
                # Shielded: a caller cancelled mid-write must not cancel the stream, which grpc
                # does to a call whose write is cancelled, failing every other call on it.
                send = asyncio.ensure_future(stream.send(pb.ControlRequest(
                    call_id=call_id, trace_context=telemetry.current_context(), **{name: request})))
                send.add_done_callback(_seen)
                await asyncio.shield(send)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                # The stream ended under the write (the store died or went away): this call and
                # every other waiting on the stream fail with the stream's own status.
                error = await stream.ended(e)
                stream.fail(error)
                raise error from None
            try:
                response = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"{name}: no answer from the store within {timeout_s} s") from None
        finally:
            # However this call ends (answer, error, deadline, cancellation), its entry goes, and
            # an exception set on its future by a failing stream counts as seen.
            stream.pending.pop(call_id, None)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()
        return getattr(response, name)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
        self._stream = None
