"""Build a `LoadedModel` from a Hugging Face checkpoint directory or the built-in `tiny` model.

Weight renaming (HF names -> ours, q/k/v and gate/up fusion) lives here, not in the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfig, dtype_name
from pdserve.model.llama import Transformer
from pdserve.model.spec import TINY, checkpoint_fingerprint, read_config, safetensors_files
from pdserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    dtype: torch.dtype
    fingerprint: str  # sha256 hex (spec.py): workers with different ones never share KV


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    if name_or_path == TINY:
        from pdserve.model.tiny import build_tiny

        config, model, tokenizer = build_tiny()
    else:
        config, model, tokenizer = _load_hf(Path(name_or_path))
    model = model.to(dtype).eval()
    model.rope.float()  # rotary tables stay fp32; cast per use
    print_ = (fingerprint(config, model) if name_or_path == TINY  # (tiny has no files: its values, all of them)
              else checkpoint_fingerprint(Path(name_or_path), config, dtype))
    return LoadedModel(name=name_or_path, config=config, model=model, tokenizer=tokenizer, dtype=dtype,
                       fingerprint=print_)


def fingerprint(config: ModelConfig, model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous()
        h.update(f"{name}:{dtype_name(t.dtype)}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _load_hf(path: Path) -> tuple[ModelConfig, Transformer, Tokenizer]:
    config = read_config(path)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    with torch.device("meta"):
        model = Transformer(config)
    weights = _read_safetensors(path)
    state = _rename_hf_weights(weights, config)
    _check_shapes(state, model)
    model.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    # Non-persistent buffers (rotary tables) were built on meta: rebuild them for real.
    model.rope = type(model.rope)(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                  config.rope_scaling)
    return config, model, tokenizer


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                weights[key] = sf.get_tensor(key)
    return weights


def _rename_hf_weights(w: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    def take(key: str) -> torch.Tensor:
        if key not in w:
            raise ValueError(f"checkpoint is missing weight {key!r}")
        return w[key].float()

    state = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[dst + "attn_norm.weight"] = take(src + "input_layernorm.weight")
        state[dst + "mlp_norm.weight"] = take(src + "post_attention_layernorm.weight")
        qkv = [take(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
        state[dst + "attn.wqkv.weight"] = torch.cat(qkv)
        if config.attention_bias:
            state[dst + "attn.wqkv.bias"] = torch.cat([take(f"{src}self_attn.{p}_proj.bias") for p in "qkv"])
        state[dst + "attn.wo.weight"] = take(src + "self_attn.o_proj.weight")
        if config.attention_out_bias:
            state[dst + "attn.wo.bias"] = take(src + "self_attn.o_proj.bias")
        gate_up = [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]
        state[dst + "mlp.w_gate_up.weight"] = torch.cat(gate_up)
        state[dst + "mlp.w_down.weight"] = take(src + "mlp.down_proj.weight")
        if config.mlp_bias:
            state[dst + "mlp.w_gate_up.bias"] = torch.cat([take(src + f"mlp.{p}_proj.bias") for p in ("gate", "up")])
            state[dst + "mlp.w_down.bias"] = take(src + "mlp.down_proj.bias")
    return state


def _check_shapes(state: dict[str, torch.Tensor], model: Transformer) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        if key not in expected:
            raise ValueError(f"weight {key!r} has no place in the model")
        if tuple(tensor.shape) != tuple(expected[key]):
            raise ValueError(
                f"shape mismatch for {key!r}: checkpoint has {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[key])}"
            )
    missing = [k for k in expected if k not in state and not (k == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:5]}")
