"""Chat messages to prompt text, with the model's own chat template, rendered as transformers
renders it (`PreTrainedTokenizerBase.apply_chat_template`): jinja2's immutable sandbox with
`trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that keeps non-ASCII text, and the tokenizer's special tokens as variables. The rendered text
holds its own special tokens, so it is tokenized without adding any.

Where the template comes from: `chat_template.jinja` in the checkpoint directory, else the
`chat_template` entry of its `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used). The built-in `tiny` model has a small template of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.model.tokenizer import BOS_TOKEN, EOS_TOKEN

TINY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """Messages the template refuses (its `raise_exception`), or a template that fails to render."""


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    """One model's compiled template and the special tokens it is rendered with. Immutable."""

    source: str
    special_tokens: dict[str, str]

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            object.__setattr__(self, "_compiled", env.from_string(self.source))
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the model's chat template does not compile: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the model's chat template refused the messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a field of the wrong shape
            raise TemplateError(f"the model's chat template could not use the messages "
                                f"({type(e).__name__}: {e})") from e

    @classmethod
    def for_model(cls, name_or_path: str) -> ChatTemplate | None:
        """The model's template, or None when it has none (chat requests are then refused)."""
        if name_or_path == "tiny":
            return cls(TINY_TEMPLATE, {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})
        path = Path(name_or_path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_path = path / "chat_template.jinja"
        source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
        if isinstance(source, list):
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if not source:
            return None
        return cls(source, {name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name)})


def _content(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)
