"""The interceptors that enforce `auth`: one on every server (checks the bearer credential before
the handler, or even the request's parsing, runs) and one on every internal channel (adds the
service token to every call)."""

from __future__ import annotations

import grpc

from pdserve.runtime.auth import AUTH_HEADER, OPEN_PREFIXES, Caller, Credentials, bearer


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code` at once; the request
    stays unparsed bytes (no deserializer), so a refused caller costs no parsing."""

    async def refuse(_request, context):
        await context.abort(code, message)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but health and reflection needs a credential in its metadata.

    `client_facing`: the server's RPCs are client RPCs (the router's), which take an API key or the
    service token; otherwise every RPC is internal and takes the service token alone."""

    def __init__(self, creds: Credentials, client_facing: bool):
        self.creds = creds
        self.client_facing = client_facing

    def verdict(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status it ends with."""
        if method.startswith(OPEN_PREFIXES):
            return None
        token = bearer(metadata)
        if not token:
            want = "an API key or the service token" if self.client_facing else "the deployment's service token"
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"{method}: no credential: send '{AUTH_HEADER}: Bearer <token>' metadata with {want}")
        caller = self.creds.caller(token)
        if caller is None:
            return grpc.StatusCode.UNAUTHENTICATED, f"{method}: credential not recognised"
        if caller is Caller.CLIENT and not self.client_facing:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: an API key may not call an internal RPC (it takes the service token)")
        return None

    async def intercept_service(self, continuation, details):
        refused = self.verdict(details.method, details.invocation_metadata)
        handler = await continuation(details)
        if refused is None or handler is None:
            return handler
        return _deny(handler, *refused)


class _Bearer:
    """Adds `authorization: Bearer <service token>` to every call of a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        own = tuple(details.metadata or ())
        return details._replace(metadata=grpc.aio.Metadata(*own, *self._metadata))


# grpc.aio files each interceptor under the first call kind it implements, so one class per kind.
class _UnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _UnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _StreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


class _StreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


def bearer_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `metadata` (the service token) to every call of a channel."""
    return [cls(metadata) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
