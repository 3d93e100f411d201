"""The OpenAI-compatible HTTP API against a real stack (store, prefill, decode, router with
--http-port), driven by the official `openai` package and by raw httpx for the wire format."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import openai
import pytest

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.chat_template import ChatTemplate, TemplateError
from pdserve.model.loader import load_model
from tests.support.credentials import API_KEY
from tests.support.stack import SETTLED, Stack, settled

PROMPT = "pdserve speaks the OpenAI API"
FIXED = {"ignore_eos": True}  # (extra_body: every output runs to max_tokens)


@pytest.fixture(scope="module")
def stack(shared_redis_url, tmp_path_factory):
    s = Stack(shared_redis_url, f"pdtest-{uuid.uuid4().hex[:8]}")
    s.start_store()
    s.prefills = [s.worker("prefill").start()]
    s.decodes = [s.worker("decode", "--num-blocks", "128").start()]
    port_file = tmp_path_factory.mktemp("http") / "port"
    s.start_router("--http-port", "0", "--http-port-file", str(port_file))
    s.wait_pool(2)
    s.http = f"http://127.0.0.1:{int(port_file.read_text())}"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(load_model("tiny"), EngineConfig(num_blocks=1024))


@pytest.fixture(scope="module")
def tok():
    return load_model("tiny").tokenizer


def sync_client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=API_KEY, max_retries=0)


def greedy(engine, ids, n=12, **kw) -> list[int]:
    return engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0].token_ids


def chat_ids(tok, messages) -> list[int]:
    return tok.encode(ChatTemplate.for_model("tiny").render(messages), add_special_tokens=False)


def test_openai_client_sync_async_stream_and_whole_equal_grpc_and_the_engine(stack, engine, tok):
    want = greedy(engine, tok.encode(PROMPT))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want_chat = greedy(engine, chat_ids(tok, messages))
    c = sync_client(stack)
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=FIXED)
    assert whole.choices[0].pdserve["token_ids"] == want
    assert whole.choices[0].text == tok.decode(want) and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(tok.encode(PROMPT)), 12)
    streamed = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         extra_body=FIXED))
    assert "".join(ch.choices[0].text for ch in streamed) == tok.decode(want)
    assert sum((ch.choices[0].pdserve["token_ids"] for ch in streamed), []) == want
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body=FIXED)
    assert chat.choices[0].pdserve["token_ids"] == want_chat and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tok.decode(want_chat)
    assert chat.usage.prompt_tokens == len(chat_ids(tok, messages))
    with Client(stack.router.address) as g:  # the gRPC path, same prompt
        assert g.generate(PROMPT, max_tokens=12, ignore_eos=True).token_ids == want
        assert g.generate(chat_ids(tok, messages), max_tokens=12, ignore_eos=True).token_ids == want_chat

    async def with_async():
        a = openai.AsyncOpenAI(base_url=f"{stack.http}/v1", api_key=API_KEY, max_retries=0)
        r = await a.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            extra_body=FIXED)
        s = await a.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, extra_body=FIXED)
        chunks = [ch async for ch in s]
        by_ids = await a.completions.create(model="tiny", prompt=[tok.encode(PROMPT), tok.encode("other")],
                                            max_tokens=12, temperature=0, extra_body=FIXED)
        await a.close()
        return r, chunks, by_ids

    r, chunks, by_ids = asyncio.run(with_async())
    assert r.choices[0].message.content == tok.decode(want_chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == tok.decode(want_chat)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [ch.pdserve["token_ids"] for ch in by_ids.choices] == [want, greedy(engine, tok.encode("other"))]


def test_stop_strings_across_tokens_and_stop_token_ids(stack, engine, tok):
    ids = tok.encode("stop strings end the text")
    out = greedy(engine, ids, 24)
    text = tok.decode(out)
    # A stop string of three byte tokens, from the middle of the greedy text.
    stop = text[8:11]
    at = text.index(stop)
    c = sync_client(stack)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                             extra_body=FIXED)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.text == text[:at]
    done = len(tok.decode(out[:0]))
    n = next(k for k in range(1, 25) if stop in tok.decode(out[:k]))  # the token that completed the stop
    assert ch.pdserve["token_ids"] == out[:n] and r.usage.completion_tokens == n and done == 0
    streamed = list(c.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body=FIXED))
    assert "".join(x.choices[0].text for x in streamed) == text[:at] and streamed[-1].choices[0].finish_reason == "stop"
    # A stop token id: the request ends on it and its text is not in the output.
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0,
                             extra_body={**FIXED, "stop_token_ids": [out[5]]})
    first = out.index(out[5])
    assert r.choices[0].pdserve["token_ids"] == out[:first + 1] and r.choices[0].text == tok.decode(out[:first])
    assert r.choices[0].finish_reason == "stop"


def test_n_choices_with_seeds_usage_and_length(stack):
    c = sync_client(stack)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11, extra_body=FIXED)
    two = c.completions.create(n=2, **kw)
    again = c.completions.create(n=2, **kw)
    ids = [ch.pdserve["token_ids"] for ch in two.choices]
    assert ids == [ch.pdserve["token_ids"] for ch in again.choices] and ids[0] != ids[1]
    assert ids[1] == c.completions.create(**{**kw, "seed": 12}).choices[0].pdserve["token_ids"]
    assert [ch.index for ch in two.choices] == [0, 1] and {ch.finish_reason for ch in two.choices} == {"length"}
    assert two.usage.completion_tokens == 20 and two.usage.prompt_tokens == len(load_model("tiny").tokenizer
                                                                                 .encode(PROMPT))
    stream = list(c.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    per_choice = {0: [], 1: []}
    for ch in stream[:-1]:
        assert ch.usage is None and len(ch.choices) == 1
        per_choice[ch.choices[0].index] += ch.choices[0].pdserve["token_ids"]
    assert [per_choice[0], per_choice[1]] == ids
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 20
    assert stream[-1].usage.total_tokens == 20 + two.usage.prompt_tokens


def _events(raw: bytes) -> list[str]:
    assert raw.endswith(b"data: [DONE]\n\n")
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""  # nothing after [DONE]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames[:-1])
    return [f[len("data: "):] for f in frames[:-1]]


def test_sse_framing_byte_exact(stack, engine, tok):
    want = greedy(engine, tok.encode(PROMPT), 6)
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.Client(timeout=30) as h:
        r = h.post(f"{stack.http}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.content)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}] and chunks[0]["usage"] is None
    content = chunks[1:-2]
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in content)
    last = chunks[-2]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    ids = [t for c in chunks[1:-1] for t in c["choices"][0]["pdserve"]["token_ids"]]
    assert ids == greedy(engine, chat_ids(tok, [{"role": "user", "content": PROMPT}]), 6)
    assert len(want) == 6


def test_stream_interval_sends_tokens_n_to_a_chunk(stack, engine, tok, tmp_path):
    """A router with --stream-interval 4 streams SSE chunks as it streams gRPC messages: the
    first token alone, then four to a chunk, those left with the finish; the same tokens, text
    and logprobs as one token a chunk."""
    batched = Stack(stack.redis_url, stack.key_prefix, store=stack.store)
    port_file = tmp_path / "port"
    batched.start_router("--stream-interval", "4", "--http-port", "0", "--http-port-file", str(port_file))
    try:
        batched.wait_pool(2)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 0,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as h:
            got = h.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
            one = h.post(f"{stack.http}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        chunks = [json.loads(e)["choices"][0] for e in _events(got.content)[:-1]]
        singles = [json.loads(e)["choices"][0] for e in _events(one.content)[:-1]]
        want = greedy(engine, tok.encode(PROMPT), 10)
        assert [c["pdserve"]["token_ids"] for c in chunks] == [want[:1], want[1:5], want[5:9], want[9:]]
        assert [c["finish_reason"] for c in chunks] == [None, None, None, "length"]
        assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 4, 4, 1]
        assert len(singles) == 11  # one a token, then the finish
        assert "".join(c["text"] for c in chunks) == "".join(c["text"] for c in singles)
        lps = [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]
        assert lps == [lp for c in singles if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
        # Each token's offset counts the text released before it, streamed or whole.
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        assert offsets == [o for c in singles if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        whole_body = {k: v for k, v in body.items() if k != "stream"}
        with httpx.Client(timeout=30) as h:
            whole_lp = h.post(f"{url}/v1/completions", json=whole_body,
                              headers={"Authorization": f"Bearer {API_KEY}"}).json()["choices"][0]["logprobs"]
        assert whole_lp["text_offset"] == offsets and whole_lp["token_logprobs"] == lps
        streamed = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0, stream=True,
            extra_body=FIXED)
        deltas = [c.choices[0].delta.content for c in streamed]
        whole = sync_client(stack).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                            max_tokens=10, temperature=0, extra_body=FIXED)
        assert len(deltas) == 1 + 4 and "".join(d or "" for d in deltas) == whole.choices[0].message.content
    finally:
        batched.router.stop()


def test_logprobs_given_or_refused(stack, engine, tok):
    c = sync_client(stack)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, extra_body=FIXED)
    ids = tok.encode(PROMPT)
    lp = engine.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0].logprobs
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(lp, abs=1e-4)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                     temperature=0, logprobs=True, extra_body=FIXED)
    assert len(chat.choices[0].logprobs.content) == 3 and chat.choices[0].logprobs.content[0].top_logprobs == []
    with pytest.raises(openai.BadRequestError, match="sampled token's logprob only"):
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=3)
    with pytest.raises(openai.BadRequestError, match="sampled token's logprob only"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                  top_logprobs=2)


def _post(stack, path, body, key=API_KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(timeout=30) as h:
        if raw is not None:
            return h.post(f"{stack.http}{path}", content=raw, headers={**headers, "content-type": "application/json"})
        return h.post(f"{stack.http}{path}", json=body, headers=headers)


@pytest.mark.parametrize("body,status,code,param", [
    ({"model": "tiny", "prompt": "x", "temperature": float("inf")}, 400, None, None),
    ({"model": "tiny", "prompt": "x", "temperature": 101}, 400, None, None),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, None, "n"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, None, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "seed": -5}, 400, None, "seed"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "invalid_argument", None),
    ({"model": "tiny", "prompt": [], "max_tokens": 5}, 400, None, "prompt"),
    ({"model": "tiny", "prompt": [1, 999999]}, 400, "invalid_argument", None),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, 400, "unsupported", "presence_penalty"),
    ({"model": "tiny"}, 400, None, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "model"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 3000}, 429, "resource_exhausted", None),
    # One request may start at most 64 generations (its prompts times n), checked before any is tokenized.
    ({"model": "tiny", "prompt": [[1]] * 10, "n": 7, "max_tokens": 1}, 400, None, "prompt"),
    ({"model": "tiny", "prompt": [True, False]}, 400, None, "prompt.str"),  # (not token ids 1, 0)
    ({"model": "tiny", "prompt": "x", "top_k": 1 << 32}, 400, None, "top_k"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [1 << 31]}, 400, None, "stop_token_ids"),
])
def test_error_paths_status_and_body(stack, body, status, code, param):
    t0 = time.perf_counter()
    r = _post(stack, "/v1/completions", None, raw=json.dumps(body).replace("Infinity", "1e999").encode())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code)
    if status == 429:
        assert r.headers["retry-after"] == "1" and "no decode worker can admit" in err["message"]
    assert time.perf_counter() - t0 < 5


def test_auth_malformed_and_unknown_routes(stack):
    for key, why in ((None, "no API key"), ("wrong", "not recognised")):
        r = _post(stack, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=key)
        assert r.status_code == 401 and why in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "authentication_error"
    with httpx.Client() as h:
        assert h.get(f"{stack.http}/v1/models").status_code == 401
        models = h.get(f"{stack.http}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert h.get(f"{stack.http}/health").json()["status"] == "ok"
        r = h.get(f"{stack.http}/v2/nothing")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = _post(stack, "/v1/chat/completions", None, raw=b'{"model": "tiny", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(stack, "/v1/chat/completions", None, raw=b'{"model": "tiny", "messages": [{"role": "user", '
                                                       b'"content": "\\ud800"}]}')  # (a lone surrogate)
    assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]
    with httpx.Client() as h:
        metrics = h.get(f"{stack.http}/metrics").text
    assert 'pdserve_router_http_requests_total{endpoint="/v1/completions",status="401"}' in metrics
    assert 'pdserve_router_http_errors_total{endpoint="/v1/models",status="401"}' in metrics
    assert 'pdserve_router_http_requests_total{endpoint="/v1/models",status="200"}' in metrics


def test_client_disconnect_mid_stream_releases_everything(stack):
    body = {"model": "tiny", "prompt": "x" * 200, "max_tokens": 2000 // 2, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as h:
        for _ in range(3):
            with h.stream("POST", f"{stack.http}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    got += line.startswith("data: {")
                    if got == 5:
                        break  # closing the response drops the connection mid-stream
        t0 = time.monotonic()
        assert asyncio.run(settled(stack, timeout_s=2.0)) == SETTLED
        metrics = h.get(f"{stack.http}/metrics").text
    assert time.monotonic() - t0 <= 2.5
    assert "pdserve_router_active_requests 0" in metrics and "pdserve_router_queued_requests 0" in metrics


def _router(stack, tmp_path, name, *flags, key_prefix=None):
    from pdserve.runtime.launch import ServiceProcess

    port_file = tmp_path / f"{name}-http"
    common = ["--key-prefix", key_prefix or stack.key_prefix, "--redis-url", stack.redis_url, "--grace-s", "1"]
    p = ServiceProcess("services.router", "--model", "tiny", "--refresh-s", "0.2", *common, "--http-port", "0",
                       "--http-port-file", str(port_file), *flags, name=name).spawn()
    return p, port_file


def test_unavailable_deadline_and_an_error_after_the_stream_started(stack, tmp_path):
    empty, empty_port = _router(stack, tmp_path, "empty", "--queue-timeout-s", "0.2",
                                key_prefix=f"pdtest-{uuid.uuid4().hex[:8]}")
    short, short_port = _router(stack, tmp_path, "short", "--request-timeout-s", "0.6",
                                "--timeout-ms-per-prompt-token", "0", "--timeout-ms-per-output-token", "0")
    try:
        empty.wait_ready()
        short.wait_ready()
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(timeout=30) as h:
            r = h.post(f"http://127.0.0.1:{int(empty_port.read_text())}/v1/completions", json=body, headers=headers)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "unavailable" and "no healthy decode worker" in r.json()["error"][
                "message"]
            assert h.get(f"http://127.0.0.1:{int(empty_port.read_text())}/health").status_code == 503
            short_url = f"http://127.0.0.1:{int(short_port.read_text())}"
            deadline = time.time() + 20
            while h.get(f"{short_url}/health").status_code != 200:
                assert time.time() < deadline
                time.sleep(0.1)
            r = h.post(f"{short_url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
            r = h.post(f"{short_url}/v1/completions", json={**body, "stream": True}, headers=headers)
        assert r.status_code == 200
        events = _events(r.content)
        assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] is not None
        error = json.loads(events[-2])["error"]
        assert error["status"] == 504 and error["code"] == "deadline_exceeded" and error["message"]
        assert all("error" not in json.loads(e) for e in events[:-2])
    finally:
        empty.stop()
        short.stop()
    assert asyncio.run(settled(stack)) == SETTLED


def test_nulls_mean_the_default_and_a_template_that_cannot_use_a_field_is_a_400(stack):
    """OpenAI's clients send null for "not set"; a chat template fed a field of the wrong shape
    (here tool_calls: 5 where the template loops over them) answers 400, not 500."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = _post(stack, "/v1/completions", {**body, "n": None, "stream": None})
    assert r.status_code == 200, r.text
    plain = _post(stack, "/v1/completions", body).json()["choices"]
    assert [c["text"] for c in r.json()["choices"]] == [plain[0]["text"]]
    r = _post(stack, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 2, "logprobs": None})
    assert r.status_code == 200, r.text
    tmpl = ChatTemplate("{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{% endfor %}", {})
    with pytest.raises(TemplateError, match="could not use the messages"):
        tmpl.render([{"role": "assistant", "content": "", "tool_calls": 5}])


def test_a_chunked_body_over_the_limit_is_413(stack):
    def chunks():
        for _ in range(2048):
            yield b" " * 1024  # 2 MiB of whitespace, no Content-Length: over the tiny model's limit

    with httpx.Client(timeout=30) as h:
        r = h.post(f"{stack.http}/v1/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
