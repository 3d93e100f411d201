"""Prompt text to token ids without stalling the router's event loop.

The `tokenizers` library holds the GIL for a whole `encode`, so a thread would not help: a long
prompt is tokenized in a separate process (one, started on first need), while short ones, the
common case, are tokenized inline where a round trip to that process would cost more than the
work. Texts that must be over the token limit are refused before any tokenizing.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pdserve.errors import InvalidArgument
from pdserve.model.tokenizer import Tokenizer

INLINE_CHARS = 16 * 1024  # below this, encoding takes well under a millisecond

_pool_tokenizer: Tokenizer | None = None  # the tokenizer inside the encoding process


def _load(data: str) -> None:
    global _pool_tokenizer
    _pool_tokenizer = Tokenizer.from_json(data)


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return _pool_tokenizer.encode(text, add_special_tokens)


class PromptEncoder:
    """Owns the tokenizing process; `encode` is safe to await from the event loop."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, max_bytes: int):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.max_chars = max_tokens * tokenizer.max_token_chars
        # The largest request that can hold a prompt within the limits (text at 4 bytes a
        # character, or token ids at 5 bytes each), with room for the rest of the message.
        self.max_request_bytes = max(min(max_bytes, 4 * self.max_chars), 5 * max_tokens) + 64 * 1024
        self._pool: ProcessPoolExecutor | None = None

    def check(self, text: str) -> None:
        """Refuse what is over the limits before any tokenizing (the character count first: it
        costs nothing, and bounds the text whose bytes are then counted)."""
        if len(text) > self.max_chars:
            raise InvalidArgument(f"prompt text has {len(text)} characters, more than {self.max_tokens} tokens can "
                                  f"cover; this deployment accepts at most {self.max_tokens} prompt tokens")
        if len(text) > self.max_bytes or len(text.encode()) > self.max_bytes:
            raise InvalidArgument(f"prompt text is over {self.max_bytes} bytes, this deployment's limit")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check(text)
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        for tries_left in (1, 0):
            if self._pool is None:
                # spawn: forking a process that runs gRPC's threads is unsafe
                self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=_load,
                                                 initargs=(self.tokenizer.to_json(),))
            pool = self._pool
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, _encode, text, add_special_tokens)
            except BrokenProcessPool:  # its process died (killed, out of memory): a broken pool stays broken
                if self._pool is pool:
                    self._pool = None
                    pool.shutdown(wait=False, cancel_futures=True)
                if not tries_left:
                    raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
