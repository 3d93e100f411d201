"""OpenTelemetry tracing. Off unless the standard OTEL_* env vars ask for an exporter.

OTEL_TRACES_EXPORTER=otlp (or OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT set) turns on OTLP/gRPC export;
OTEL_TRACES_EXPORTER=console prints spans. Unset: the API's no-op tracer, which costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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


def server_interceptors() -> list:
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list:
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


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
