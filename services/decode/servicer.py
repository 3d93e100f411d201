"""Decode gRPC servicer: protobuf at the edge, `Decoder` inside."""

from __future__ import annotations

import math

from pdserve.errors import InvalidArgument, NotFound
from pdserve.rpc.convert import finish_to_pb
from pdserve.rpc.stream_interval import MAX_STREAM_INTERVAL, grouped, packed
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from pdserve.worker.bootstrap import Worker
from pdserve.worker.validate import request_basics
from services.decode.decoder import Admitted, DecodeInput, Decoder, Done, FirstToken, Token


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: Worker, decoder: Decoder):
        self.w = worker
        self.decoder = decoder

    async def Generate(self, request, context):
        engine = self.w.engine.engine
        ids, params = request_basics(request.request_id, request.prompt_token_ids, request.sampling,
                                     request.profile, self.w.profile, self.w.model.config.vocab_size,
                                     engine.max_model_len)
        if request.mode == decode_pb2.DECODE_MODE_UNSPECIFIED:
            raise InvalidArgument("mode is required: DISAGGREGATED or COLOCATED")
        # Wait for prefill as long as the caller's deadline allows (the router sets the request's).
        remaining = context.time_remaining()
        timeout_s = (request.prefill_timeout_ms / 1000 if request.prefill_timeout_ms else
                     remaining if remaining is not None else self.w.cfg.prefill_timeout_ms / 1000)
        if request.stream_interval > MAX_STREAM_INTERVAL:
            raise InvalidArgument(f"stream_interval must be at most {MAX_STREAM_INTERVAL}, "
                                  f"got {request.stream_interval}")
        req = DecodeInput(request.request_id, ids, params, request.mode == decode_pb2.DECODE_MODE_COLOCATED,
                          request.tail_key, timeout_s)
        token = lambda item: _token_pb(item) if isinstance(item, Token) else None  # noqa: E731
        async for out in grouped(self.decoder.generate(req), max(request.stream_interval, 1), token):
            yield packed(decode_pb2.DecodeEvent, out) if isinstance(out, list) else to_pb(out)

    async def FirstToken(self, request, context):
        p = request.prefill
        if not request.request_id or request.request_id != p.request_id:
            raise InvalidArgument("FirstToken: request_id must be set and match the prefill response")
        vocab = self.w.model.config.vocab_size
        first = FirstToken(p.first_token.token_id, p.first_token.logprob, list(p.block_hashes), p.kv_hold_lease_id)
        try:
            if not 0 <= first.token_id < vocab or not math.isfinite(first.logprob):
                raise InvalidArgument(f"FirstToken: token {first.token_id} must be in [0, {vocab}) with a finite "
                                      f"logprob (got {first.logprob})")
            self.decoder.deliver_first_token(request.request_id, first)
        except (InvalidArgument, NotFound):  # refused, or no request of it here
            if first.hold_lease_id:  # nobody here will pull those blocks: let the store have them back
                self.w.store.release_soon(first.hold_lease_id)
            if p.tail_key:  # and the tail, read by no one (it would sit pinned for its TTL)
                await self.decoder.drop_tail(p.tail_key)
            raise
        return decode_pb2.FirstTokenResponse()

    async def Cancel(self, request, context):
        return prefill_pb2.CancelResponse(found=await self.decoder.cancel(request.request_id))

    async def Load(self, request, context):
        return common_pb2.WorkerLoad(**self.w.engine.load, inflight_requests=len(self.decoder.inflight))


def to_pb(item: Admitted | Done) -> decode_pb2.DecodeEvent:
    """Anything but a token (tokens: `_token_pb`, grouped)."""
    if isinstance(item, Admitted):
        return decode_pb2.DecodeEvent(admitted=decode_pb2.Admitted(reserved_blocks=item.reserved_blocks,
                                                                   local_hit_blocks=item.local_hit_blocks))
    return decode_pb2.DecodeEvent(done=decode_pb2.DecodeDone(
        finish_reason=finish_to_pb(item.finish_reason),
        usage=common_pb2.Usage(prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens,
                               cached_tokens_local=item.cached_local),
        timings=common_pb2.Timings(pull_wait_ms=item.timings_ms["pull_wait_ms"],
                                   total_ms=item.timings_ms["total_ms"])))


def _token_pb(item: Token) -> common_pb2.TokenEvent:
    ev = item.event
    return common_pb2.TokenEvent(token_id=ev.token_id, text=item.text, logprob=ev.logprob, index=ev.index,
                                 finish_reason=finish_to_pb(ev.finish_reason))
