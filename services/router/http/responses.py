"""OpenAI's response shapes for completions and chat, whole or as Server-Sent Events chunks.

pdserve's own figures for a choice (its router request id, token ids, cache hits, timings and
route) travel in one extension field, `pdserve`, on the choice (and on a stream's last chunk
of that choice)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pdserve.model.tokenizer import Tokenizer
from services.router.http.choices import End, Token
from services.router.route_types import Summary

DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    """What one choice produced since it was last reported."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    offset: int = 0  # characters reported before these
    held: list[str] = field(default_factory=list)  # streamed: the text of the tokens not yet sent
    seen: int = 0  # streamed: tokens so far


def extension(summary: Summary, token_ids: list[int]) -> dict:
    r = summary.route
    return {"request_id": summary.request_id, "token_ids": token_ids,
            "cached_tokens_local": summary.cached_local, "cached_tokens_store": summary.cached_store,
            "computed_tokens": summary.computed, "cached_tokens_cluster": summary.cached_cluster,
            "timings_ms": {k: round(v, 3) for k, v in summary.timings_ms.items()} | {"route_ms": round(r.route_ms, 3)},
            "route": {"prefill": r.prefill.address if r.prefill else "", "decode": r.decode.address,
                      "policy": r.policy, "colocated": r.prefill is None,
                      "expected_hit_tokens": r.expected_local_tokens + r.expected_store_tokens,
                      "estimated_ttft_ms": round(r.estimated_ttft_ms, 3)}}


class Shape:
    """Builds one request's objects: `chat` or completions, with logprobs or not."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer, logprobs: bool, n_choices: int,
                 include_usage: bool = False, interval: int = 1):
        self.chat, self.model, self.tokenizer, self.want_logprobs = chat, model, tokenizer, logprobs
        self.interval = interval  # streamed: tokens to a chunk (the router's --stream-interval)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.include_usage = include_usage
        self.state = [ChoiceState() for _ in range(n_choices)]
        self.ends: dict[int, End] = {}
        self.prompt_tokens: list[int] = []  # per prompt
        self.n = 1  # choices per prompt

    # -- pieces -------------------------------------------------------------------------------
    def _logprobs(self, s: ChoiceState, pieces: list[str]) -> dict | None:
        """`pieces`: the text each token released (a completion's text_offset counts them)."""
        if not self.want_logprobs:
            return None
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in s.token_ids]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                                for tok, lp in zip(tokens, s.logprobs, strict=True)]}
        offsets, at = [], s.offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": tokens, "token_logprobs": s.logprobs,
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, s.logprobs, strict=True)],
                "text_offset": offsets}

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(e.summary.completion_tokens for e in self.ends.values())
        cached = sum(self.ends[i].summary.cached_local + self.ends[i].summary.cached_store
                     for i in range(0, len(self.state), self.n) if i in self.ends)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- whole --------------------------------------------------------------------------------
    def add(self, ev: Token | End) -> None:
        if isinstance(ev, End):
            self.ends[ev.index] = ev
            return
        s = self.state[ev.index]
        s.text.append(ev.text)
        s.token_ids.append(ev.token_id)
        s.logprobs.append(ev.logprob)

    def whole(self) -> dict:
        choices = []
        for i, s in enumerate(self.state):
            end = self.ends[i]
            text = "".join(s.text)
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": i, **body, "logprobs": self._logprobs(s, s.text),
                            "finish_reason": end.finish_reason, "pdserve": extension(end.summary, s.token_ids)})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    # -- streamed -----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _choice(self, index: int, finish: str | None, s: ChoiceState) -> dict:
        """A streamed choice with the tokens held since the last (none: an empty delta)."""
        text = "".join(s.held)
        if self.chat:
            body = {"delta": {"content": text} if s.token_ids else {}}
        else:
            body = {"text": text}
        out = {"index": index, **body, "logprobs": self._logprobs(s, s.held) if s.token_ids else None,
               "finish_reason": finish, "pdserve": {"token_ids": s.token_ids}}
        s.offset += len(text)
        s.token_ids, s.logprobs, s.held = [], [], []
        return out

    def opening(self) -> list[str]:
        """The chunks before any token: the assistant's role, per choice (chat only)."""
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.state))]

    def chunk(self, ev: Token | End) -> str:
        """The chunk `ev` makes, or "" while its token is held: a choice's tokens go `interval`
        to a chunk, as on the router's gRPC streams (the first alone and at once, those left
        with the finish). A chunk's text may be empty while held back (an incomplete character,
        a possible stop string)."""
        s = self.state[ev.index]
        if isinstance(ev, End):
            self.ends[ev.index] = ev
            choice = self._choice(ev.index, ev.finish_reason, s)
            choice["pdserve"] = extension(ev.summary, choice["pdserve"]["token_ids"])
            return self._chunk([choice])
        s.token_ids.append(ev.token_id)
        s.logprobs.append(ev.logprob)
        s.held.append(ev.text)
        s.seen += 1
        if s.seen > 1 and len(s.token_ids) < self.interval:
            return ""
        return self._chunk([self._choice(ev.index, None, s)])

    def pending_chunks(self) -> list[str]:
        """Chunks for the tokens the interval holds: a stream that fails sends them before its
        error."""
        return [self._chunk([self._choice(i, None, s)]) for i, s in enumerate(self.state) if s.token_ids]

    def closing(self) -> list[str]:
        """The usage chunk when asked for, then `[DONE]`."""
        return ([self._chunk([], self.usage())] if self.include_usage else []) + [DONE]
