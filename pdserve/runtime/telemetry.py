"""OpenTelemetry tracing. Off unless the standard OTEL_* env vars ask for an exporter.

OTEL_TRACES_EXPORTER=otlp (or OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT set) turns on OTLP/gRPC export;
OTEL_TRACES_EXPORTER=console prints spans. Unset: the API's no-op tracer, which costs nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry import context, propagate, trace

_provider = None


def tracing_requested() -> bool:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if exporter == "none":
        return False
    return bool(exporter) or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                  or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str) -> bool:
    """Install a tracer provider for this process when requested; True when tracing is on."""
    global _provider
    if _provider is not None:
        return True
    if not tracing_requested():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_TRACES_EXPORTER") == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint etc. from the standard env vars
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def _untraced():
    """Health checks and reflection: never traced (probes would bury requests in the UI)."""
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(filters.service_prefix("grpc.health."),
                                         filters.service_prefix("grpc.reflection.")))


def server_interceptors() -> list:
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_untraced())]


def client_interceptors() -> list:
    """OpenTelemetry's for unary calls; streaming calls get ours, whose span ends when the call
    does (OpenTelemetry's ends when its wrapper iterator is finalized: seconds after a call that
    was read to its last message without reading EOF, or cancelled)."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    unary = [i for i in aio_client_interceptors(filter_=_untraced())
             if isinstance(i, grpc.aio.UnaryUnaryClientInterceptor | grpc.aio.StreamUnaryClientInterceptor)]
    return [*unary, _UnaryStreamSpan(), _StreamStreamSpan()]


_pending: set = set()  # span-ending tasks, referenced until they run


class _StreamSpan:
    async def _traced(self, continuation, details, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return await continuation(details, request)
        span = trace.get_tracer("pdserve.rpc").start_span(method, kind=trace.SpanKind.CLIENT,
                                                          attributes={"rpc.system": "grpc"})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        details = details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *carrier.items()))
        try:
            call = await continuation(details, request)
        except Exception:
            span.end()
            raise

        async def finish(c) -> None:
            try:
                code = grpc.StatusCode.CANCELLED if c.cancelled() else await c.code()  # (done: at once)
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                    span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
            finally:
                span.end()

        def ended(c) -> None:
            _pending.add(task := asyncio.ensure_future(finish(c)))
            task.add_done_callback(_pending.discard)

        call.add_done_callback(ended)
        return call


class _UnaryStreamSpan(_StreamSpan, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await self._traced(continuation, details, request)


class _StreamStreamSpan(_StreamSpan, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await self._traced(continuation, details, request_iterator)


def current_context() -> dict[str, str]:
    """The current trace context as W3C headers, for a message that travels on a shared stream
    (whose own call belongs to no one request); empty when tracing is off."""
    if _provider is None:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextmanager
def detached() -> Iterator[None]:
    """Run without a current trace: for a long-lived call shared by many requests."""
    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)
