"""Model runner: turns a `SchedulerOutput` into model inputs, runs the model, samples."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import logs
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.malloc import move_to_huge_pages
from pdserve.engine.sampling import sample
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.model import cpu_kernels, flash_backend, kernel_backend, packed_linear
from pdserve.model.attention import AttentionBackend, AttentionMetadata, RowOps, SeqPages
from pdserve.model.llama import Transformer
from pdserve.model.torch_backend import TorchBackend, TorchOps

log = logs.get("engine")


class ModelRunner:
    """Runs one step. Reads sequences, writes only the KV cache pages it was given. Owns the
    attention backend and row ops the model computes with."""

    def __init__(self, model: Transformer, kv_cache: KVCache, attention_backend: str = "auto",
                 linear_weights: str = "auto"):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.attention_backend, self.row_ops = select_backend(attention_backend, kv_cache)
        self.linear_weights = place_linear_weights(linear_weights, model, kv_cache, self.attention_backend.name)

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> dict[str, tuple[int, float]]:
        """Returns {request_id: (token, logprob)} for the chunks that sample."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        seqs: list[SeqPages] = []
        logits_rows: list[int] = []
        sampled = []
        for chunk in output.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            q_start = len(input_ids)
            input_ids += seq.token_at(start, start + n)
            pos = range(start, start + n)
            positions += pos
            slot_blocks += [seq.block_table[p // bs] for p in pos]
            context_len = start + n
            seqs.append(SeqPages(q_start, n, context_len, seq.block_table[: -(-context_len // bs)]))
            if chunk.sample:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        device = self.kv_cache.tensor.device
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            backend=self.attention_backend,
            ops=self.row_ops,
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=device),
            slot_offsets=pos_t % bs,
            plan=self.attention_backend.plan(seqs),
        )
        # Every row samples (a step of decodes only): no rows to pick out.
        every_row = len(logits_rows) == len(input_ids)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            pos_t,
            meta,
            self.kv_cache.tensor,
            None if every_row else torch.tensor(logits_rows, dtype=torch.long, device=device),
        )
        if not sampled:
            return {}
        tokens, logprobs = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        return {s.request_id: (t, lp) for s, t, lp in zip(sampled, tokens, logprobs, strict=False)}


def select_backend(requested: str, kv_cache: KVCache) -> tuple[AttentionBackend, RowOps]:
    """EngineConfig.attention_backend made real. "torch": torch for everything. "kernel": the C
    kernels (the C row ops for float32 models only), on the CPU. "flash": FlashAttention's paged
    kernels, on CUDA. Either is an error where it cannot serve this cache. "auto": the one for the
    cache's device where it can, else torch, saying why (workers log the choice when ready)."""
    device, layout = kv_cache.tensor.device, kv_cache.layout
    torch_backend = TorchBackend(layout, device), TorchOps()
    chosen = torch_backend
    if requested != "torch":
        native = "flash" if device.type == "cuda" else "kernel"
        why_not = (flash_backend.unavailable(layout, device) if native == "flash"
                   else kernel_backend.unavailable(kv_cache.tensor))
        if requested not in ("auto", native):
            why_not = f"it serves the {'CPU' if requested == 'kernel' else 'CUDA'} only, the cache is on {device}"
        if why_not is None and native == "flash":
            chosen = flash_backend.FlashBackend(layout, device), TorchOps()
        elif why_not is None:
            ops = kernel_backend.CpuKernelOps() if kv_cache.tensor.dtype == torch.float32 else TorchOps()
            chosen = kernel_backend.CpuKernelBackend(layout), ops
        elif requested != "auto":
            raise ValueError(f"attention_backend {requested!r} is unavailable: {why_not}")
        else:
            log.warning("attention falls back to gathered pages + SDPA (slower)", device=str(device), reason=why_not)
    return chosen


def place_linear_weights(requested: str, model: Transformer, kv_cache: KVCache, backend: str) -> str:
    """EngineConfig.linear_weights made real on `model` (shared by every engine built on it):
    "packed" or "plain", as chosen. "auto", with the CPU kernel backend where oneDNN can, packs the
    linears of at least packed_linear.AUTO_MIN_WEIGHTS weights ("packed" when it packed any),
    unless the C small-batch GEMM serves the decode steps (float32 on AVX-512 or AVX2): it reads
    the row-major weights, faster than oneDNN's packed ones at 1-16 rows (docs/perf-log.md, S30).
    Plain weights on the CPU are moved once onto huge pages (`_weights_on_huge_pages`)."""
    dtype = kv_cache.tensor.dtype
    why_not = packed_linear.unavailable(kv_cache.tensor.device, dtype)
    if requested == "packed" and why_not:
        raise ValueError(f"linear_weights 'packed' is unavailable: {why_not}")
    placed = _place(requested, model, kv_cache, backend, why_not)
    kernel_backend.weights_placed(model.layers)
    return placed


def _place(requested: str, model: Transformer, kv_cache: KVCache, backend: str, why_not: str | None) -> str:
    if requested == "packed":
        packed_linear.pack_linears(model)
        return "packed"
    small_gemm = kv_cache.tensor.dtype == torch.float32 and cpu_kernels.small_gemm_available()
    if requested == "auto" and backend == "kernel" and why_not is None and not small_gemm:
        return "packed" if packed_linear.pack_linears(model, packed_linear.AUTO_MIN_WEIGHTS) else "plain"
    packed_linear.unpack_linears(model)
    if kv_cache.tensor.device.type == "cpu":
        _weights_on_huge_pages(model)
    return "plain"


def _weights_on_huge_pages(model: Transformer) -> None:
    """The row-major linear weights (each step streams them all) moved into one buffer on huge
    pages (malloc.move_to_huge_pages), once per model: when they already share one buffer, nothing."""
    params = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}.values())
    if len({p.untyped_storage().data_ptr() for p in params}) > 1:
        move_to_huge_pages(params)
