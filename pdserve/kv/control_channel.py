"""The client end of the store's control socket (services/kvstore/control_socket.py): the
control calls as frames on one connection per client, opened on first use and reopened after a
break: the store's Unix socket when it offers one this process can reach (the same host and
network namespace), else TCP.

Calls from any number of coroutines share the connection: each gets a call id and waits for
the answer that echoes it. A failed call raises the `grpc.aio.AioRpcError` the unary RPC would
have raised (same code, same message), so callers handle both alike. A broken connection fails
the calls waiting on it with UNAVAILABLE; the next call asks the store where its socket is
(the store may have restarted elsewhere) and connects again.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from pdserve import logs, telemetry
from pdserve.kv.control_frames import FrameError, FrameReader, frame, set_fields
from pdserve.v1 import kvstore_pb2 as pb

log = logs.get("kv.control")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class ControlAddress:
    """Where a store's control socket is (from its Info)."""

    host: str
    port: int
    unix_name: str = ""  # an abstract Unix socket's name (no leading NUL); "" when none is offered


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Connection(asyncio.Protocol):
    """One open connection and the calls waiting for its answers."""

    def __init__(self, address: str):
        self.address = address
        self.pending: dict[int, asyncio.Future] = {}
        self.transport: asyncio.Transport | None = None
        self.broken = False
        self._frames = FrameReader()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            responses = [pb.ControlResponse.FromString(p) for p in self._frames.feed(data)]
        except (FrameError, DecodeError) as e:
            self.fail(f"an unreadable answer from the store ({e})")
            self.transport.close()
            return
        for response in responses:
            future = self.pending.pop(response.call_id, None)
            if future is None or future.done():
                continue  # its caller gave up (deadline, cancellation)
            if response.status_code:
                code = _CODES.get(response.status_code, grpc.StatusCode.UNKNOWN)
                future.set_exception(rpc_error(code, response.status_message))
            else:
                future.set_result(response)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(f"the control connection to the store at {self.address} closed"
                  + (f" ({exc})" if exc else ""))

    def fail(self, why: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.broken = True
        error = rpc_error(code, why)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.pending.clear()


def _seen(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _expire(future: asyncio.Future, name: str, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"{name}: no answer from the store within {timeout_s} s"))


class ControlChannel:
    """Owns this client's control connection. `locate` says where the store's control socket is."""

    def __init__(self, locate: Callable[[], Awaitable[ControlAddress]]):
        self._locate = locate
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None  # one connect at a time, shared by its callers
        self._ids = itertools.count(1)

    async def call(self, name: str, request: dict, timeout_s: float) -> Message:
        """Send one control call (`name`: its field in ControlRequest; `request`: that message's
        fields, made into it in place: a message built alone and placed in another is copied)
        and return its response."""
        conn = self._conn
        if conn is None or conn.broken:
            conn = await self._connect(timeout_s)
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        conn.pending[call_id] = future
        timer = loop.call_later(timeout_s, _expire, future, name, timeout_s)
        try:
            trace = telemetry.current_context()
            message = pb.ControlRequest(call_id=call_id, **{name: set_fields(request)})
            if trace:
                message.trace_context.update(trace)
            conn.transport.write(frame(message))
            response = await future
        finally:
            # However this call ends (answer, error, deadline, cancellation), its entry goes.
            timer.cancel()
            conn.pending.pop(call_id, None)
        return getattr(response, name)

    async def _connect(self, timeout_s: float) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open(timeout_s))
            self._connecting.add_done_callback(_seen)  # its waiters may all have been cancelled
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)  # a caller cancelled leaves the others' connect be
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self, timeout_s: float) -> _Connection:
        where = await self._locate()
        loop = asyncio.get_running_loop()
        if where.unix_name:
            address = f"unix:@{where.unix_name}"
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_unix_connection(lambda: _Connection(address), "\0" + where.unix_name), timeout_s)
                self._conn = conn
                return conn
            except (OSError, TimeoutError) as e:  # another host or network namespace: TCP it is
                log.debug("the store's Unix control socket is out of reach; using TCP", address=address,
                          error=str(e) or "timed out")
        address = f"{where.host}:{where.port}"
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(address), where.host, where.port), timeout_s)
        except (OSError, TimeoutError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"cannot reach the store's control socket at {address}: {e or 'timed out'}") from None
        self._conn = conn
        return conn

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
            self._conn.fail("the store client was closed", grpc.StatusCode.CANCELLED)
        self._conn = None
