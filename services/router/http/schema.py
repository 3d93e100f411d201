"""The OpenAI request bodies (pydantic, at the edge) and the checks that turn one into sampling
parameters. Fields OpenAI defines that this engine cannot honour are refused when set to
anything but their neutral value; fields OpenAI does not define are ignored, logged once."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pdserve import logs
from pdserve.engine.sampling import SamplingParams
from services.router.http.errors import ApiError

log = logs.get("router.http")
MAX_N = 16  # choices per request
MAX_CHOICES = 64  # generations one request may start: its prompts times n
MAX_TOKEN_ID = (1 << 31) - 1  # a token id, as the workers' messages carry it
MAX_STOP_STRINGS = 16

# OpenAI fields the engine does not implement, with the values that ask for nothing.
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "best_of": (1,),
           "echo": (False,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
           "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},),
           "parallel_tool_calls": (True, False), "store": (False,), "metadata": ({},),
           "service_tier": ("auto", "default"), "modalities": (["text"],), "audio": (), "prediction": (),
           "reasoning_effort": (), "web_search_options": (), "min_tokens": (0,)}
_logged_unknown: set[str] = set()


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # (null: OpenAI's clients send it for "not set")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # (vLLM's; -1 or 0: off)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # (vLLM's)
    ignore_eos: bool = False  # (vLLM's)
    n: int | None = 1  # (null, as OpenAI takes it: the default)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # (strict: true is not a token id)
    logprobs: int | None = None


class ChatBody(_Common):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


@dataclass(frozen=True)
class Options:
    """What a body asks of generation, checked; the prompt is the endpoint's business."""

    max_tokens: int | None  # None: the endpoint's default
    params: SamplingParams  # (max_tokens set per prompt once its length is known)
    stop: tuple[str, ...]
    n: int
    logprobs: bool
    stream: bool
    include_usage: bool


def check_fields(body: _Common) -> None:
    """Refuse what cannot be honoured; log (once per name) what is not OpenAI's."""
    for name, value in (body.model_extra or {}).items():
        if name in NEUTRAL:
            if value is not None and value not in NEUTRAL[name]:
                raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported")
        elif name not in _logged_unknown:
            _logged_unknown.add(name)
            log.warning("ignoring a request field this API does not define", field=name)


def options(body: _Common, max_tokens: int | None, want_logprobs: bool) -> Options:
    check_fields(body)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if body.seed is not None and not 0 <= body.seed < 1 << 63:
        raise ApiError(400, f"seed must be in [0, 2^63), got {body.seed}", param="seed")
    if body.top_k is not None and not -1 <= body.top_k <= MAX_TOKEN_ID:
        raise ApiError(400, f"top_k must be -1 or 0 (off) or positive (at most {MAX_TOKEN_ID}), got {body.top_k}",
                       param="top_k")
    if any(not 0 <= t <= MAX_TOKEN_ID for t in body.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {MAX_TOKEN_ID}]", param="stop_token_ids")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    try:
        params = SamplingParams(
            max_tokens=1, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0), seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    return Options(max_tokens, params, stop, n, want_logprobs, stream,
                   bool(body.stream_options and body.stream_options.include_usage))


def completion_options(body: CompletionBody) -> Options:
    if body.logprobs is not None and body.logprobs != 0:
        raise ApiError(400, "logprobs: this engine returns the sampled token's logprob only; ask for logprobs: 0",
                       param="logprobs", code="unsupported")
    return options(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs is not None)


def chat_options(body: ChatBody) -> Options:
    if body.top_logprobs:
        raise ApiError(400, "top_logprobs: this engine returns the sampled token's logprob only; ask for "
                       "logprobs: true with top_logprobs 0", param="top_logprobs", code="unsupported")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return options(body, wanted, bool(body.logprobs))


def message_text(messages: list[dict]) -> list[dict]:
    """Messages as templates expect them: each a role and its text (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}] has no role", param=f"messages[{i}].role")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages[{i}].content")
        out.append({**m, "role": role, "content": content})
    return out
