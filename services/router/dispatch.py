"""Run one request across a prefill and a decode worker, concurrently, tied by its request id.

Decode admits first (reserve or refuse at once) and starts watching the store; prefill runs at
the same time; prefill's first token is yielded the moment it exists (TTFT never waits on the
handoff) and forwarded to decode, whose stream then continues from token 1. Either side failing
cancels the other, so nothing stays held anywhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from pdserve.errors import PdserveError
from pdserve.rpc.stream_interval import events_of
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

FIRST_TOKEN_TIMEOUT_S = 10.0  # one small unary call to a worker already streaming this request


@dataclass(frozen=True)
class DecodeAdmitted:
    at: float  # perf_counter when decode admitted the request (and prefill was sent)


@dataclass(frozen=True)
class FirstFromPrefill:
    response: prefill_pb2.PrefillResponse
    at: float  # perf_counter when it arrived


@dataclass(frozen=True)
class Finished:
    done: decode_pb2.DecodeDone
    admitted: decode_pb2.Admitted | None


class DispatchError(PdserveError):
    """A worker's call failed; `side` says whose ("prefill" or "decode")."""

    def __init__(self, code: grpc.StatusCode, message: str, side: str = ""):
        super().__init__(message)
        self.code = code
        self.side = side or message.split(":", 1)[0]


def _error(side: str, e: grpc.aio.AioRpcError) -> DispatchError:
    return DispatchError(e.code(), f"{side}: {e.details()}", side)


async def _decode_failure(decode_call, e: grpc.aio.AioRpcError) -> DispatchError:
    """FirstToken was refused: when the decode stream itself has ended with an error (the
    request is gone there, hence the refusal), that error is the request's."""
    try:
        code = await asyncio.wait_for(decode_call.code(), 0.5)
    except (TimeoutError, grpc.aio.AioRpcError):
        return _error("decode", e)
    if code == grpc.StatusCode.OK:
        return _error("decode", e)
    return DispatchError(code, f"decode: {await decode_call.details()}")


async def disaggregated(
    prefill: prefill_pb2_grpc.PrefillStub,
    decode: decode_pb2_grpc.DecodeStub,
    request_id: str,
    prompt_ids: list[int],
    sampling: common_pb2.SamplingParams,
    profile: common_pb2.HashProfile | None = None,
    timeout_s: float = 60.0,
    stream_interval: int = 1,
) -> AsyncIterator[DecodeAdmitted | FirstFromPrefill | common_pb2.TokenEvent | Finished]:
    """Yields decode's admission, prefill's first token, then decode's tokens (index >= 1; decode sends them
    `stream_interval` to a message), then `Finished`. Both calls carry the request's deadline:
    decode waits for prefill as long as it allows."""
    deadline = time.monotonic() + timeout_s
    decode_call = decode.Generate(decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
        mode=decode_pb2.DECODE_MODE_DISAGGREGATED, profile=profile, stream_interval=stream_interval),
        timeout=timeout_s)
    prefill_call = None
    try:
        try:
            first_event = await decode_call.read()
        except grpc.aio.AioRpcError as e:
            raise _error("decode", e) from e
        if first_event is grpc.aio.EOF or not first_event.HasField("admitted"):
            raise DispatchError(grpc.StatusCode.INTERNAL, "decode: stream did not start with admission")
        admitted = first_event.admitted
        yield DecodeAdmitted(time.perf_counter())
        prefill_call = prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, profile=profile),
            timeout=max(deadline - time.monotonic(), 0.001))
        try:
            response = await prefill_call
        except grpc.aio.AioRpcError as e:
            raise _error("prefill", e) from e
        yield FirstFromPrefill(response, time.perf_counter())
        if response.first_token.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            yield Finished(decode_pb2.DecodeDone(finish_reason=response.first_token.finish_reason,
                                                 usage=response.usage), admitted)
            return
        try:
            await decode.FirstToken(decode_pb2.FirstTokenRequest(request_id=request_id, prefill=response),
                                    timeout=min(FIRST_TOKEN_TIMEOUT_S, max(deadline - time.monotonic(), 0.001)))
        except grpc.aio.AioRpcError as e:
            raise await _decode_failure(decode_call, e) from e
        try:
            while (event := await decode_call.read()) is not grpc.aio.EOF:
                if event.HasField("done"):
                    yield Finished(event.done, admitted)
                    return
                for token in events_of(event):
                    if token.index > 0:
                        yield token
            raise DispatchError(grpc.StatusCode.INTERNAL, "decode: stream ended without a result")
        except grpc.aio.AioRpcError as e:
            raise _error("decode", e) from e
    finally:
        decode_call.cancel()
        if prefill_call is not None:
            prefill_call.cancel()


async def colocated(decode: decode_pb2_grpc.DecodeStub, request_id: str, prompt_ids: list[int],
                    sampling: common_pb2.SamplingParams, profile: common_pb2.HashProfile | None, timeout_s: float,
                    stream_interval: int = 1) -> AsyncIterator[common_pb2.TokenEvent]:
    """One request on a decode worker alone (it prefills too): its tokens, index 0 first."""
    call = decode.Generate(decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, profile=profile,
        mode=decode_pb2.DECODE_MODE_COLOCATED, stream_interval=stream_interval), timeout=timeout_s)
    try:
        while (event := await call.read()) is not grpc.aio.EOF:
            if event.HasField("done"):
                return
            for token in events_of(event):
                yield token
    except grpc.aio.AioRpcError as e:
        raise _error("decode", e) from e
    finally:
        call.cancel()
