"""The router's prompt encoder: long prompts tokenized in a separate process."""

from __future__ import annotations

import asyncio
import os
import signal

from pdserve.model.tokenizer import Tokenizer
from services.router.prompt_encoder import INLINE_CHARS, PromptEncoder


def test_a_long_prompt_is_encoded_again_after_the_encoding_process_died():
    """The encoding process killed (out of memory, say): the next long prompt starts another one,
    where before every long prompt failed (BrokenProcessPool) until the router restarted."""
    tok = Tokenizer.byte_level()
    enc = PromptEncoder(tok, max_tokens=4 * INLINE_CHARS, max_bytes=1 << 20)
    text = "héllo " * (INLINE_CHARS // 4)

    async def run():
        assert await enc.encode(text) == tok.encode(text)
        for pid in list(enc._pool._processes):
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        return await enc.encode(text)

    try:
        assert asyncio.run(run()) == tok.encode(text)
    finally:
        enc.close()
