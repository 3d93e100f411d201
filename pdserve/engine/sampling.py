"""The sampler that turns logits into tokens (its parameters: sampling_params.py)."""

from __future__ import annotations

import math

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import cpu_kernels

__all__ = ["SamplingParams", "sample"]


def sample(
    logits: torch.Tensor,  # [S, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """One token per row, with its logprob under the model's unmodified distribution. Logits that
    are not finite (NaN or inf: the model's weights or activations went bad) are refused."""
    tokens, top, logz = _argmax_logz(logits)
    if not all(math.isfinite(z) for z in logz):
        raise ValueError("the model produced logits that are not finite (NaN or inf)")
    logprobs = []
    for row, p in enumerate(params):
        chosen = top[row]  # the greedy token's logit (float32, exactly, as a Python float)
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, generators[row])
            chosen = logits[row, tokens[row]].item()
        logprobs.append(chosen - logz[row])
    return tokens, logprobs


def _argmax_logz(logits: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
    """Each row's first maximal index, its maximum and its log-normaliser log Z (logprob = logit -
    log Z), as plain lists: on the CPU in one C pass per row (less than half the time of torch's
    max and log_softmax at batch 16 and a 32,000-word vocabulary: docs/perf-log.md, S34), elsewhere
    by torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_kernels.unbuildable() is None:
        return cpu_kernels.argmax_logz(logits)
    # max() rather than argmax(): the same first maximal index, at a third of the time.
    top = logits.max(dim=-1)
    return top.indices.tolist(), top.values.tolist(), torch.logsumexp(logits, dim=-1).tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # Shifted so the top logit is 0 before dividing: a tiny temperature (1e-38 is valid) then sends
    # the others to -inf, where dividing the logits themselves made the top one inf, then NaN. One
    # below the logits' smallest normal (float32 holds 1e-46 as 0: the top would be 0/0) samples
    # the top, as any temperature that small does anyway.
    if p.temperature < torch.finfo(logits.dtype).tiny:
        return int(logits.argmax())
    scaled = (logits - logits.max()) / p.temperature
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p (the first always stays).
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        drop[0] = False  # (a top_p float32 holds as 0 would drop even the first)
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    if gen is not None and gen.device != probs.device:
        probs = probs.cpu()  # a seed's generator lives on the CPU: the same draws on every device
    return int(torch.multinomial(probs, 1, generator=gen).item())
