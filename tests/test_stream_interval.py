"""The stream interval's grouping (pdserve/rpc/stream_interval.py; the HTTP API's SSE chunks): no I/O."""

from __future__ import annotations

import asyncio

from pdserve.rpc.stream_interval import grouped
from pdserve.v1 import common_pb2 as pb


def test_tokens_are_grouped_n_to_a_message_and_none_is_lost():
    """`grouped` (the stream interval): the first token alone, then `every` to a list, a finishing
    token closing its list, anything else after the tokens before it, and what is held when the
    source fails out before the error."""
    def ev(i: int, finish: int = 0) -> pb.TokenEvent:
        return pb.TokenEvent(token_id=100 + i, index=i, finish_reason=finish)

    async def source(items, fail: bool = False):
        for item in items:
            yield item
        if fail:
            raise RuntimeError("decode went away")

    def shape(out):
        return [[e.index for e in o] if isinstance(o, list) else o for o in out]

    async def run(items, every: int, fail: bool = False):
        out = []
        try:
            async for o in grouped(source(items, fail), every, lambda x: x if isinstance(x, pb.TokenEvent) else None):
                out.append(o)
        except RuntimeError as e:
            out.append(str(e))
        return shape(out)

    stop = pb.FINISH_REASON_LENGTH
    assert asyncio.run(run([ev(0), *map(ev, range(1, 6)), ev(6, stop), "summary"], 3)) == [
        [0], [1, 2, 3], [4, 5, 6], "summary"]
    assert asyncio.run(run([ev(1), ev(2), "done", ev(3)], 4)) == [[1, 2], "done", [3]]
    assert asyncio.run(run([ev(0), ev(1), ev(2)], 4, fail=True)) == [[0], [1, 2], "decode went away"]
    assert asyncio.run(run([ev(0), ev(1), ev(2, stop)], 1)) == [[0], [1], [2]]


def test_sse_chunks_group_a_choices_tokens_and_release_the_held_ones():
    """The HTTP API's `Shape` at interval 3, two choices interleaved: each choice's first token
    alone, then three to a chunk; what a choice holds when the stream fails comes out as its own
    chunks (before the error event), text and token ids in order."""
    import json

    from pdserve.model.loader import load_model
    from services.router.http.choices import Token
    from services.router.http.responses import Shape

    shape = Shape(False, "tiny", load_model("tiny").tokenizer, False, 2, interval=3)
    out = []
    for i in range(5):
        for choice in (0, 1):
            if chunk := shape.chunk(Token(choice, 100 + 10 * choice + i, f"<{choice}.{i}>", -0.5)):
                out.append(chunk)
    out += shape.pending_chunks()
    got = [(c["index"], c["text"], c["pdserve"]["token_ids"])
           for c in (json.loads(o.removeprefix("data: "))["choices"][0] for o in out)]
    assert got == [(0, "<0.0>", [100]), (1, "<1.0>", [110]),
                   (0, "<0.1><0.2><0.3>", [101, 102, 103]), (1, "<1.1><1.2><1.3>", [111, 112, 113]),
                   (0, "<0.4>", [104]), (1, "<1.4>", [114])]
    assert shape.pending_chunks() == []
