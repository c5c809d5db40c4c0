"""Chat templates: a conversation -> the prompt text a chat model was trained on.

A Hugging Face checkpoint carries its template (Jinja2) in chat_template.jinja (what transformers writes
since 4.43), or as "chat_template" in tokenizer_config.json (older checkpoints; a list of named templates
gives "default"). It is rendered as transformers' `apply_chat_template` renders it, so a prompt here is
the prompt the model's authors tested: trim_blocks and lstrip_blocks, the loop-controls extension and a
`{% generation %}` block (transformers marks assistant tokens with it; here it only renders its body),
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `dict` and a `namespace` that
refuses underscore names, and the variables transformers passes: the tokenizer's special tokens (bos_token,
eos_token, ...) from tokenizer_config.json, `messages`, `add_generation_prompt`, `tools`, `documents` and
any keyword a template reads (gpt-oss's `reasoning_effort`, `builtin_tools` and `model_identity`, Qwen3's
`enable_thinking`, Llama's `date_string`, ...). A message's reasoning is copied under the names templates
read, as transformers copies it: `reasoning_content` (Qwen3) and `thinking` (gpt-oss) from whichever of
`reasoning_content`, `thinking` or `reasoning` it has.

A template is code written by whoever published the checkpoint, and the messages are written by
whoever sends a request: it runs in Jinja2's immutable sandbox, which refuses attribute access to
Python's internals and any mutation of the objects it is given, and sees only plain JSON data (rebuilt here
from what the caller passed, so no object of the caller's reaches the template).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from moeserve.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning


class ChatTemplateError(UserError):
    """A template that cannot be read or compiled, or that refused a conversation (its raise_exception)."""


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token etc., as the template sees them
    origin: str = "<string>"  # where the template came from, for messages
    # beside a tokenizer_config.json: a Hugging Face tokenizer's template, whose prompt is tokenized as transformers
    # tokenizes it (add_special_tokens=False: the template writes any <bos> itself)
    hf_tokenizer: bool = False

    def __post_init__(self) -> None:
        self._template = _compile(self.source, self.origin)

    @property
    def writes_bos(self) -> bool:
        """Whether the template can write the <bos> token as text."""
        return "bos_token" in self.special_tokens

    @property
    def needs_bos(self) -> bool:
        """Whether the caller puts the <bos> id before the rendered prompt's tokens: never for a Hugging Face
        tokenizer's template (transformers encodes the prompt without special tokens; a Qwen template has no
        <bos>, and its config's bos_token_id must not add one); else when the template cannot write one."""
        return not self.hf_tokenizer and not self.writes_bos

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
               tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt for `messages` (dicts of role and content, and any other keys a template reads), as
        transformers' apply_chat_template(messages, tokenize=False, ...) renders it: keys whose value is None
        are left out (templates test `is defined`), a message's reasoning is copied under the names templates
        read, and `kwargs` (enable_thinking, reasoning_effort, ...) are variables beside the special tokens,
        over any of the same name."""
        import jinja2

        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ChatTemplateError("tools must be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("documents must be dicts (title and text)")
        messages = _plain([{k: v for k, v in m.items() if v is not None} for m in messages])
        messages = [_alias_reasoning(m) for m in messages]
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return self._template.render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception, a sandbox refusal, an undefined call
            raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: dict[str, str] | None = None,
                  hf_tokenizer: bool = False) -> "ChatTemplate":
        path = Path(path)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{path}: cannot read the chat template ({e})") from None
        return cls(source, special_tokens or {}, str(path), hf_tokenizer)


def load_chat_template(checkpoint_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
    """The checkpoint's template (or `override`, a template file), with the special tokens of its
    tokenizer_config.json; None if it has none."""
    directory = Path(checkpoint_dir)
    config = _tokenizer_config(directory)
    hf = (directory / "tokenizer_config.json").is_file()
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    if override is not None:
        return ChatTemplate.from_file(override, tokens, hf)
    if (directory / TEMPLATE_FILE).is_file():
        return ChatTemplate.from_file(directory / TEMPLATE_FILE, tokens, hf)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{directory / 'tokenizer_config.json'}: chat_template is not a string")
    return ChatTemplate(source, tokens, str(directory / "tokenizer_config.json"), hf)


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


def _plain(value: Any) -> Any:
    """`value` rebuilt of JSON types only (str, int, float, bool, None, dict, list, tuple), as transformers rebuilds
    what a template sees: a subclass (an enum, a numpy scalar) carries methods the sandbox does not know, and
    anything else becomes an inert "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # bool cannot be subclassed
        if isinstance(value, kind):  # the base type's own conversion: str() of a str Enum member is its name
            return getattr(kind, f"__{kind.__name__}__")(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under both names templates read: `reasoning_content` (Qwen3, which then wins over
    the field it came from) and `thinking` (gpt-oss, unless the message has its own), as transformers does."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _compile(source: str, origin: str):
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from e

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers records where the assistant's text falls (for
        training masks); a prompt is only its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing the underscore names that reach Python's internals (as transformers')."""

        def __init__(*args, **kwargs):  # Jinja's own signature trick, so that namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")

    class Dict:
        """`dict(...)` and `dict.fromkeys(...)`, without the dict type itself (whose attributes lead out)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which is not what a prompt wants
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: the chat template is not valid Jinja2 (line {e.lineno}: {e.message})") \
            from None
