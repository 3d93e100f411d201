"""The choices of one HTTP request, each one router request, run through the router core that
the gRPC servicer also calls; several run concurrently and their events interleave."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.engine.sampling import SamplingParams
from pdserve.errors import Unavailable
from pdserve.v1 import common_pb2
from services.router.route_types import Summary, TokenOut
from services.router.router import Router

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "abort"}
STOP_WAIT_S = 2.0  # a cancelled choice's teardown (its calls cancelled, its counters put back)


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Token:
    """One token of choice `index`, with the text it releases (maybe none yet)."""

    index: int
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class End:
    index: int
    finish_reason: str
    summary: Summary


async def _one(router: Router, job: ChoiceJob) -> AsyncIterator[Token | End]:
    stop_tokens = set(job.params.stop_token_ids)
    finish, prev = "", None
    async with aclosing(router.generate(job.request_id, job.prompt_ids, job.params, None, job.stop)) as items:
        async for item in items:
            if isinstance(item, TokenOut):
                text = item.text
                if item.finish_reason == common_pb2.FINISH_REASON_STOP and item.token_id in stop_tokens:
                    text = text.removesuffix(_added_text(router.tokenizer, prev, item.token_id))  # (a stop token's)
                finish, prev = FINISH.get(item.finish_reason, finish), item.token_id
                yield Token(job.index, item.token_id, text, item.logprob)
            else:
                yield End(job.index, finish or FINISH.get(item.finish_reason, "stop"), item)


def _added_text(tokenizer, prev: int | None, token_id: int) -> str:
    """The text `token_id` adds after `prev` (alone, a SentencePiece word token loses its space)."""
    if prev is None:
        return tokenizer.decode([token_id])
    return tokenizer.decode([prev, token_id])[len(tokenizer.decode([prev])):]


async def run(router: Router, jobs: list[ChoiceJob]) -> AsyncIterator[Token | End]:
    """Every job's events; the first error ends them all (the others are cancelled), as does
    closing this iterator (a client that went away)."""
    if len(jobs) == 1:
        async with aclosing(_one(router, jobs[0])) as events:
            async for ev in events:
                yield ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def feed(job: ChoiceJob) -> None:
        try:
            async with aclosing(_one(router, job)) as events:
                async for ev in events:
                    queue.put_nowait(ev)
            queue.put_nowait(None)
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)
        except asyncio.CancelledError:  # (by the consumer's end, or a call cut short under it)
            queue.put_nowait(Unavailable("a choice's backend call was cancelled"))
            raise

    tasks = [asyncio.create_task(feed(j)) for j in jobs]
    try:
        running = len(tasks)
        while running:
            ev = await queue.get()
            if ev is None:
                running -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=STOP_WAIT_S)
