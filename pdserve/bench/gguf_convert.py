"""A Hugging Face Llama checkpoint as a GGUF file for llama.cpp, the engine bench's peer: the
same weights, f32 (or f16 or bf16), with a placeholder vocabulary (the bench feeds token ids).

Follows llama.cpp's own convert_hf_to_gguf.py for the Llama architecture: its tensor names, and
q/k rows permuted from HF's rotate-half order to llama.cpp's interleaved RoPE pairs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pdserve.model.spec import read_config


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf(checkpoint: str, out: Path, dtype: str = "f32") -> Path:
    """Write `out` (once: an existing file is kept) and return it."""
    import gguf
    from safetensors.torch import load_file

    if out.exists():
        return out
    cfg = read_config(Path(checkpoint))
    scaled = (cfg.rope_scaling or {}).get("rope_type", "default") != "default"
    if cfg.architecture != "LlamaForCausalLM" or scaled or cfg.attention_bias:
        raise ValueError("the GGUF conversion covers Llama checkpoints without RoPE scaling or biases")
    heads, kv_heads, layers = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(file_type)
    w.add_tokenizer_model("llama")  # a placeholder SentencePiece vocabulary: ids are fed directly
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    state = load_file(str(Path(checkpoint) / "model.safetensors"))

    def put(name: str, t: torch.Tensor, permute_heads: int = 0) -> None:
        a = t.float().numpy()
        if permute_heads:
            a = _permute(a, permute_heads)
        # Norm weights stay f32 in every file type, as llama.cpp's converter keeps them.
        if a.ndim == 1 or dtype == "f32":
            w.add_tensor(name, a.astype(np.float32))
        elif dtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:  # bf16, rounded to nearest even as torch's .bfloat16() rounds pdserve's copy
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    put("output.weight", state.get("lm_head.weight", state["model.embed_tokens.weight"]))
    for i in range(layers):
        s, d = f"model.layers.{i}.", f"blk.{i}."
        put(d + "attn_norm.weight", state[s + "input_layernorm.weight"])
        put(d + "attn_q.weight", state[s + "self_attn.q_proj.weight"], heads)
        put(d + "attn_k.weight", state[s + "self_attn.k_proj.weight"], kv_heads)
        put(d + "attn_v.weight", state[s + "self_attn.v_proj.weight"])
        put(d + "attn_output.weight", state[s + "self_attn.o_proj.weight"])
        put(d + "ffn_norm.weight", state[s + "post_attention_layernorm.weight"])
        put(d + "ffn_gate.weight", state[s + "mlp.gate_proj.weight"])
        put(d + "ffn_up.weight", state[s + "mlp.up_proj.weight"])
        put(d + "ffn_down.weight", state[s + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out
