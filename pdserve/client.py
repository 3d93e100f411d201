"""The pdserve client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for a router.

    with pdserve.Client("127.0.0.1:50050") as c:
        print(c.generate("Hello", max_tokens=16).text)
        for ev in c.stream("Hello", max_tokens=16):
            print(ev.text, end="", flush=True)

The router wants an API key: `api_key=`, else env PDSERVE_API_KEY (the line `pdserve up`
prints). `ca_path`: a PEM CA to reach a router serving TLS (else plaintext).

Errors arrive as typed exceptions (pdserve.errors): InvalidArgument, ResourceExhausted,
Unavailable, NotFound, DeadlineExceeded, Unauthenticated, PermissionDenied, or PdserveError for
anything else.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve import errors
from pdserve.rpc.stream_interval import events_of
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}
# One typed error per status: the classes of pdserve.errors, named (subclasses defined elsewhere,
# e.g. a service's, would make the table depend on what was imported first).
_ERRORS = {cls.code: cls for cls in (errors.InvalidArgument, errors.NotFound, errors.ResourceExhausted,
                                     errors.Unavailable, errors.FailedPrecondition, errors.Unauthenticated,
                                     errors.PermissionDenied, errors.DataLoss, errors.AlreadyExists,
                                     errors.DeadlineExceeded)}
ENV_API_KEY = "PDSERVE_API_KEY"


class Cancelled(errors.PdserveError):
    code = grpc.StatusCode.CANCELLED


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str
    logprob: float
    index: int
    finish_reason: str | None


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    route: dict = field(default_factory=dict)


SAMPLING = {"max_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop_token_ids": (),
            "ignore_eos": False}  # the keyword arguments generate/stream take, with their defaults
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


def _invalid(message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"INVALID_ARGUMENT: {message}")  # (worded as the server's refusals are)


def _int_in(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _invalid(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _request(method: str, prompt: str | list[int], request_id: str, sampling: dict) -> router_pb2.GenerateRequest:
    """The wire request, checked here so a bad argument is a clear InvalidArgument (or a TypeError
    naming the public method), never protobuf's own error."""
    unknown = sorted(set(sampling) - SAMPLING.keys())
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"sampling takes {', '.join(SAMPLING)}")
    p = {**SAMPLING, **sampling}
    _int_in("max_tokens", p["max_tokens"], 1, _U32)
    _int_in("top_k", p["top_k"], 0, _U32)
    if p["seed"] is not None:
        _int_in("seed", p["seed"], 0, _U64)
    for t in p["stop_token_ids"]:
        _int_in("stop_token_ids[]", t, 0, (1 << 31) - 1)
    for name in ("temperature", "top_p"):
        if isinstance(p[name], bool) or not isinstance(p[name], int | float):
            raise _invalid(f"{name} must be a number, got {p[name]!r}")
    if not isinstance(prompt, str) and not (isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= (1 << 31) - 1 for t in prompt)):
        raise _invalid("prompt must be a string or a list of non-negative token ids")
    if not isinstance(request_id, str):
        raise _invalid(f"request_id must be a string, got {request_id!r}")
    sampling_pb = common_pb2.SamplingParams(
        max_tokens=p["max_tokens"], temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
        stop_token_ids=list(p["stop_token_ids"]), ignore_eos=bool(p["ignore_eos"]))
    if p["seed"] is not None:
        sampling_pb.seed = p["seed"]
    req = router_pb2.GenerateRequest(request_id=request_id, sampling=sampling_pb)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _event(t: common_pb2.TokenEvent) -> TokenEvent:
    return TokenEvent(t.token_id, t.text, t.logprob, t.index, _FINISH.get(t.finish_reason))


def _events(msg: router_pb2.GenerateResponse) -> list[TokenEvent]:
    """A stream message's tokens: one, or several when the router streams every N."""
    return [_event(t) for t in events_of(msg)]


def _result(tokens: list[TokenEvent], s: router_pb2.GenerateSummary) -> Result:
    u, t, r = s.usage, s.timings, s.route
    return Result(
        request_id=s.request_id, text="".join(e.text for e in tokens), token_ids=[e.token_id for e in tokens],
        logprobs=[e.logprob for e in tokens], finish_reason=_FINISH.get(s.finish_reason),
        usage={"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
               "cached_tokens_local": u.cached_tokens_local, "cached_tokens_store": u.cached_tokens_store,
               "computed_tokens": u.computed_tokens, "cached_tokens_cluster": u.cached_tokens_cluster},
        timings={"ttft_ms": t.ttft_ms, "total_ms": t.total_ms, "prefill_ms": t.prefill_ms,
                 "store_write_ms": t.store_write_ms, "pull_wait_ms": t.pull_wait_ms, "queue_ms": t.queue_ms,
                 "route_ms": t.route_ms, "load_ms": t.load_ms, "decode_admit_ms": t.decode_admit_ms},
        route={"prefill": r.prefill_worker, "decode": r.decode_worker, "policy": r.policy,
               "colocated": r.colocated, "expected_hit_tokens": r.expected_hit_tokens,
               "estimated_ttft_ms": r.estimated_ttft_ms, "best_hit_tokens": r.best_hit_tokens})


def _error(e: grpc.RpcError) -> errors.PdserveError:
    code = e.code()
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled(e.details() or "cancelled")
    cls = _ERRORS.get(code, errors.PdserveError)
    err = cls(f"{code.name}: {e.details()}")
    return err


# gRPC metadata on a generate call: the timeout the client set, in ms. The router subtracts what is
# left of the call's deadline when its handler starts, to learn how long the call waited in its
# server's queue before that (its TTFT SLO counts the wait).
TIMEOUT_KEY = "pdserve-timeout-ms"


def _generate_options(timeout_s: float | None, default_s: float, metadata: tuple[tuple[str, str], ...]) -> dict:
    """A call's timeout: `timeout_s`, or the client's `default_s` when None."""
    timeout_s = default_s if timeout_s is None else timeout_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise _invalid(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return {"timeout": timeout_s, "metadata": (*metadata, (TIMEOUT_KEY, f"{timeout_s * 1e3:.0f}"))}


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The key stripped, as the services strip theirs (a key read from a file ends in a newline,
    which gRPC would refuse on every call as INTERNAL 'Invalid metadata')."""
    key = (os.environ.get(ENV_API_KEY, "") if api_key is None else api_key).strip()
    if not (key.isascii() and key.isprintable()):
        raise _invalid("the API key must be printable ASCII")
    return (("authorization", f"Bearer {key}"),) if key else ()


def _tls(ca_path: str | None) -> grpc.ChannelCredentials | None:
    return grpc.ssl_channel_credentials(Path(ca_path).read_bytes()) if ca_path else None


class Client:
    """Blocking client. Thread-safe; one channel."""

    def __init__(self, target: str, timeout_s: float = 120.0, api_key: str | None = None,
                 ca_path: str | None = None):
        self.timeout_s = timeout_s
        self._metadata = _metadata(api_key)  # (checked before a channel is made)
        tls = _tls(ca_path)
        self._channel = grpc.secure_channel(target, tls) if tls else grpc.insecure_channel(target)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | list[int], request_id: str = "", timeout_s: float | None = None,
                 **sampling) -> Result:
        try:
            resp = self._stub.GenerateUnary(_request("Client.generate", prompt, request_id, sampling),
                                            **_generate_options(timeout_s, self.timeout_s, self._metadata))
        except grpc.RpcError as e:
            raise _error(e) from None
        return _result([_event(t) for t in resp.tokens], resp.summary)

    def stream(self, prompt: str | list[int], request_id: str = "", timeout_s: float | None = None,
               **sampling) -> Iterator[TokenEvent]:
        for item in self.generate_streamed(prompt, request_id, timeout_s, **sampling):
            if isinstance(item, TokenEvent):
                yield item

    def generate_streamed(self, prompt: str | list[int], request_id: str = "", timeout_s: float | None = None,
                          **sampling) -> Iterator[TokenEvent | Result]:
        """Token events as they come, then the `Result` (usage, timings, route)."""
        call = self._stub.Generate(_request("Client.stream", prompt, request_id, sampling),
                                   **_generate_options(timeout_s, self.timeout_s, self._metadata))
        tokens: list[TokenEvent] = []
        try:
            for msg in call:
                if msg.HasField("summary"):
                    yield _result(tokens, msg.summary)
                for event in _events(msg):
                    tokens.append(event)
                    yield event
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    def status(self) -> router_pb2.StatusResponse:
        try:
            return self._stub.Status(router_pb2.StatusRequest(), timeout=10, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None


class AsyncClient:
    """asyncio client; create and use it inside one event loop."""

    def __init__(self, target: str, timeout_s: float = 120.0, api_key: str | None = None,
                 ca_path: str | None = None):
        self.timeout_s = timeout_s
        self._metadata = _metadata(api_key)  # (checked before a channel is made)
        tls = _tls(ca_path)
        self._channel = grpc.aio.secure_channel(target, tls) if tls else grpc.aio.insecure_channel(target)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: str | list[int], request_id: str = "", timeout_s: float | None = None,
                       **sampling) -> Result:
        try:
            resp = await self._stub.GenerateUnary(_request("AsyncClient.generate", prompt, request_id, sampling),
                                                  **_generate_options(timeout_s, self.timeout_s, self._metadata))
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return _result([_event(t) for t in resp.tokens], resp.summary)

    async def stream(self, prompt: str | list[int], request_id: str = "", timeout_s: float | None = None,
                     **sampling) -> AsyncIterator[TokenEvent]:
        async for item in self.generate_streamed(prompt, request_id, timeout_s, **sampling):
            if isinstance(item, TokenEvent):
                yield item

    async def generate_streamed(self, prompt: str | list[int], request_id: str = "",
                                timeout_s: float | None = None, **sampling) -> AsyncIterator[TokenEvent | Result]:
        call = self._stub.Generate(_request("AsyncClient.stream", prompt, request_id, sampling),
                                   **_generate_options(timeout_s, self.timeout_s, self._metadata))
        tokens: list[TokenEvent] = []
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.HasField("summary"):
                    yield _result(tokens, msg.summary)
                for event in _events(msg):
                    tokens.append(event)
                    yield event
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    async def status(self) -> router_pb2.StatusResponse:
        try:
            return await self._stub.Status(router_pb2.StatusRequest(), timeout=10, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
