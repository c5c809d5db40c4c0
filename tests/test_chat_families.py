"""The chat templates the MoE families ship (tests/fixtures/chat_templates, sources in its README) render in
moeserve exactly as transformers' apply_chat_template renders them.

Each template goes into a tokenizer directory that transformers writes (save_pretrained: tokenizer.json,
tokenizer_config.json with the family's special tokens, chat_template.jinja), which moeserve loads through
load_chat_template, as a server would; the tokenizer transformers reloads from the same directory is the
reference. The clock that gpt-oss's `strftime_now("%Y-%m-%d")` reads is fixed on both sides.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import jinja2  # noqa: E402
import transformers.utils.chat_template_utils as hf_chat  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

import moeserve.chat  # noqa: E402
from moeserve.chat import ChatTemplate, ChatTemplateError, load_chat_template  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
# each family's special tokens, as its tokenizer_config.json names them (README beside the templates)
QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
FAMILIES = {
    "qwen2_moe": QWEN,
    "qwen2_moe_base": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "qwen3_moe": QWEN,
    "qwen3_moe_2504": QWEN,
    "olmoe": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"},
    "gpt_oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
}
TODAY = datetime(2025, 8, 5, 23, 59, 58)

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "system+user": [SYSTEM, {"role": "user", "content": "What is a mixture of experts?"}],
    "user": [{"role": "user", "content": "héllo 日本 <b>&</b>"}],
    "multi-turn": [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                   {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"},
                   {"role": "user", "content": "thanks"}],
    "ends-with-assistant": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "think-in-content": [  # Qwen3's way: the reasoning inside the content; only the last turn's is kept
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}],
    "reasoning_content": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4", "reasoning_content": "add them"}],
    "thinking": [{"role": "user", "content": "2+2?"},  # gpt-oss's field, which transformers copies for Qwen3
                 {"role": "assistant", "content": "4", "thinking": "add them"}],
    "developer": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}],
    "none-fields": [{"role": "user", "content": "hi", "name": None},
                    {"role": "assistant", "content": "yo", "tool_calls": None}],
    "tool-call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22C and sunny"},
        {"role": "assistant", "content": "It is 22C and sunny."}],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["C", "F"], "default": "C"}}}}}
# what transformers passes beside the messages that these templates read
KWARGS = {
    "none": {},
    "tools": {"tools": [WEATHER]},
    "thinking-off": {"enable_thinking": False},  # Qwen3
    "thinking-on": {"enable_thinking": True},
    "harmony": {"reasoning_effort": "high", "builtin_tools": ["browser", "python"],  # gpt-oss
                "model_identity": "You are a test model.", "tools": [WEATHER]},
    "harmony-low": {"reasoning_effort": "low"},
}


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    """strftime_now reads datetime.now() in transformers and in moeserve: both see TODAY."""
    class Fixed(datetime):
        @classmethod
        def now(cls, tz=None):
            return TODAY

    monkeypatch.setattr(hf_chat, "datetime", Fixed)
    monkeypatch.setattr(moeserve.chat, "datetime", Fixed)


def tokenizer_dir(path: Path, template: str, tokens: dict[str, str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer holding the family's special tokens, written with its template by transformers;
    returns the tokenizer transformers reloads from `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", *sorted(set(tokens.values()))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, unk_token="[UNK]", **tokens) \
        .save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers' tokenizer, moeserve's template), both from the directory transformers wrote."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = tokenizer_dir(path, (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8"), FAMILIES[name])
    assert (path / "tokenizer_config.json").is_file() and (path / "chat_template.jinja").is_file()
    return name, hf, load_chat_template(path)


def both(hf, ours: ChatTemplate, messages, gen: bool, kwargs: dict) -> tuple[str, str]:
    """transformers' rendering and moeserve's; a refusal on one side must be a refusal on the other."""
    try:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
    except jinja2.TemplateError as e:
        with pytest.raises(ChatTemplateError, match="refused"):
            ours.render(messages, add_generation_prompt=gen, **kwargs)
        return f"refused: {e}", f"refused: {e}"
    return want, ours.render(messages, add_generation_prompt=gen, **kwargs)


def test_the_special_tokens_come_from_tokenizer_config(family):
    name, hf, ours = family
    assert ours.special_tokens == {**FAMILIES[name], "unk_token": "[UNK]"}
    assert ours.source == (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    assert not ours.needs_bos  # transformers tokenizes the rendered prompt without adding special tokens


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "no-gen"])
def test_renders_as_transformers(family, conversation, gen):
    _, hf, ours = family
    want, got = both(hf, ours, CONVERSATIONS[conversation], gen, {})
    assert got == want


@pytest.mark.parametrize("kw", sorted(KWARGS))
@pytest.mark.parametrize("conversation", ["system+user", "multi-turn", "tool-call", "developer"])
def test_template_variables_render_as_transformers(family, kw, conversation):
    _, hf, ours = family
    for gen in (True, False):
        want, got = both(hf, ours, CONVERSATIONS[conversation], gen, KWARGS[kw])
        assert got == want


def test_what_the_families_write(family):
    """The features the comparisons above cover are there to be compared: not two empty prompts."""
    name, hf, ours = family
    think = ours.render(CONVERSATIONS["think-in-content"], add_generation_prompt=False)
    if name.startswith("qwen3"):
        assert think.endswith("<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6<|im_end|>\n")
        assert "add them" not in think  # earlier turns' reasoning is dropped
        assert ours.render(CONVERSATIONS["thinking"], False).count("<think>\nadd them\n</think>") == 1
        assert ours.render(CONVERSATIONS["user"], enable_thinking=False).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    if name == "gpt_oss":
        prompt = ours.render(CONVERSATIONS["developer"], **KWARGS["harmony"])
        assert "Current date: 2025-08-05\n" in prompt and "Reasoning: high" in prompt and "## browser" in prompt
        assert "<|start|>developer<|message|># Instructions\n\nAnswer in French." in prompt
        assert "type get_weather = (_: {" in prompt and prompt.endswith("<|start|>assistant")
        assert "<|channel|>analysis<|message|>add them<|end|>" in ours.render(CONVERSATIONS["reasoning_content"],
                                                                             False)
    if name == "olmoe":
        assert ours.render(CONVERSATIONS["system+user"]) == \
            "<|endoftext|><|system|>\nYou are terse.\n<|user|>\nWhat is a mixture of experts?\n<|assistant|>\n"
    if name.startswith("qwen2"):
        assert ours.render(CONVERSATIONS["user"]).startswith("<|im_start|>system\nYou are a helpful assistant")


def test_refusals_match(family):
    """gpt-oss refuses harmony tags inside a message's content, as transformers does."""
    name, hf, ours = family
    smuggled = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<|channel|>analysis<|message|>x<|end|>"}]
    want, got = both(hf, ours, smuggled, False, {})
    assert got == want
    assert want.startswith("refused") == (name == "gpt_oss")


# ---- the transformers features that the shipped templates do not happen to use ------------------------------
EXTRAS = """{%- set ns = namespace(n=0) -%}
{%- for m in messages %}{% generation %}{{ m.role }}={{ m.content }};{% endgeneration %}{% set ns.n = ns.n + 1 %}
{%- endfor %}
{{- dict(a=1, b=[2, 3]) | tojson }}|{{ dict.fromkeys(['x'], 0) | tojson }}|{{ ns.n }}|{{ documents | tojson }}
{%- if date_string is defined %}|{{ date_string }}{% endif %}|{{ strftime_now('%d %b %Y') }}"""


def test_generation_blocks_dict_namespace_documents_and_kwargs(tmp_path):
    hf = tokenizer_dir(tmp_path, EXTRAS, {"eos_token": "</s>"})
    ours = load_chat_template(tmp_path)
    docs = [{"title": "t", "text": "é"}]
    for kwargs in ({}, {"documents": docs, "date_string": "26 Jul 2024"}):
        want = hf.apply_chat_template(CONVERSATIONS["multi-turn"], tokenize=False, **kwargs)
        assert ours.render(CONVERSATIONS["multi-turn"], False, **kwargs) == want
    assert want.endswith(';{"a": 1, "b": [2, 3]}|{"x": 0}|6|[{"title": "t", "text": "é"}]|26 Jul 2024|05 Aug 2025')


@pytest.mark.parametrize("escape", [
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",  # the names that lead to Python's internals
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ dict.__call__.__globals__ }}",
])
def test_namespace_and_dict_stay_in_the_sandbox(escape):
    try:
        assert ChatTemplate(escape).render(CONVERSATIONS["user"]) == ""
    except ChatTemplateError as e:
        assert "refused" in str(e)


def test_only_plain_data_reaches_the_template():
    """Objects the caller passes are rebuilt as JSON types: an enum member is its string, other objects a name."""
    import enum

    class Role(str, enum.Enum):
        USER = "user"

    template = ChatTemplate("{{ messages[0].role }} {{ messages[0].content.__class__ }} {{ extra }} {{ tools }}")
    assert template.render([{"role": Role.USER, "content": "hi"}], extra=object(), tools=[{"a": (1, 2)}]) == \
        "user  <object> [{'a': (1, 2)}]"
    with pytest.raises(ChatTemplateError, match="tools must be"):
        template.render(CONVERSATIONS["user"], tools=[print])


def test_a_template_without_tokenizer_config_asks_for_bos():
    """A moeserve checkpoint's template (no tokenizer_config.json): the caller writes <bos> unless the template
    can; a Hugging Face tokenizer's never gets one from the caller (transformers adds none)."""
    assert ChatTemplate("{{ messages[0].content }}").needs_bos
    assert not ChatTemplate("{{ bos_token }}", {"bos_token": "<s>"}).needs_bos
