"""The engine bench's llama.cpp column: the same weights converted to GGUF, one llama.cpp
context per setting, each checked to give pdserve's greedy tokens before it is timed."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from pdserve.bench import llama_cpp_peer
from pdserve.bench.gguf_convert import to_gguf
from pdserve.bench.shapes import SHAPES, cache_dir
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import LoadedModel

CHECK_TOKENS = 16
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16"}  # the GGUF weights beside pdserve's, per --dtype


def parse_setting(text: str, threads: int) -> llama_cpp_peer.PeerSettings:
    kv, _, fa = text.partition("+")
    if kv not in llama_cpp_peer.GGML_TYPE or fa not in ("", "fa"):
        raise ValueError(f"llama.cpp setting {text!r}: KV type f32 or f16, optionally +fa")
    return llama_cpp_peer.PeerSettings(threads, kv, fa == "fa")


def start_peers(path: str, args: argparse.Namespace, threads: int,
                loaded: LoadedModel) -> tuple[dict[str, llama_cpp_peer.LlamaCpp], dict]:
    """{setting label: context} and what to report of the column (why it was skipped, if so)."""
    why = _why_not(path, args)
    if why:
        return {}, {"skipped": why}
    name = args.model if args.model in SHAPES else f"{Path(path).name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    weights = GGUF_TYPE[args.dtype]
    gguf = to_gguf(path, cache_dir() / f"{name}.{weights}.gguf", weights)
    n_seq = max(args.batches, default=1)
    per_seq = max(max(args.prefill_lengths, default=0), max(args.contexts, default=0) + args.steps) + 16
    n_ctx = n_seq * per_seq
    prompt = [(i * 131 + 17) % (loaded.config.vocab_size - 2) for i in range(64)]
    ours = LLMEngine(loaded, EngineConfig(num_blocks=16, linear_weights=args.linear_weights)).generate(
        [prompt], SamplingParams(max_tokens=CHECK_TOKENS, ignore_eos=True))[0].token_ids
    peers: dict[str, llama_cpp_peer.LlamaCpp] = {}
    report: dict = {"gguf": str(gguf), "weights": weights, "greedy_check_tokens": CHECK_TOKENS, "settings": {}}
    for text in args.peer_settings:
        settings = parse_setting(text, threads)
        peer = llama_cpp_peer.LlamaCpp(str(gguf), n_ctx, n_seq, settings)
        theirs = peer.greedy(prompt, CHECK_TOKENS)
        if theirs != ours:  # never timed: it would not be computing the same thing
            report["settings"][settings.label] = f"refused: greedy tokens {theirs} differ from pdserve's {ours}"
            peer.close()
            continue
        report["settings"][settings.label] = "greedy tokens equal pdserve's"
        peers[f"llama.cpp {settings.label}"] = peer
    return peers, report


def _why_not(path: str, args: argparse.Namespace) -> str:
    if args.peer == "off":
        return "--peer off"
    why = llama_cpp_peer.available()
    if why:
        return why
    if not (Path(path) / "config.json").exists():
        return f"{args.model} has no checkpoint files to convert (use llama-100m or a checkpoint directory)"
    if args.dtype not in GGUF_TYPE or args.device != "cpu":
        return "the llama.cpp column is float32 or bfloat16 on the CPU only"
    return ""
