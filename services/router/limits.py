"""A request's prompt and sampling checked against this deployment's limits, before any worker
is touched: what the gRPC servicer and the HTTP API both call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.engine.sampling import SamplingParams
from pdserve.errors import AlreadyExists, InvalidArgument
from pdserve.model.tokenizer import Tokenizer
from services.router.config import RouterConfig
from services.router.prompt_encoder import PromptEncoder

MAX_REQUEST_ID = 128
CLAIM_WAIT_S = 0.1  # how long a request waits for its id to be let go before it is refused ALREADY_EXISTS


def check_request_id(request_id: str) -> None:
    """A client's id for its request: printable ASCII, without '~' (the router names each attempt
    of a request `<id>~<attempt>.<nonce>` on the workers and in the store), at most MAX_REQUEST_ID."""
    if len(request_id) > MAX_REQUEST_ID or not all(" " < c < "~" for c in request_id):
        raise InvalidArgument(f"request_id must be at most {MAX_REQUEST_ID} printable ASCII characters without "
                              f"spaces or '~', got {request_id[:40]!r}")


class RequestIds:
    """Owns the ids of the requests in flight at this router: a second request under one is
    refused. An id is free again as soon as its client is gone, while its request may still be
    cleaning up: each attempt has a name of its own on the workers and in the store, so a request
    sent again at once under the same id never meets the first one's cleanup."""

    def __init__(self) -> None:
        self._live: dict[str, asyncio.Event] = {}  # request id -> its claim, set once let go

    def __len__(self) -> int:
        return len(self._live)

    async def claim(self, request_id: str, on_client_gone=None) -> Callable[[], None]:
        """Hold `request_id`; returns what lets it go (idempotent: once let go, a later claim of
        the same id is another's, and is left alone), also handed to `on_client_gone`, which
        calls it as the client goes. An id still held is waited for a moment (CLAIM_WAIT_S): a
        client that cancels and at once sends again may be here before its cancel is."""
        held = self._live.get(request_id)
        if held is not None:
            try:
                await asyncio.wait_for(held.wait(), CLAIM_WAIT_S)
            except TimeoutError:
                pass
            if request_id in self._live:
                raise AlreadyExists(f"request {request_id!r} is already in flight: give each request its own id")
        me = self._live[request_id] = asyncio.Event()

        def release() -> None:
            if self._live.get(request_id) is me:
                del self._live[request_id]
            me.set()

        if on_client_gone is not None:
            on_client_gone(release)
        return release


class RequestLimits:
    """The deployment's limits (read-only once built) and the prompt encoder."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer, max_model_len: int, vocab_size: int):
        self.max_model_len = max_model_len
        self.max_tokens_cap = cfg.max_tokens_cap
        self.vocab_size = vocab_size
        self.max_prompt = cfg.max_prompt_tokens or max_model_len
        self.encoder = PromptEncoder(tokenizer, self.max_prompt, cfg.max_prompt_bytes)

    async def prompt_ids(self, text: str | None, token_ids: list[int] | None,
                         add_special_tokens: bool = True) -> list[int]:
        if text is not None:
            ids = await self.encoder.encode(text, add_special_tokens)
        else:
            ids = list(token_ids or [])
        if not ids:
            raise InvalidArgument("prompt is empty: give text or at least one token id")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) > self.max_prompt:
            raise InvalidArgument(f"prompt has {len(ids)} tokens; this deployment accepts at most {self.max_prompt}")
        return ids

    def sampling(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        if params.max_tokens > self.max_tokens_cap:
            raise InvalidArgument(f"max_tokens {params.max_tokens} is over this deployment's cap "
                                  f"{self.max_tokens_cap}")
        if prompt_tokens + params.max_tokens > self.max_model_len:
            raise InvalidArgument(f"prompt ({prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                  f"context length {self.max_model_len}")
        return params
