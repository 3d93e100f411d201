"""Workloads for `pdserve bench serve`: trace replays and synthetic mixes, as plain request lists."""

from __future__ import annotations

import csv
import hashlib
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
MOONCAKE_TRACE = SHARED_TRACES / "mooncake_synthetic_trace.jsonl"
AZURE_TRACE = SHARED_TRACES / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_BLOCK = 512  # tokens per hash_id in the Mooncake trace
TOKEN_RANGE = 250  # prompt token ids lie in [0, TOKEN_RANGE): valid for any model of ours


@dataclass(frozen=True)
class BenchRequest:
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int
    kind: str = ""  # "decode" | "long" | "" (interference workload)


def block_tokens(hash_id: int, k: int) -> list[int]:
    """The deterministic k tokens a Mooncake hash_id stands for (depends on the id alone)."""
    out: list[int] = []
    counter = 0
    while len(out) < k:
        digest = hashlib.blake2b(f"{hash_id}:{counter}".encode(), digest_size=64).digest()
        out.extend(b % TOKEN_RANGE for b in digest)
        counter += 1
    return out[:k]


def mooncake(path: Path = MOONCAKE_TRACE, k: int = 16, max_requests: int = 0, time_scale: float = 1.0,
             max_output: int = 0, start: int = 0) -> list[BenchRequest]:
    """Each hash_id becomes `k` tokens: lengths scale by k/512, prefix sharing is kept exactly."""
    out = []
    with open(path) as f:
        lines = f.readlines()[start:]
    for line in lines[: max_requests or None]:
        rec = json.loads(line)
        ids = rec["hash_ids"]
        length = max(1, min(len(ids) * k, round(rec["input_length"] * k / MOONCAKE_BLOCK)))
        tokens = [t for h in ids for t in block_tokens(h, k)][:length]
        max_tokens = max(1, rec["output_length"] if not max_output else min(rec["output_length"], max_output))
        out.append(BenchRequest(rec["timestamp"] / 1000 * time_scale, tokens, max_tokens))
    t0 = out[0].arrival_s if out else 0.0
    return [BenchRequest(r.arrival_s - t0, r.prompt_ids, r.max_tokens) for r in out]


def azure(path: Path = AZURE_TRACE, max_requests: int = 0, time_scale: float = 1.0, length_scale: float = 1.0,
          max_output: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Lengths and arrivals from an Azure trace; prompts random (no prefix sharing)."""
    rng = random.Random(seed)
    out, t0 = [], None
    with open(path) as f:
        for i, row in enumerate(csv.DictReader(f)):
            if max_requests and i >= max_requests:
                break
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            t0 = ts if t0 is None else t0
            n = max(1, round(int(row["ContextTokens"]) * length_scale))
            gen = max(1, int(row["GeneratedTokens"]))
            out.append(BenchRequest((ts - t0) * time_scale, [rng.randrange(TOKEN_RANGE) for _ in range(n)],
                                    min(gen, max_output) if max_output else gen))
    return out


def interference(num_decodes: int = 8, decode_tokens: int = 256, long_prompt: int = 2048, bursts: int = 4,
                 burst_size: int = 2, burst_every_s: float = 1.0, seed: int = 0) -> list[BenchRequest]:
    """A steady set of running decodes, and bursts of long prompts arriving while they run."""
    rng = random.Random(seed)
    out = [BenchRequest(0.0, [rng.randrange(TOKEN_RANGE) for _ in range(32)], decode_tokens, "decode")
           for _ in range(num_decodes)]
    for b in range(bursts):
        for _ in range(burst_size):
            out.append(BenchRequest(0.5 + b * burst_every_s, [rng.randrange(TOKEN_RANGE) for _ in range(long_prompt)],
                                    2, "long"))
    return out


def shared_prefix(groups: int = 4, per_group: int = 8, system_tokens: int = 1024, user_tokens: int = 64,
                  max_tokens: int = 16, rate: float = 4.0, seed: int = 0) -> list[BenchRequest]:
    """Groups of requests sharing a long system prompt, interleaved, at a steady rate."""
    rng = random.Random(seed)
    systems = [[rng.randrange(TOKEN_RANGE) for _ in range(system_tokens)] for _ in range(groups)]
    out = []
    for i in range(groups * per_group):
        user = [rng.randrange(TOKEN_RANGE) for _ in range(user_tokens)]
        out.append(BenchRequest(i / rate, systems[i % groups] + user, max_tokens))
    return out


def with_poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """The same requests in the same order, arriving as a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in requests:
        out.append(BenchRequest(t, r.prompt_ids, r.max_tokens, r.kind))
        t += rng.expovariate(rate)
    return out
