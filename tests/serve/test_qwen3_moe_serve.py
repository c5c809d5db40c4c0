"""A Qwen3-MoE directory served (issue 41): completions and chat through the openai client equal the engine's, the
expert-load metrics count its routed tokens exactly, and /v1/chat/completions renders its template as
transformers' apply_chat_template with tokenize=True would, token for token: no <bos> of the server's own before a
template that writes none (Qwen's tokenizer has no bos_token, while its config.json names a bos_token_id), and the
request's reasoning_effort and chat_template_kwargs as the template's variables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from moeserve.runtime.engine import Engine, SamplingParams  # noqa: E402
from moeserve.serve.state import ServeConfig  # noqa: E402

from ..test_chat_families import FIXTURES  # noqa: E402
from .conftest import live_server  # noqa: E402
from .test_server import routed  # noqa: E402

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a mixture of experts?"}]


def qwen_like(path: Path) -> PreTrainedTokenizerFast:
    """A tiny Qwen3-MoE (QK-norm, heads wider than hidden / heads, a dense layer) whose tokenizer is Qwen3's in what
    matters here: its template, <|im_start|> and <|im_end|>, no bos_token, eos <|im_end|>, and a config.json whose
    bos_token_id is <|endoftext|>'s (as Qwen's is)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for m in MESSAGES] * 20 + ["system user assistant think"], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=(FIXTURES / "qwen3_moe.jinja").read_text(encoding="utf-8"))
    hf.save_pretrained(path)
    cfg = Qwen3MoeConfig(vocab_size=len(hf), hidden_size=32, head_dim=16, intermediate_size=64,
                         moe_intermediate_size=48, num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                         max_position_embeddings=256, bos_token_id=hf.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=hf.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-like")
    tok = qwen_like(path)
    with live_server(lambda: Engine.load(path, dtype="float32", device="cpu"), ServeConfig(model_name="q")) as s:
        yield s, tok


@pytest.fixture(scope="module")
def ref(qwen) -> Engine:
    """A second engine on the same directory, in this process: what the server must answer."""
    return Engine.load(qwen[0].engine.path, dtype="float32", device="cpu")


def test_completions_and_chat_through_the_openai_client_equal_the_engines(qwen, ref):
    server, tok = qwen
    assert ref.cfg.extra["hf_model_type"] == "qwen3_moe" and ref.cfg.qk_norm == "head"
    client = server.openai()
    r = client.completions.create(model="q", prompt="a mixture of experts", max_tokens=8, temperature=0)
    want = ref.complete(["a mixture of experts"], [SamplingParams(8, 0.0)])[0]
    assert (r.choices[0].text, r.usage.completion_tokens) == (want.text, want.completion_tokens)
    chat = client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=8, temperature=0)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = ref.complete([ids], [SamplingParams(8, 0.0)])[0]
    assert chat.choices[0].message.content == want.text and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].finish_reason == want.finish_reason


def test_metrics_count_its_experts_load_exactly(qwen, ref):
    server, _ = qwen
    assert server.engine.cfg.moe_layer_ids == [0, 2]  # layer 1 is dense (mlp_only_layers)
    text = "what is a mixture of experts? be brief"
    before = routed(server)
    assert server.post("/v1/score", {"model": "q", "input": text}).status_code == 200
    want = torch.stack([torch.bincount(torch.tensor(layer).flatten(), minlength=ref.cfg.n_experts)
                        for layer in ref.route(text)])
    assert torch.equal(routed(server) - before, want) and int(want.sum()) > 0


def prompt_tokens(server, **fields) -> int:
    r = server.post(CHAT, {"model": "q", "messages": MESSAGES, "max_tokens": 1, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_no_bos_before_a_template_that_writes_none(qwen):
    server, tok = qwen
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in ids
    assert prompt_tokens(server) == len(ids)


def test_chat_template_kwargs_are_the_templates_variables(qwen):
    server, tok = qwen
    off = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False,
                                  enable_thinking=False)
    on = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(off) > len(on)  # the empty <think></think> that turns thinking off
    assert prompt_tokens(server, chat_template_kwargs={"enable_thinking": False}) == len(off)
    assert prompt_tokens(server, chat_template_kwargs={"enable_thinking": True}) == len(on)


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": "x"}, "chat_template_kwargs.messages"),  # what the server passes itself
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"x": "\ud800"}, "chat_template_kwargs.x"),  # a lone surrogate: no text a tokenizer encodes
    ({"x": [1]}, "chat_template_kwargs"),  # only scalars
])
def test_chat_template_kwargs_refused(qwen, kwargs, param):
    server, _ = qwen
    body = json.dumps({"model": "q", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs})
    r = server.client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_value" and r.json()["error"]["param"] == param


def test_reasoning_effort_is_the_templates_variable(qwen, tmp_path):
    server, tok = qwen
    template = tmp_path / "effort.jinja"
    template.write_text("{{ reasoning_effort | default('unset') }}:{% for m in messages %}{{ m.content }}{% endfor %}")
    with live_server(lambda: Engine.load(server.engine.path, dtype="float32", device="cpu"),
                     ServeConfig(model_name="q", chat_template=template)) as s:
        for effort, text in ((None, "unset:"), ("high", "high:")):
            fields = {} if effort is None else {"reasoning_effort": effort}
            want = tok(text + "be briefwhat is a mixture of experts?", add_special_tokens=False)["input_ids"]
            assert prompt_tokens(s, **fields) == len(want)
        r = s.post(CHAT, {"model": "q", "messages": MESSAGES, "reasoning_effort": "extreme"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "reasoning_effort"
