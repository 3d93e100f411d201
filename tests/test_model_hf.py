"""Our model and loader against HF transformers (the oracle), on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.layout import KVLayout
from pdserve.model import packed_linear
from pdserve.model.attention import AttentionMetadata, SeqPages
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.torch_backend import TorchBackend, TorchOps
from tests.hf_checkpoints import make_checkpoint
from tests.support.device import TEST_DEVICE

TOLERANCE = 1e-4 if TEST_DEVICE == "cpu" else 1e-3  # (CUDA sums in another order)

KINDS = ["llama", "llama_linear", "qwen2", "mistral"]


def our_logits(loaded: LoadedModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """All-position logits [T, vocab] from one paged forward pass."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    device = torch.device(TEST_DEVICE)
    cache = KVCache(KVLayout.for_model(loaded.config, block_size, loaded.dtype), num_blocks, device)
    pos = torch.arange(n, device=device)
    backend = TorchBackend(cache.layout, device)
    meta = AttentionMetadata(backend, TorchOps(), pos // block_size, pos % block_size,
                             backend.plan([SeqPages(0, n, n, list(range(num_blocks)))]))
    with torch.inference_mode():
        return loaded.model.to(device)(torch.tensor(token_ids, device=device), pos, meta, cache.tensor, pos).cpu()


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_checkpoint(request.param, path)
    return request.param, path, hf_model


@pytest.mark.parametrize("length", [1, 7, 16, 33, 200])
def test_logits_match_transformers(checkpoint, length):
    kind, path, hf_model = checkpoint
    loaded = load_model(str(path))
    tokens = [(i * 37 + 11) % 258 for i in range(length)]
    ours = our_logits(loaded, tokens)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([tokens])).logits[0].float()
    assert ours.shape == theirs.shape == (length, 258)
    assert (ours - theirs).abs().max().item() <= TOLERANCE, kind


def test_greedy_generation_matches_transformers(checkpoint):
    kind, path, hf_model = checkpoint
    loaded = load_model(str(path))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=256, device=TEST_DEVICE))
    prompts = [[(i * 13 + 5) % 258 for i in range(n)] for n in (3, 16, 41)]
    ours = engine.generate(prompts, SamplingParams(max_tokens=24))
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert result.token_ids == out[0, len(prompt):].tolist(), kind


def test_bf16_loads_and_is_close(checkpoint):
    _, path, hf_model = checkpoint
    fp32 = load_model(str(path))
    bf16 = load_model(str(path), dtype=torch.bfloat16)
    assert bf16.fingerprint != fp32.fingerprint
    tokens = list(range(40))
    diff = (our_logits(bf16, tokens) - our_logits(fp32, tokens)).abs().max().item()
    assert 0 < diff < 0.5


def test_eos_from_generation_config(tmp_path):
    make_checkpoint("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_model(str(tmp_path)).config.eos_token_ids == (7, 9)


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    make_checkpoint("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))  # (not silently silu)
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ValueError, match="shape mismatch for 'layers.0.mlp.w_gate_up.weight'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    Tokenizer = __import__("pdserve.model.tokenizer", fromlist=["Tokenizer"]).Tokenizer
    Tokenizer.byte_level().save(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_tiny_is_deterministic_and_llama_shaped(tiny):
    again = load_model("tiny")
    assert again.fingerprint == tiny.fingerprint
    c = tiny.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (256, 4, 4, 2)
    assert tiny.tokenizer.vocab_size == c.vocab_size
    assert tiny.tokenizer.decode(tiny.tokenizer.encode("héllo wörld")) == "héllo wörld"


def test_a_checkpoint_is_described_as_its_workers_load_it_without_reading_its_weights(tmp_path, monkeypatch):
    """The router and the store take a checkpoint's fingerprint and config from config.json and
    the safetensors headers (and sampled bytes), never loading its tensors: the same fingerprint
    as the worker that loads it; another seed's weights, or another dtype, give another one."""
    import pdserve.model.loader as loader
    from pdserve.model.spec import describe
    from tests.hf_checkpoints import make_checkpoint

    make_checkpoint("llama", tmp_path / "a", seed=1)
    make_checkpoint("llama", tmp_path / "b", seed=2)
    loaded = load_model(str(tmp_path / "a"))

    def no_weights(*args, **kwargs):
        raise AssertionError("describe() must not open the weights as tensors")

    monkeypatch.setattr(loader, "safe_open", no_weights)
    spec = describe(str(tmp_path / "a"))
    assert (spec.fingerprint, spec.config, spec.dtype) == (loaded.fingerprint, loaded.config, torch.float32)
    assert spec.tokenizer.encode("hi") == loaded.tokenizer.encode("hi")
    assert describe(str(tmp_path / "b")).fingerprint != spec.fingerprint
    assert describe(str(tmp_path / "a"), torch.bfloat16).fingerprint != spec.fingerprint


@pytest.mark.parametrize("linear_weights,chunk,onednn", [("auto", 32, None), ("auto", 256, True),
                                                         ("auto", 256, False), ("packed", 32, None)])
def test_greedy_tokens_at_the_100m_shape_equal_transformers(tmp_path, monkeypatch, linear_weights, chunk, onednn):
    """The engine bench's realistic shape (hidden 1024, 16 / 4 heads, vocab 32,000; 2 of its
    layers): prompts around block boundaries, continuously batched, with whatever backend and row
    ops the runner picks here (and with oneDNN's packed linears), give transformers' greedy tokens.
    Steps of up to `chunk` tokens: at 256 the prompts run in one step of more rows than the C
    GEMM takes (SMALL_GEMM_MAX_ROWS), so prompt linears take the other path too, through each of
    its libraries (`onednn`: oneDNN's GEMM, or torch's own), whichever this CPU would pick."""
    if (linear_weights == "packed" or onednn) and (
            why := packed_linear.unavailable(torch.device(TEST_DEVICE), torch.float32)):
        pytest.skip(why)
    if onednn is not None:
        monkeypatch.setattr(packed_linear, "prompt_linear_by_onednn", lambda: onednn)
    hf_model = make_checkpoint("llama_100m_2layers", tmp_path)
    engine = LLMEngine(load_model(str(tmp_path)), EngineConfig(num_blocks=64, max_num_batched_tokens=chunk,
                                                               device=TEST_DEVICE, linear_weights=linear_weights))
    prompts = [[(i * 131 + n * 7) % 31_998 for i in range(n)] for n in (15, 16, 17, 40, 100)]
    ours = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert result.token_ids == out[0, len(prompt):].tolist(), len(prompt)


@pytest.mark.parametrize("kind", ["llama_attention_bias", "llama_mlp_bias"])
def test_linear_biases_are_loaded_and_applied(tmp_path, kind):
    """Llama's `attention_bias` puts a bias on o_proj as well as q, k, v, its `mlp_bias` on the
    MLP's three projections: each bias the config names is loaded and applied, in a prompt's pass
    and in decode steps (which, on CPU, run every layer in one C call where the weights allow it)."""
    hf_model = make_checkpoint(kind, tmp_path)
    loaded = load_model(str(tmp_path))
    tokens = [(i * 37 + 11) % 258 for i in range(20)]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([tokens])).logits[0].float()
    assert (our_logits(loaded, tokens) - theirs).abs().max().item() <= TOLERANCE
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, device=TEST_DEVICE))
    ours = engine.generate([tokens], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([tokens]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                attention_mask=torch.ones(1, len(tokens), dtype=torch.long))
    assert ours.token_ids == out[0, len(tokens):].tolist()
