"""Where an engine step's time goes: torch's profiler over one prefill and a few batched decode
steps, the ops ranked by their own time, and what no torch op accounts for (the C kernels, which
torch does not see, and Python between ops)."""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import LoadedModel

TOP = 12


def _ranked(prof, wall_s: float, steps: int) -> dict:
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    in_ops_ms = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
    wall_ms = wall_s * 1e3 / steps
    return {"wall_ms_per_step": round(wall_ms, 3), "in_torch_ops_ms": round(in_ops_ms, 3),
            "outside_torch_ops_ms": round(wall_ms - in_ops_ms, 3),
            "top_ops": [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3),
                         "share": round(e.self_cpu_time_total / 1e3 / steps / wall_ms, 3), "calls": e.count // steps}
                        for e in ops[:TOP]]}


def profile_steps(loaded: LoadedModel, prompt_tokens: int, batch: int, context: int, device: str) -> dict:
    vocab = loaded.config.vocab_size
    prompts = [[(i * 131 + j * 7919 + 17) % (vocab - 2) for i in range(max(prompt_tokens, context))]
               for j in range(batch)]
    engine = LLMEngine(loaded, EngineConfig(num_blocks=batch * (-(-(context + 64) // 16)) + 8,
                                            max_num_batched_tokens=max(prompt_tokens, 2048), max_num_seqs=batch,
                                            enable_prefix_caching=False, device=device))
    engine.generate([prompts[0][:prompt_tokens]], SamplingParams(max_tokens=1))  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate([prompts[0][:prompt_tokens]], SamplingParams(max_tokens=1))
        wall = time.perf_counter() - t0
    out = {"prefill": {"prompt_tokens": prompt_tokens, **_ranked(prof, wall, 1)}}
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for j, p in enumerate(prompts):
        engine.add_request(f"p{j}", p[:context], params)
    started: set[str] = set()
    while len(started) < batch:
        started |= {ev.request_id for ev in engine.step()}
    engine.step()
    steps = 8
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    out["decode"] = {"batch": batch, "context": context, **_ranked(prof, wall, steps)}
    return out


def lines_of(profile_: dict) -> list[str]:
    lines = []
    for phase, p in profile_.items():
        lines.append(f"profile {phase}: {p['wall_ms_per_step']:.2f} ms a step, {p['outside_torch_ops_ms']:.2f} ms "
                     "outside torch ops (C kernels, Python)")
        lines += [f"  {o['share']:6.1%}  {o['self_ms']:8.3f} ms  x{o['calls']:<5} {o['op']}" for o in p["top_ops"]]
    return lines
