"""What every HTTP request passes through: a bound on its body, and the request and error
counters by endpoint and status (pure ASGI, so streams and disconnects pass untouched)."""

from __future__ import annotations

import json

TOO_LARGE = "pdserve.body_over_limit"  # set in the scope of a request whose body ran past the limit
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Accounting:
    def __init__(self, app, metrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = [0]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            await _too_large(counted, self.max_body_bytes)
        else:
            seen = [0]

            async def bounded():
                message = await receive()
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:  # (a body longer than it said, or a chunked one)
                    scope[TOO_LARGE] = self.max_body_bytes  # (the endpoint answers 413: not a disconnect)
                    return {"type": "http.disconnect"}
                return message

            await self.app(scope, bounded, counted)
        self.metrics.count_labeled("http_requests", endpoint=endpoint, status=str(status[0]))
        if status[0] >= 400:
            self.metrics.count_labeled("http_errors", endpoint=endpoint, status=str(status[0]))


def too_large_body(limit: int) -> dict:
    return {"error": {"message": f"request body over {limit} bytes, this deployment's limit",
                      "type": "invalid_request_error", "param": None, "code": "request_too_large"}}


async def _too_large(send, limit: int) -> None:
    body = json.dumps(too_large_body(limit))
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body.encode()})
