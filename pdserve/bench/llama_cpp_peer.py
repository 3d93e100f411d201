"""llama.cpp, the engine bench's peer, driven through its C API (llama-cpp-python's ctypes
bindings, the optional `peer` extra): prefill, one sequence's decode, and batched decode of
several sequences in one `llama_decode` per step, as llama.cpp's own batched example does.

Tokens go in as ids (the GGUF carries a placeholder vocabulary); the next token is the argmax
of the logits, on the host, as pdserve's greedy sampler takes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

GGML_TYPE = {"f32": 0, "f16": 1}  # ggml_type for the KV cache


def available() -> str | None:
    """None when llama-cpp-python imports; otherwise why the peer column is skipped."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install -e '.[peer]': it compiles llama.cpp, minutes)"
    return None


@dataclass(frozen=True)
class PeerSettings:
    threads: int
    kv_type: str = "f32"  # "f32" | "f16"
    flash_attn: bool = False

    @property
    def label(self) -> str:
        return f"kv {self.kv_type}{', flash-attn' if self.flash_attn else ''}"


class LlamaCpp:
    """One llama.cpp model and context; `n_ctx` tokens over at most `n_seq` sequences, each
    sequence given n_ctx / n_seq of them."""

    def __init__(self, gguf_path: str, n_ctx: int, n_seq: int, settings: PeerSettings, n_batch: int = 2048):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, min(512, n_batch), n_seq
        p.n_threads = p.n_threads_batch = settings.threads
        p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else \
            lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = GGML_TYPE[settings.kv_type]
        # One KV stream per sequence (llama.cpp's default): in a unified cache each sequence's
        # attention would span every sequence's cells, masked.
        p.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, n_seq)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], wants: list[bool]) -> list[int]:
        """One llama_decode; the argmax token of each row that asked for logits."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, pos, s, w) in enumerate(zip(tokens, positions, seqs, wants, strict=True)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, w
            b.seq_id[i][0] = s
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = [i for i, w in enumerate(wants) if w]
        return [int(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                for i in rows]

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Each prompt into its own sequence (ids 0..n-1), in batches of n_batch tokens; the
        first token of each, greedy."""
        flat = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        first: list[int] = []
        for i in range(0, len(flat), self.n_batch):
            part = flat[i:i + self.n_batch]
            first += self._decode(*(list(col) for col in zip(*part, strict=True)))
        return first

    def steps(self, last: list[int], context: list[int], n: int) -> list[list[int]]:
        """n decode steps of every sequence at once; the tokens each produced."""
        out: list[list[int]] = [[] for _ in last]
        seqs = list(range(len(last)))
        for step in range(n):
            last = self._decode(last, [c + step for c in context], seqs, [True] * len(last))
            for row, t in zip(out, last, strict=True):
                row.append(t)
        return out

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.clear()
        [first] = self.prefill([prompt])
        return [first, *self.steps([first], [len(prompt)], n - 1)[0]]

    def prefill_tok_s(self, prompt: list[int]) -> float:
        self.clear()
        t0 = time.perf_counter()
        self.prefill([prompt])
        return len(prompt) / (time.perf_counter() - t0)

    def decode_tok_s(self, prompts: list[list[int]], n: int) -> float:
        self.clear()
        first = self.prefill(prompts)
        t0 = time.perf_counter()
        self.steps(first, [len(p) for p in prompts], n)
        return len(prompts) * n / (time.perf_counter() - t0)
