"""The same model as HF transformers, for baselines (transformers is an optional dependency)."""

from __future__ import annotations

import torch

from pdserve.model.loader import LoadedModel


def to_transformers(loaded: LoadedModel) -> torch.nn.Module:
    """An HF `LlamaForCausalLM` with exactly our weights (un-fusing qkv and gate/up)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("this benchmark compares against transformers: pip install 'pdserve[test]'") from e
    c = loaded.config
    if c.architecture != "LlamaForCausalLM" or c.attention_bias:
        raise ValueError("the transformers baseline is built for Llama-architecture models only")
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, tie_word_embeddings=c.tie_word_embeddings,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    src = loaded.model.state_dict()
    state = {"model.embed_tokens.weight": src["embed.weight"], "model.norm.weight": src["norm.weight"],
             "lm_head.weight": src["lm_head.weight"]}
    for i in range(c.num_layers):
        s, d = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = src[s + "attn.wqkv.weight"].split((q, kv, kv))
        gate, up = src[s + "mlp.w_gate_up.weight"].split(c.intermediate_size)
        state |= {
            d + "input_layernorm.weight": src[s + "attn_norm.weight"],
            d + "post_attention_layernorm.weight": src[s + "mlp_norm.weight"],
            d + "self_attn.q_proj.weight": wq, d + "self_attn.k_proj.weight": wk,
            d + "self_attn.v_proj.weight": wv, d + "self_attn.o_proj.weight": src[s + "attn.wo.weight"],
            d + "mlp.gate_proj.weight": gate, d + "mlp.up_proj.weight": up,
            d + "mlp.down_proj.weight": src[s + "mlp.w_down.weight"],
        }
    model = LlamaForCausalLM(hf_config).to(loaded.dtype).eval()
    model.load_state_dict(state, strict=True)
    return model
