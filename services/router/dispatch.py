"""Run one request across a prefill and a decode worker, concurrently, tied by its request id.

Decode admits first (reserve or refuse at once) and starts watching the store; prefill runs at
the same time; prefill's first token is yielded the moment it exists (TTFT never waits on the
handoff) and forwarded to decode, whose stream then continues from token 1 while prefill's last
commits land. Either side failing, before or after the first token, cancels the other, so
nothing stays held anywhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pdserve.errors import PdserveError
from pdserve.rpc.stream_interval import events_of
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

FIRST_TOKEN_TIMEOUT_S = 10.0  # one small unary call to a worker already streaming this request

_finishing: set[asyncio.Future] = set()  # handoffs whose request was answered, still completing


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
    handoff: common_pb2.Timings  # prefill's, once its handoff completed (its writes, all of them)


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
    on_handoff: Callable[[], None] | None = None,
) -> AsyncIterator[DecodeAdmitted | FirstFromPrefill | common_pb2.TokenEvent | Finished]:
    """Yields decode's admission, prefill's first token, then decode's tokens (index >= 1; decode sends them
    `stream_interval` to a message), then `Finished`. Both calls carry the request's deadline:
    decode waits for prefill as long as it allows. `on_handoff`: called when prefill's handoff
    completes (after its first token), if it does."""
    deadline = time.monotonic() + timeout_s
    decode_call = decode.Generate(decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
        mode=decode_pb2.DECODE_MODE_DISAGGREGATED, profile=profile, stream_interval=stream_interval),
        timeout=timeout_s)
    prefill_call = handoff = response = None
    told = False  # decode has the first token (and with it the handoff's hold)
    answered = False  # the last token (or the result) is out: the request is done
    pulled = False  # decode sent a token past the first: it streams only once it has read every block
    try:
        admitted = await _expect(decode_call, "decode", "admitted", "stream did not start with admission")
        yield DecodeAdmitted(time.perf_counter())
        prefill_call = prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, profile=profile),
            timeout=max(deadline - time.monotonic(), 0.001))
        response = await _expect(prefill_call, "prefill", "first", "stream did not start with the first token")
        yield FirstFromPrefill(response, time.perf_counter())
        handoff = asyncio.ensure_future(_handoff_done(prefill_call))
        if on_handoff is not None:
            handoff.add_done_callback(lambda f: _succeeded(f) and on_handoff())
        if response.first_token.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            answered = True
            yield Finished(decode_pb2.DecodeDone(finish_reason=response.first_token.finish_reason,
                                                 usage=response.usage), admitted, _timings(handoff))
            return
        try:
            await decode.FirstToken(decode_pb2.FirstTokenRequest(request_id=request_id, prefill=response),
                                    timeout=min(FIRST_TOKEN_TIMEOUT_S, max(deadline - time.monotonic(), 0.001)))
            told = True
        except grpc.aio.AioRpcError as e:
            raise await _decode_failure(decode_call, e) from e
        try:
            # Once decode has every block, the handoff's outcome is no longer this request's.
            while (event := await (decode_call.read() if pulled else _next(decode_call, handoff))) is not grpc.aio.EOF:
                if event.HasField("done"):
                    answered = True
                    yield Finished(event.done, admitted, _timings(handoff))
                    return
                for token in events_of(event):
                    if token.index > 0:
                        pulled = True
                        answered = answered or token.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                        yield token
            raise DispatchError(grpc.StatusCode.INTERNAL, "decode: stream ended without a result")
        except grpc.aio.AioRpcError as e:
            raise _error("decode", e) from e
    finally:
        decode_call.cancel()
        if response is not None and response.kv_hold_lease_id and not (told or answered):
            _tell_late(decode, request_id, response)
        if (answered or pulled) and handoff is not None and not handoff.done():
            # Pulled (or answered in full) while prefill's last commits are still being confirmed:
            # they are its prefix cache, so its call runs on to its end (its deadline bounds it).
            _finishing.add(handoff)
            handoff.add_done_callback(_forget)
        elif prefill_call is not None:
            prefill_call.cancel()
            if handoff is not None:
                handoff.cancel()  # (a no-op once done)
                _forget(handoff)


async def _expect(call, side: str, field: str, otherwise: str):
    """The `field` of `side`'s call's next message; that call's failure, or a message without it
    (`otherwise` says so), as a DispatchError."""
    try:
        event = await call.read()
    except grpc.aio.AioRpcError as e:
        raise _error(side, e) from e
    if event is grpc.aio.EOF or not event.HasField(field):
        raise DispatchError(grpc.StatusCode.INTERNAL, f"{side}: {otherwise}")
    return getattr(event, field)


async def _handoff_done(prefill_call) -> common_pb2.Timings:
    """Prefill's second message, once the last of the prompt's blocks is committed in the store."""
    return (await _expect(prefill_call, "prefill", "done", "stream ended before its handoff completed")).timings


def _failure(handoff: asyncio.Future) -> BaseException | None:
    return handoff.exception() if handoff.done() and not handoff.cancelled() else None


def _succeeded(handoff: asyncio.Future) -> bool:
    return handoff.done() and not handoff.cancelled() and handoff.exception() is None


def _timings(handoff: asyncio.Future) -> common_pb2.Timings:
    """The handoff's timings, when it has completed (none while it has not)."""
    return handoff.result() if _succeeded(handoff) else common_pb2.Timings()


def _tell_late(decode: decode_pb2_grpc.DecodeStub, request_id: str, response: prefill_pb2.PrefillResponse) -> None:
    """The request ended before decode heard of its handoff: tell it now, so that it releases the
    store's hold on the prompt's blocks (no request of its own waits for them) rather than the
    hold pinning them until it lapses. Best effort: the lapse still bounds it."""
    told = asyncio.ensure_future(decode.FirstToken(
        decode_pb2.FirstTokenRequest(request_id=request_id, prefill=response), timeout=FIRST_TOKEN_TIMEOUT_S))
    _finishing.add(told)
    told.add_done_callback(_forget)


def _forget(handoff: asyncio.Future) -> None:
    """A handoff no one waits on any more: its outcome retrieved (a failure after the request was
    answered in full is not the request's: decode had read every block)."""
    _finishing.discard(handoff)
    _failure(handoff)


async def _next(decode_call, handoff: asyncio.Future):
    """Decode's next message; a failure of the handoff, while it completes, comes first."""
    if _succeeded(handoff):
        return await decode_call.read()
    read = asyncio.ensure_future(decode_call.read())
    try:
        if not handoff.done():
            await asyncio.wait((read, handoff), return_when=asyncio.FIRST_COMPLETED)
        if (failed := _failure(handoff)) is not None:
            raise failed
        return await read
    finally:
        read.cancel()  # (a no-op once done)


async def colocated(decode: decode_pb2_grpc.DecodeStub, request_id: str, prompt_ids: list[int],
                    sampling: common_pb2.SamplingParams, profile: common_pb2.HashProfile | None, timeout_s: float,
                    stream_interval: int = 1) -> AsyncIterator[common_pb2.TokenEvent | Finished]:
    """One request on a decode worker alone (it prefills too): its tokens, index 0 first, then
    `Finished` (its usage: the prompt tokens decode's own cache held)."""
    call = decode.Generate(decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, profile=profile,
        mode=decode_pb2.DECODE_MODE_COLOCATED, stream_interval=stream_interval), timeout=timeout_s)
    try:
        while (event := await call.read()) is not grpc.aio.EOF:
            if event.HasField("done"):
                yield Finished(event.done, None, common_pb2.Timings())
                return
            for token in events_of(event):
                yield token
    except grpc.aio.AioRpcError as e:
        raise _error("decode", e) from e
    finally:
        call.cancel()
