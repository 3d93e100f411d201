"""Prefill gRPC servicer: protobuf at the edge, `Prefiller` inside."""

from __future__ import annotations

from pdserve.rpc.convert import finish_to_pb
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.worker.bootstrap import Worker
from pdserve.worker.validate import request_basics
from services.prefill.prefiller import Prefiller, PrefillInput, PrefillOutput


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: Worker, prefiller: Prefiller):
        self.w = worker
        self.prefiller = prefiller

    async def Prefill(self, request, context):
        engine = self.w.engine.engine
        ids, params = request_basics(request.request_id, request.prompt_token_ids, request.sampling,
                                     request.profile, self.w.profile, self.w.model.config.vocab_size,
                                     engine.max_model_len)
        async for out in self.prefiller.prefill(PrefillInput(request.request_id, ids, params, request.tail_key)):
            if isinstance(out, PrefillOutput):
                yield prefill_pb2.PrefillEvent(first=to_pb(out, self.w.model.tokenizer.decode([out.first_token]),
                                                           len(ids)))
            else:
                yield prefill_pb2.PrefillEvent(done=prefill_pb2.PrefillDone(timings=common_pb2.Timings(
                    **out.timings_ms)))

    async def Cancel(self, request, context):
        return prefill_pb2.CancelResponse(found=await self.prefiller.cancel(request.request_id))

    async def Load(self, request, context):
        return common_pb2.WorkerLoad(**self.w.engine.load, inflight_requests=len(self.prefiller.inflight))


def to_pb(out: PrefillOutput, text: str, prompt_tokens: int) -> prefill_pb2.PrefillResponse:
    t = out.timings_ms
    return prefill_pb2.PrefillResponse(
        request_id=out.request_id,
        first_token=common_pb2.TokenEvent(token_id=out.first_token, text=text, logprob=out.first_logprob, index=0,
                                          finish_reason=finish_to_pb(out.finish_reason)),
        block_hashes=out.block_hashes, tail_key=out.tail_key, kv_hold_lease_id=out.kv_hold_lease_id,
        usage=common_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens_local=out.cached_local,
                               cached_tokens_store=out.cached_store, computed_tokens=out.computed,
                               cached_tokens_cluster=out.cached_cluster),
        timings=common_pb2.Timings(**t))
