"""Tokens N to a message on a token stream (the router's --stream-interval, which it passes on to
decode): every message is a system call on the connection, on each side, which costs a
loaded router or decode worker more than the token it carries (docs/perf-log.md, S41)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from pdserve.v1 import common_pb2 as pb

T = TypeVar("T")

MAX_STREAM_INTERVAL = 256  # tokens one message may carry


async def grouped(items: AsyncIterator[T], every: int, token: Callable[[T], pb.TokenEvent | None]
                  ) -> AsyncIterator[list[pb.TokenEvent] | T]:
    """`items` with their tokens (what `token` makes of an item; None: not a token) in lists of
    `every`: a first token (index 0) alone and at once (time to first token), a finishing one
    closing its list; any other item after the tokens before it. Tokens held when `items`
    fails go out before the error."""
    held: list[pb.TokenEvent] = []
    try:
        async for item in items:
            event = token(item)
            if event is None:
                if held:
                    yield held
                    held = []
                yield item
                continue
            held.append(event)
            if len(held) >= every or event.index == 0 or event.finish_reason:
                yield held
                held = []
        if held:
            yield held
    except Exception:
        if held:
            yield held
        raise


def packed(message_type, events: list[pb.TokenEvent]):
    """A stream message (`message_type`: one with `token` and `tokens` fields) carrying `events`:
    one in `token`, several in `tokens`. `events_of` reads it back."""
    if len(events) == 1:
        return message_type(token=events[0])
    return message_type(tokens=pb.TokenEvents(events=events))


def events_of(message) -> list[pb.TokenEvent]:
    """The tokens of a stream message (one in `token`, several in `tokens`, or none)."""
    if message.HasField("token"):
        return [message.token]
    if message.HasField("tokens"):
        return list(message.tokens.events)
    return []
