"""Chat templates: a conversation -> the prompt text a chat model was trained on.

A Hugging Face checkpoint carries its template (Jinja2) in chat_template.jinja (what transformers writes
since 4.43), or as "chat_template" in tokenizer_config.json (older checkpoints; a list of named templates
gives "default"). It is rendered as transformers' `apply_chat_template` renders it, so a prompt here is
the prompt the model's authors tested: trim_blocks and lstrip_blocks, the loop-controls extension,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the tokenizer's special
tokens (bos_token, eos_token, ...) from tokenizer_config.json as variables beside `messages` and
`add_generation_prompt`.

A template is code written by whoever published the checkpoint, and the messages are written by
whoever sends a request: it runs in Jinja2's immutable sandbox, which refuses attribute access to
Python's internals and any mutation of the objects it is given, and sees only plain JSON data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from moeserve.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(UserError):
    """A template that cannot be read or compiled, or that refused a conversation (its raise_exception)."""


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token etc., as the template sees them
    origin: str = "<string>"  # where the template came from, for messages

    def __post_init__(self) -> None:
        self._template = _compile(self.source, self.origin)

    @property
    def writes_bos(self) -> bool:
        """Whether the template can write the <bos> token as text; if not, the caller puts its id first."""
        return "bos_token" in self.special_tokens

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (dicts of role and content; keys whose value is None are left out,
        as transformers does, so that templates testing `is defined` see what they expect)."""
        import jinja2

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                         documents=None, **self.special_tokens)
        except jinja2.TemplateError as e:  # raise_exception, a sandbox refusal, an undefined call
            raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: dict[str, str] | None = None) -> "ChatTemplate":
        path = Path(path)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{path}: cannot read the chat template ({e})") from None
        return cls(source, special_tokens or {}, str(path))


def load_chat_template(checkpoint_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
    """The checkpoint's template (or `override`, a template file), with the special tokens of its
    tokenizer_config.json; None if it has none."""
    directory = Path(checkpoint_dir)
    config = _tokenizer_config(directory)
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    if override is not None:
        return ChatTemplate.from_file(override, tokens)
    if (directory / TEMPLATE_FILE).is_file():
        return ChatTemplate.from_file(directory / TEMPLATE_FILE, tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{directory / 'tokenizer_config.json'}: chat_template is not a string")
    return ChatTemplate(source, tokens, str(directory / "tokenizer_config.json"))


def _tokenizer_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object")
    return config


def _compile(source: str, origin: str):
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from e

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which is not what a prompt wants
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: the chat template is not valid Jinja2 (line {e.lineno}: {e.message})") \
            from None
