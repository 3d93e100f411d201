"""One `build_server()` for every service: grpc.aio, health, reflection, error mapping, tracing.

Health is NOT_SERVING until the service calls `set_serving()`; on SIGTERM/SIGINT it turns
NOT_SERVING at once, then the server drains in-flight calls for `grace_s` and stops.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pdserve import logs
from pdserve.errors import InvalidArgument, status_for
from pdserve.runtime import auth, telemetry
from pdserve.runtime.guard import AuthInterceptor, bearer_interceptors

log = logs.get("pdserve.runtime.server")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# gRPC keepalive on every channel and server. Without it a peer that hangs (SIGSTOP, a cable
# pulled, a partition) holds every call on it until that call's deadline; with it the connection
# is declared dead, and its calls fail UNAVAILABLE, within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS
# (~4 s). 2 s is far above a ping's round trip (< 1 ms on a LAN) and costs one tiny frame per idle
# connection per 2 s; the 2 s timeout rides out a busy host (2 cores here, a loaded step) without
# false alarms, which would fail healthy calls.
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
# A server sends GOAWAY to a client that pings more often than this: below the clients' interval.
MIN_PING_INTERVAL_MS = 1_000
# (grpc 1.85: the keepalive ping's ack waits `grpc.http2.ping_timeout_ms`, 60 s by default, whatever
# keepalive_timeout_ms says; measured: a SIGSTOPped peer failed a call after 60 s without it, 4.0 s with.)
_KEEPALIVE = [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
              ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
              ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS)]
_SERVER_KEEPALIVE = [*_KEEPALIVE, ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                     ("grpc.http2.max_ping_strikes", 0)]
# A channel whose peer went away retries the connection with exponential backoff; gRPC's default
# grows to 120 s, so the time to notice a restarted store grew with the length of its outage.
# Capped at 1 s, a peer that is back is found within about a second, however long it was gone.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
              ("grpc.max_reconnect_backoff_ms", 1_000)]
EXIT_DEADLINE_S = 5.0  # after the grace period, how long teardown may take before a hard exit


def _exit_after(seconds: float, drained: asyncio.Event) -> None:
    time.sleep(seconds)
    log.warning("teardown overran its deadline: exiting now", drained=drained.is_set())
    os._exit(0 if drained.is_set() else 1)


@dataclass(frozen=True)
class Undecodable:
    """A request that failed to parse (invalid UTF-8 in a string field, a truncated message):
    the handler never sees it; the call ends INVALID_ARGUMENT instead of gRPC's UNKNOWN."""

    error: str


def _tolerant(deserialize, max_bytes: int | None):
    if deserialize is None:
        return None

    def parse(data: bytes):
        if max_bytes is not None and len(data) > max_bytes:  # refused unparsed: parsing costs the loop
            return Undecodable(f"it is {len(data)} bytes, over this service's limit of {max_bytes} bytes a request")
        try:
            return deserialize(data)
        except DecodeError as e:
            return Undecodable(f"{e or 'malformed message'} (string fields must be valid UTF-8)")

    return parse


def _undecodable(request) -> InvalidArgument | None:
    if isinstance(request, Undecodable):
        return InvalidArgument(f"request refused unparsed: {request.error}")
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by handlers into status codes with the exception's message, and
    requests that do not parse into INVALID_ARGUMENT."""

    def __init__(self, max_request_bytes: int | None = None, calls: Counter[str] | None = None) -> None:
        self.max_request_bytes = max_request_bytes
        self.calls = calls  # when given, counts every call of a method served here, by its full name
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # per method, built on its first call

    async def intercept_service(self, continuation, details):
        method = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = await continuation(details)
            if handler is None:
                return None  # (no such method: neither counted nor kept, as a caller may name any)
            wrapped = self._wrapped[method] = self._wrap(handler, method)
        if self.calls is not None:
            self.calls[method] += 1
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        parse = _tolerant(handler.request_deserializer, self.max_request_bytes)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method), parse, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(_checked_stream(handler.stream_unary), method), parse, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method), parse, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method), parse, handler.response_serializer)


def refusal(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a handler's exception ends its call with, logged (a bug with its
    traceback, a refusal as information)."""
    if isinstance(exc, grpc.aio.AioRpcError):  # a call this service made failed: pass its status on
        return _passed_on(exc)
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("handler failed", method=method)
    else:
        log.info("request refused", method=method, code=code.name, message=str(exc))
    return code, str(exc) or type(exc).__name__


def _passed_on(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The status of a downstream call that failed: unreachable or too slow reads UNAVAILABLE
    (retryable, with the downstream's words), never INTERNAL with the error's repr."""
    code, details = exc.code(), exc.details() or exc.code().name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        log.warning("a service this call needs failed", code=code.name, message=details)
        return grpc.StatusCode.UNAVAILABLE, f"a service this request needs did not answer ({details}); retry shortly"
    log.info("request refused downstream", code=code.name, message=details)
    return code, details


_CANCELLED_BY_CALL: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()  # handler tasks a Cancel call ended


def cancel_for_call(task: asyncio.Task) -> None:
    """Cancel a handler's task because a Cancel call asked for it: its caller is told CANCELLED at
    once rather than left waiting to its deadline."""
    _CANCELLED_BY_CALL.add(task)
    task.cancel()


async def _cancelled_here(context: grpc.aio.ServicerContext) -> None:
    """A handler ended cancelled. When gRPC cancelled its task (the caller cancelled, or its
    deadline passed) there is no one to tell: return. Otherwise the cancellation began in this
    service (a Cancel call, `cancel_for_call`; or a call of its own cut short, e.g. its channel
    closed) and the caller would wait for an answer to its deadline: end the call with CANCELLED
    now. (The server context's cancelled() cannot tell: it reads False after a client's cancel.)"""
    task = asyncio.current_task()
    by_call = task in _CANCELLED_BY_CALL
    if task.cancelling() and not by_call:
        return
    why = "a Cancel call" if by_call else "a call this service depended on was cut short"
    try:
        await context.abort(grpc.StatusCode.CANCELLED, f"the request was cancelled ({why})")
    except grpc.aio.AbortError:
        pass
    except Exception:  # noqa: BLE001 - the call may already be ending
        pass


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    await context.abort(*refusal(exc, method))


def _checked_stream(fn):
    """A client-streaming handler whose request messages are checked as they arrive."""

    async def handler(requests, context):
        async def checked():
            async for r in requests:
                if (bad := _undecodable(r)) is not None:
                    raise bad
                yield r

        return await fn(checked(), context)

    return handler


def _wrap_unary(fn, method: str):
    async def wrapped(request, context):
        try:
            if (bad := _undecodable(request)) is not None:
                raise bad
            return await fn(request, context)
        except asyncio.CancelledError:
            await _cancelled_here(context)
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await _abort(context, e, method)

    return wrapped


def _wrap_stream(fn, method: str):
    if not inspect.isasyncgenfunction(fn):
        return _wrap_unary(fn, method)  # a streaming handler that writes with context.write()

    async def wrapped(request, context):
        # Written here with context.write(), not yielded to grpc: a Cancel that lands while a
        # message is being sent then raises in this frame too, so the call still ends CANCELLED
        # (yielded, it raised inside grpc's own loop, which ended the call with no status at all,
        # and the caller waited to its deadline). Still an async generator, yielding nothing:
        # interceptors (OpenTelemetry's) iterate a streaming handler.
        try:
            if (bad := _undecodable(request)) is not None:
                raise bad
            async for item in fn(request, context):
                await context.write(item)
        except asyncio.CancelledError:
            await _cancelled_here(context)
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(context, e, method)
        return
        yield  # (unreached: makes this an async generator)

    return wrapped


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    service_names: tuple[str, ...]
    grace_s: float

    async def set_serving(self) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def shutdown(self) -> None:
        """NOT_SERVING at once, then drain in-flight calls for the grace period."""
        try:
            # A health watcher that stops reading holds the servicer's lock while it writes:
            # never let it keep the process from draining and exiting.
            await asyncio.wait_for(self.health.enter_graceful_shutdown(), timeout=1.0)
        except TimeoutError:
            log.warning("health status not updated in time (a stalled health watcher); draining anyway")
        await self.server.stop(self.grace_s)

    def install_signal_handlers(self, on_shutdown: Callable[[], None] | None = None) -> asyncio.Event:
        """SIGTERM/SIGINT start `shutdown()`; the returned event is set when it has finished."""
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def handle(signame: str) -> None:
            log.info("shutting down", signal=signame, grace_s=self.grace_s)
            if on_shutdown:
                on_shutdown()

            async def run() -> None:
                await self.shutdown()
                done.set()

            loop.create_task(run())
            # However teardown goes (a stuck native thread, a starved machine), the process exits:
            # 0 when the drain itself finished, 1 when even that did not.
            threading.Thread(target=_exit_after, args=(self.grace_s + EXIT_DEADLINE_S, done), daemon=True).start()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handle, sig.name)
        return done


async def build_server(
    name: str,
    register: Callable[[grpc.aio.Server], list[str]],
    host: str = "127.0.0.1",
    port: int = 0,
    grace_s: float = 5.0,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    also_at: tuple[str, ...] = (),
    max_request_bytes: int | None = None,
    client_facing: bool = False,
    calls: Counter[str] | None = None,
) -> ServerHandle:
    """Start a server; `register` adds the servicers and returns their full service names.
    `also_at`: more addresses to serve the same services at (e.g. "unix-abstract:NAME").
    `max_request_bytes`: larger requests are refused INVALID_ARGUMENT before they are parsed.
    `client_facing`: its RPCs take client API keys (the router's), and TLS asks no client
    certificate; otherwise every RPC takes the service token alone (see runtime.auth).
    `calls`: counted into, by full method name, for every call that reaches the handlers."""
    telemetry.setup_tracing(name)
    creds = auth.current()
    if (why := creds.refusal()) is not None:
        raise SystemExit(f"{name}: {why}")
    guard = []
    if creds.insecure:
        log.warning("running with --insecure: no credential is checked on any call", server=name)
    else:
        guard = [AuthInterceptor(creds, client_facing)]
    server = grpc.aio.server(
        interceptors=[*guard, *telemetry.server_interceptors(), ErrorInterceptor(max_request_bytes, calls)],
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0), *_SERVER_KEEPALIVE],
    )
    service_names = tuple(register(server))
    health = HealthServicer()
    for svc in ("", *service_names):
        await health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    tls = creds.server_credentials(require_client_cert=not client_facing)
    bound = 0
    for address in (f"{host}:{port}", *also_at):
        got = server.add_secure_port(address, tls) if tls else server.add_insecure_port(address)
        if got == 0:
            raise RuntimeError(f"{name}: cannot bind {address}")
        bound = bound or got
    await server.start()
    log.info("listening", server=name, address=f"{host}:{bound}", tls=tls is not None)
    return ServerHandle(server, bound, health, service_names, grace_s)


def channel(target: str) -> grpc.aio.Channel:
    """An internal client channel: it carries the service token on every call (and TLS when this
    process has certificates), with keepalive, tracing interceptors and our message-size limits."""
    creds = auth.current()
    interceptors = [*(bearer_interceptors(creds.metadata()) if creds.service_token else []),
                    *telemetry.client_interceptors()]
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *_KEEPALIVE, *_RECONNECT]
    tls = creds.channel_credentials()
    if tls is not None:
        return grpc.aio.secure_channel(target, tls, interceptors=interceptors, options=options)
    return grpc.aio.insecure_channel(target, interceptors=interceptors, options=options)
