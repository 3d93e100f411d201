"""Chat messages rendered with a checkpoint's own template exactly as transformers renders them,
in process and through a real stack serving that checkpoint over the HTTP API."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from transformers import AutoTokenizer

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.chat_template import ChatTemplate
from pdserve.model.loader import load_model
from tests.hf_checkpoints import make_checkpoint
from tests.support.credentials import API_KEY
from tests.support.stack import Stack

# A Llama-3-like template: the special tokens, loop controls, tojson, raise_exception, trim_blocks.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
<|{{ message['role'] }}|>{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{{ {'t': 'ü'} | tojson }}{% endif %}"""
MESSAGES = [{"role": "system", "content": " You are terse. "}, {"role": "user", "content": "Grüße, world"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-llama")
    make_checkpoint("llama", path)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False},
        "eos_token": "</s>"}))
    return path


def hf_ids(path, messages) -> list[int]:
    out = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # (transformers 5 returns a BatchEncoding)


def test_render_equals_transformers_apply_chat_template(checkpoint):
    want = hf_ids(checkpoint, MESSAGES)
    tok = load_model(str(checkpoint)).tokenizer
    template = ChatTemplate.for_model(str(checkpoint))
    assert tok.encode(template.render(MESSAGES), add_special_tokens=False) == want
    assert want[0] == 256 and want.count(257) == 4  # <s> once, </s> after each message
    with pytest.raises(ValueError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_chat_through_a_stack_serving_the_checkpoint(checkpoint, shared_redis_url, tmp_path):
    want_prompt = hf_ids(checkpoint, MESSAGES)
    want = LLMEngine(load_model(str(checkpoint)), EngineConfig(num_blocks=256)).generate(
        [want_prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}", model=str(checkpoint))
    s.start_store()
    s.decodes = [s.worker("decode").start()]  # (no prefill worker: the decode worker prefills itself)
    port_file = tmp_path / "http"
    try:
        s.start_router("--http-port", "0", "--http-port-file", str(port_file), "--served-model-name", "chat-llama")
        s.wait_pool(1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{int(port_file.read_text())}/v1", api_key=API_KEY,
                          max_retries=0)
        r = c.chat.completions.create(model="chat-llama", messages=MESSAGES, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len(want_prompt) and r.choices[0].pdserve["token_ids"] == want
        with pytest.raises(openai.BadRequestError, match="unknown role tool"):
            c.chat.completions.create(model="chat-llama", messages=[{"role": "tool", "content": "x"}])
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model=str(checkpoint), messages=MESSAGES)
    finally:
        s.stop()


def test_a_model_without_a_template_refuses_chat_clearly(tmp_path):
    make_checkpoint("llama", tmp_path)
    assert ChatTemplate.for_model(str(tmp_path)) is None
