"""Chat templates render what transformers' apply_chat_template renders, from the files transformers writes,
and a template cannot reach past the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from moeserve.chat import ChatTemplate, ChatTemplateError, load_chat_template  # noqa: E402

# Mixtral-8x7B-Instruct's template (as published): alternating roles, raise_exception, bos and eos as variables.
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# A ChatML-style one that uses what templates use: a system turn, namespace, loop controls, tojson, whitespace
# control, trim_blocks / lstrip_blocks, add_generation_prompt.
CHATML_TEMPLATE = """{%- set ns = namespace(turns=0) -%}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant {{ {"turns": ns.turns, "note": "é<>"} | tojson }}
{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "user", "content": "what is a mixture of experts?"}, {"role": "assistant", "content": "many FFNs"},
     {"role": "user", "content": "and the router?"}],
]
SYSTEM = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def write_tokenizer(path: Path, template: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (trained here on a few lines) with Mixtral's special tokens, saved by
    transformers with its chat template (transformers 5 writes chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [line for c in CONVERSATIONS for m in c for line in [m["content"]]] + ["[INST] [/INST] <|im_start|>"]
    tok.train_from_iterator(text * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = template
    hf.save_pretrained(path)
    return hf


def hf_chat_model(path: Path, template: str = MIXTRAL_TEMPLATE) -> PreTrainedTokenizerFast:
    """A tiny random Hugging Face Mixtral directory with a tokenizer and a chat template, all written by
    transformers; returns the tokenizer (the reference for apply_chat_template)."""
    tok = write_tokenizer(path, template)
    cfg = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    MixtralForCausalLM(cfg).save_pretrained(path)
    return tok


@pytest.mark.parametrize("template", [MIXTRAL_TEMPLATE, CHATML_TEMPLATE], ids=["mixtral", "chatml"])
def test_rendered_prompt_equals_transformers(tmp_path, template):
    hf = write_tokenizer(tmp_path, template)
    assert (tmp_path / "chat_template.jinja").is_file()  # where transformers keeps it now
    ours = load_chat_template(tmp_path)
    assert ours.special_tokens["bos_token"] == "<s>" and ours.writes_bos
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS + ([SYSTEM] if template == CHATML_TEMPLATE else []):
        for gen in (True, False):
            want = reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render(messages, add_generation_prompt=gen) == want
    assert hf.apply_chat_template(CONVERSATIONS[1], tokenize=False) == ours.render(CONVERSATIONS[1], False)


def test_template_inside_tokenizer_config_and_named_templates(tmp_path):
    """Older checkpoints: the template in tokenizer_config.json, a string or a list of named ones."""
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "chat_template": MIXTRAL_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render(CONVERSATIONS[0]) == "<s>[INST] hello there [/INST]"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ eos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render(CONVERSATIONS[0]) == "</s>"
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    assert load_chat_template(tmp_path, override).render(CONVERSATIONS[0]) == "user:hello there;"
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path) is None
    assert load_chat_template(tmp_path / "nowhere") is None


def test_template_refusals_are_named_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate(MIXTRAL_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}).render(
            [{"role": "assistant", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match=r"not valid Jinja2 \(line 1"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="cannot read"):
        ChatTemplate.from_file("/nonexistent/template.jinja")


@pytest.mark.parametrize("escape", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # the classic way out to os / subprocess
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}",  # mutation
])
def test_the_sandbox_refuses_escapes(escape):
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate(escape).render(CONVERSATIONS[0])


def test_unsafe_attributes_render_as_nothing():
    """Jinja's sandbox answers an unsafe attribute with an undefined value: nothing leaks into the prompt."""
    assert ChatTemplate("[{{ raise_exception.__globals__ }}{{ messages.__len__ }}]").render(CONVERSATIONS[0]) == "[]"
