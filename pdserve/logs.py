"""structlog JSON logs; `request_id` and the trace id are bound per request through contextvars."""

from __future__ import annotations

import contextvars
import logging
import sys

import structlog
from opentelemetry import trace

_configured = False


def _add_trace_id(_, __, event: dict) -> dict:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = format(ctx.trace_id, "032x")
    return event


def configure(service: str, level: str = "INFO") -> None:
    global _configured
    if _configured:
        return
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_id,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _configured = True


def _request_id_var() -> contextvars.ContextVar:
    """The ContextVar structlog keeps `request_id` in (made by a bind, which is undone)."""
    token = structlog.contextvars.bind_contextvars(request_id=None)["request_id"]
    token.var.reset(token)
    return token.var


_REQUEST_ID = _request_id_var()


def bind_request_id(request_id: str) -> None:
    """This context's logs carry `request_id` from now on (none when empty): what
    bind_contextvars(request_id=...) does, as one ContextVar.set. The store binds it on every
    control call; the general call cost ~16 µs there, cold."""
    _REQUEST_ID.set(request_id or None)


def get(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
