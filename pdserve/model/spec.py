"""What a model is, without its weights: config, tokenizer and fingerprint.

The router and the store need a model's hash profile (its fingerprint and KV layout) and the
router its tokenizer, not its weights: for a checkpoint directory the fingerprint is taken from
config.json and the safetensors files' headers and sampled bytes, so a 7B checkpoint is described
in milliseconds. Workers that load the weights compute the same figure (loader.py calls this).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.config import ModelConfig, dtype_name
from pdserve.model.tokenizer import Tokenizer

TINY = "tiny"
SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # per file: this many evenly spaced reads of its tensor data


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    fingerprint: str  # sha256 hex: workers whose fingerprints differ never share KV


def describe(name_or_path: str, dtype: torch.dtype = torch.float32) -> ModelSpec:
    """The model's spec, reading no weights (the built-in tiny model is built: it is small)."""
    if name_or_path == TINY:
        from pdserve.model.loader import load_model

        tiny = load_model(TINY, dtype)
        return ModelSpec(TINY, tiny.config, tiny.tokenizer, dtype, tiny.fingerprint)
    path = Path(name_or_path)
    config = read_config(path)
    return ModelSpec(name_or_path, config, Tokenizer.from_file(path / "tokenizer.json"), dtype,
                     checkpoint_fingerprint(path, config, dtype))


def read_config(path: Path) -> ModelConfig:
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path} (or use the built-in model 'tiny')")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"missing {config_path}: not a Hugging Face checkpoint directory")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            config = config.with_eos(tuple(eos) if isinstance(eos, list) else (eos,))
    return config


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight file named in the index is missing: {f}")
    return files


def checkpoint_fingerprint(path: Path, config: ModelConfig, dtype: torch.dtype) -> str:
    """sha256 over the config, the serving dtype, and each weight file's header (every tensor's
    name, dtype, shape and place) and sampled bytes of its data: two checkpoints that differ in
    any tensor's layout, or in trained values (a fine-tune changes them everywhere), differ."""
    h = hashlib.sha256()
    h.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    h.update(dtype_name(dtype).encode())
    for f in safetensors_files(path):
        with f.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(f.name.encode() + fh.read(header_len))
            start, size = 8 + header_len, f.stat().st_size - 8 - header_len
            step = max(size // SAMPLES, 1)
            for offset in range(0, size, step) if size > SAMPLES * SAMPLE_BYTES else [0]:
                fh.seek(start + offset)
                h.update(fh.read(SAMPLE_BYTES if size > SAMPLES * SAMPLE_BYTES else size))
    return h.hexdigest()
