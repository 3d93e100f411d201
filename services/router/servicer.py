"""Router gRPC servicer: protobuf at the edge, `Router` inside."""

from __future__ import annotations

import math

from pdserve import logs
from pdserve.errors import InvalidArgument
from pdserve.rpc.convert import sampling_from_pb
from pdserve.rpc.stream_interval import grouped, packed
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.limits import check_request_id
from services.router.route_types import Summary, TokenOut
from services.router.router import Router

TIMEOUT_KEY = "pdserve-timeout-ms"  # gRPC metadata: the timeout the client set, in ms (the SDK sends it)


def waited_before_handler_ms(context) -> float | None:
    """How long the call waited between reaching this server and its handler starting: the
    timeout the client says it set less what is left of the call's deadline (gRPC starts that
    deadline when the call arrives). Calls wait there, in gRPC's queue of calls the server has not
    yet taken, while the event loop is busy: seconds under overload (docs/perf-log.md, S40).
    None when the client does not say."""
    remaining = context.time_remaining()
    for key, value in context.invocation_metadata() or ():
        if key == TIMEOUT_KEY and remaining is not None:
            try:
                sent_ms = float(value)
            except ValueError:
                sent_ms = math.nan
            if not math.isfinite(sent_ms) or sent_ms < 0:
                raise InvalidArgument(f"metadata {TIMEOUT_KEY!r} must be the call's timeout in ms, not {value!r}")
            return max(0.0, sent_ms - remaining * 1e3)
    return None


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, status, stream_interval: int = 1):
        self.router = router
        self.status = status
        self.stream_interval = stream_interval  # tokens a Generate message carries (the first goes alone)

    async def _request(self, request):
        check_request_id(request.request_id)
        logs.bind_request_id(request.request_id)
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt is empty: give text or token_ids")
        ids = await self.router.limits.prompt_ids(request.text if which == "text" else None,  # (read once: a copy)
                                     list(request.token_ids.ids) if which == "token_ids" else None)
        if not request.HasField("sampling") or request.sampling.max_tokens == 0:
            raise InvalidArgument("max_tokens must be >= 1")
        try:
            params = sampling_from_pb(request.sampling)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        return ids, self.router.limits.sampling(params, len(ids))

    async def _generate(self, request, context):
        waited_ms = waited_before_handler_ms(context)  # first: what follows is the handler's own time
        ids, params = await self._request(request)
        # The call's end (a cancel included) frees its id before its cleanup has run.
        gone = lambda release: context.add_done_callback(lambda _: release())  # noqa: E731
        async for item in self.router.generate(request.request_id, ids, params, context.time_remaining(),
                                               waited_ms=waited_ms, on_client_gone=gone):
            yield item

    async def Generate(self, request, context):
        """Tokens as they come, `stream_interval` to a message (the first at once)."""
        token = lambda item: _token_pb(item) if isinstance(item, TokenOut) else None  # noqa: E731
        async for out in grouped(self._generate(request, context), self.stream_interval, token):
            if isinstance(out, list):
                yield packed(router_pb2.GenerateResponse, out)
            else:
                yield router_pb2.GenerateResponse(summary=_summary_pb(out))

    async def GenerateUnary(self, request, context):
        tokens, summary = [], None
        async for item in self._generate(request, context):
            if isinstance(item, TokenOut):
                tokens.append(_token_pb(item))
            else:
                summary = _summary_pb(item)
        return router_pb2.GenerateResult(text="".join(t.text for t in tokens), tokens=tokens, summary=summary)

    async def Status(self, request, context):
        return await self.status()


def _token_pb(t: TokenOut) -> common_pb2.TokenEvent:
    return common_pb2.TokenEvent(token_id=t.token_id, text=t.text, logprob=t.logprob, index=t.index,
                                 finish_reason=t.finish_reason)


def _summary_pb(s: Summary) -> router_pb2.GenerateSummary:
    r = s.route
    t = s.timings_ms
    return router_pb2.GenerateSummary(
        request_id=s.request_id, finish_reason=s.finish_reason,
        usage=common_pb2.Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                               cached_tokens_local=s.cached_local, cached_tokens_store=s.cached_store,
                               computed_tokens=s.computed, cached_tokens_cluster=s.cached_cluster),
        timings=common_pb2.Timings(ttft_ms=t.get("ttft_ms", 0), total_ms=t.get("total_ms", 0),
                                   prefill_ms=t.get("prefill_ms", 0), store_write_ms=t.get("store_write_ms", 0),
                                   pull_wait_ms=t.get("pull_wait_ms", 0), queue_ms=t.get("queue_ms", 0),
                                   route_ms=r.route_ms, load_ms=t.get("load_ms", 0),
                                   decode_admit_ms=t.get("decode_admit_ms", 0)),
        route=router_pb2.RouteDecision(
            prefill_worker=r.prefill.address if r.prefill else "", decode_worker=r.decode.address,
            policy=r.policy, expected_hit_tokens=r.expected_local_tokens + r.expected_store_tokens,
            estimated_ttft_ms=r.estimated_ttft_ms, colocated=r.prefill is None, best_hit_tokens=r.best_hit_tokens))
