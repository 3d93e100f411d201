"""The stream interval's grouping (pdserve/rpc/stream_interval.py): pure logic, no I/O."""

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
