"""Chat completions, log-probabilities, echo, n and best_of, over a socket, checked against the engine.

The chat server runs a Hugging Face Mixtral directory whose tokenizer and chat template transformers
wrote (tests/test_chat.py); its answers must be the engine's answers to the token ids that transformers'
apply_chat_template gives for the same messages. Log-probabilities must be Engine.score's terms and a
direct top-k of the model's log-softmax; each of n choices must be the single request with its seed.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from moeserve.chat import ChatTemplate  # noqa: E402
from moeserve.runtime.engine import Engine, SamplingParams  # noqa: E402
from moeserve.serve.state import ServeConfig  # noqa: E402

from ..test_chat import CONVERSATIONS, hf_chat_model  # noqa: E402
from .conftest import live_server  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(server, transformers tokenizer) for a tiny HF Mixtral with a chat template."""
    path = tmp_path_factory.mktemp("mixtral-chat")
    tok = hf_chat_model(path)
    with live_server(lambda: Engine.load(path, dtype="float32", device="cpu"), ServeConfig(model_name="mixtral")) as s:
        yield s, tok


def greedy(engine: Engine, ids: list[int], n: int, **kw) -> object:
    return engine.complete([ids], [SamplingParams(max_new_tokens=n, **kw)])[0]


# ---- chat ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "three-turns"])
def test_chat_answers_the_prompt_transformers_renders(mixtral, messages):
    server, tok = mixtral
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = greedy(server.engine, ids, 12)
    r = server.openai().chat.completions.create(model="mixtral", messages=messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(ids)  # the same prompt, token for token (answers below agree too)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == want.completion_tokens


def test_chat_stream_deltas_add_up_to_the_whole_answer(mixtral):
    server, _ = mixtral
    c = server.openai()
    kw = dict(model="mixtral", messages=CONVERSATIONS[1], max_completion_tokens=16, temperature=0.8, seed=5)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_logprobs_are_the_models_own(mixtral):
    server, tok = mixtral
    messages = CONVERSATIONS[0]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = server.openai().chat.completions.create(model="mixtral", messages=messages, max_tokens=6, temperature=1.3,
                                                seed=2, logprobs=True, top_logprobs=3)
    want = server.engine.complete([ids], [SamplingParams(max_new_tokens=6, temperature=1.3, seed=2)])[0]
    content = r.choices[0].logprobs.content
    assert len(content) == want.completion_tokens
    ref = server.engine.forward(torch.tensor([ids + want.token_ids]))[0].log_softmax(-1)
    for i, (entry, t) in enumerate(zip(content, want.token_ids)):
        row = ref[len(ids) - 1 + i]  # before the temperature of 1.3
        assert entry.logprob == pytest.approx(float(row[t]), abs=TOL)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOL)
        before, after = tok.decode(ids + want.token_ids[:i]), tok.decode(ids + want.token_ids[:i + 1])
        # what decoding gains by the token; one that ends a character begun by the token before it changes that
        # token's U+FFFD, so it is decoded alone (serve/logprobs.py: a part of a character is U+FFFD)
        assert entry.token == (after[len(before):] if after.startswith(before) else tok.decode([t]))
        assert entry.bytes == list(entry.token.encode())
    streamed = list(server.openai().chat.completions.create(
        model="mixtral", messages=messages, max_tokens=6, temperature=1.3, seed=2, logprobs=True, top_logprobs=3,
        stream=True))
    got = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in got] == [e.logprob for e in content]


def test_chat_n_choices_each_equal_a_request_with_its_seed(mixtral):
    server, _ = mixtral
    c = server.openai()
    kw = dict(model="mixtral", messages=CONVERSATIONS[0], max_tokens=10, temperature=1.0)
    r = c.chat.completions.create(**kw, n=3, seed=40)
    singles = [c.chat.completions.create(**kw, seed=40 + j).choices[0].message.content for j in range(3)]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == singles
    assert len(set(singles)) > 1


def test_chat_template_override(mixtral, tmp_path):
    """--chat-template wins over the checkpoint's."""
    server, tok = mixtral
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    path = server.engine.path
    with live_server(lambda: Engine.load(path, dtype="float32", device="cpu"),
                     ServeConfig(model_name="m", chat_template=template)) as s:
        r = s.post("/v1/chat/completions", {"model": "m", "messages": CONVERSATIONS[0], "max_tokens": 4,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        # tokenizer_config.json names a bos_token that this template could write and does not: none is added,
        # as transformers would not add one
        ids = tok("hello there ", add_special_tokens=False)["input_ids"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["choices"][0]["message"]["content"] == greedy(s.engine, ids, 4).text


# ---- completions: logprobs, echo, max_tokens 0 -----------------------------------------------------
def test_echo_scores_the_prompt_as_engine_score(mixtral):
    server, tok = mixtral
    text = "what is a mixture of experts?"
    r = server.post("/v1/completions", {"model": "mixtral", "prompt": text, "echo": True, "max_tokens": 0,
                                        "logprobs": 4})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    ids = server.engine.encode(text)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(server.engine.token_logprobs_ids([ids])[0], abs=TOL)
    assert sum(lp["token_logprobs"][1:]) == pytest.approx(server.engine.score([text])[0].logprob, abs=1e-3)
    ref = server.engine.forward(torch.tensor([ids]))[0].log_softmax(-1)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        # the 4 likeliest and the token itself, keyed by text: ids that decode alike share a key, the likelier's
        want = ref[i].topk(4).values.tolist() + [float(ref[i, ids[i + 1]])]
        assert max(top.values()) == pytest.approx(want[0], abs=TOL)
        assert all(any(abs(v - w) < TOL for w in want) for v in top.values())
        assert top[lp["tokens"][i + 1]] >= lp["token_logprobs"][i + 1] - TOL
    assert "".join(lp["tokens"]) == text  # <s> has no text; the rest joins into the prompt
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_generated_logprobs_with_echo_continue_the_prompts(mixtral):
    server, _ = mixtral
    body = {"model": "mixtral", "prompt": "hello", "echo": True, "max_tokens": 5, "logprobs": 2, "temperature": 0}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    ids = server.engine.encode("hello")
    want = greedy(server.engine, ids, 5)
    assert choice["text"] == "hello" + want.text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + want.completion_tokens
    ref = server.engine.forward(torch.tensor([ids + want.token_ids]))[0].log_softmax(-1)
    gen = lp["token_logprobs"][len(ids):]
    assert gen == pytest.approx([float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(want.token_ids)], abs=TOL)
    for top, tlp in zip(lp["top_logprobs"][len(ids):], gen):
        assert max(top.values()) == tlp  # greedy: the chosen token is the likeliest, exactly the same number


def test_lm_eval_harness_loglikelihood_requests(mixtral):
    """lm-evaluation-harness's `local-completions` model, request for request: a batch of token-id prompts
    (context + continuation), echo, max_tokens 1, logprobs 1, temperature 0, seed 1234; it sums
    token_logprobs[ctxlen:-1] and calls a continuation greedy if each of its tokens tops its top_logprobs.
    (The harness itself is not a test dependency: it pulls in datasets, evaluate and more.)"""
    server, tok = mixtral
    pairs = [("the router sends", " tokens to experts"), ("hello", " there"), ("many", " FFNs")]
    contexts = [[tok.bos_token_id] + tok.encode(c, add_special_tokens=False) for c, _ in pairs]
    conts = [tok.encode(c + x, add_special_tokens=False)[len(ctx) - 1:] for (c, x), ctx in zip(pairs, contexts)]
    body = {"model": "mixtral", "prompt": [c + x for c, x in zip(contexts, conts)], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    got = []
    for choice, ctx in zip(sorted(out["choices"], key=lambda c: c["index"]), contexts):
        lps = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        got.append((sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))))
    for (lp, is_greedy), ctx, cont in zip(got, contexts, conts):
        full = ctx + cont
        terms = server.engine.token_logprobs_ids([full])[0][len(ctx) - 1:]
        assert lp == pytest.approx(sum(terms), abs=1e-3)
        logits = server.engine.forward(torch.tensor([full]))[0]
        assert is_greedy == all(int(logits[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))


# ---- n and best_of -----------------------------------------------------------------------------------
def test_n_choices_each_equal_a_single_request_with_its_seed(live):
    body = {"model": "tiny", "prompt": ["def f(", "import"], "max_tokens": 12, "temperature": 0.9, "seed": 100}
    r = live.post("/v1/completions", {**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))  # prompt i's choice j at i * n + j
    singles = [live.post("/v1/completions", {**body, "prompt": p, "seed": 100 + j}).json()["choices"][0]["text"]
               for p in body["prompt"] for j in range(3)]
    assert [c["text"] for c in r["choices"]] == singles
    assert len(set(singles[:3])) > 1
    assert r["usage"]["prompt_tokens"] == len("def f(") + 1 + len("import") + 1  # each prompt once


def test_n_choices_stream(live):
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2}
    whole = live.post("/v1/completions", body).json()
    texts = {0: "", 1: ""}
    with live.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]


def test_best_of_returns_the_likeliest_per_token(live):
    body = {"model": "tiny", "prompt": "for i in", "max_tokens": 6, "temperature": 1.0, "seed": 7}
    singles = [live.post("/v1/completions", {**body, "seed": 7 + j, "logprobs": 0}).json()["choices"][0]
               for j in range(4)]
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in singles]
    r = live.post("/v1/completions", {**body, "n": 2, "best_of": 4}).json()
    order = sorted(range(4), key=lambda j: means[j], reverse=True)
    assert [c["text"] for c in r["choices"]] == [singles[j]["text"] for j in order[:2]]
    assert all(c["logprobs"] is None for c in r["choices"])  # not asked for
    assert r["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in singles)  # all generated


def test_logprobs_stream_equal_the_whole_answer(live):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 10, "temperature": 0.7, "seed": 1, "logprobs": 3,
            "stop": ["\n"]}
    whole = live.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with live.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and (lp := json.loads(line[6:])["choices"][0]["logprobs"]):
                for k in got:
                    got[k] += lp[k]
    assert got == {k: whole[k] for k in got}
    assert all(math.isfinite(x) for x in whole["token_logprobs"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_ignore_eos_generates_max_tokens(tiny_ckpt, tiny_chat_template, path):
    """A tokenizer whose end-of-sequence is the prompt's first greedy token: the request ends at once, unless
    it asks to ignore the end (the extension benchmarks use for fixed output lengths)."""
    from moeserve.tokenizer import ByteTokenizer

    engine = Engine.load(tiny_ckpt, dtype="float32", device="cpu")
    if path == "/v1/completions":
        body, ids = {"prompt": "hi"}, engine.encode("hi")
    else:
        messages = [{"role": "user", "content": "hi"}]
        body = {"messages": messages}
        ids = engine.tokenizer.encode(ChatTemplate.from_file(tiny_chat_template).render(messages), bos=True)
    engine.tokenizer = type("EndsAtOnce", (ByteTokenizer,), {"eos_id": greedy(engine, ids, 1).token_ids[0]})()
    with live_server(engine, ServeConfig(model_name="t", chat_template=tiny_chat_template)) as s:
        body = {"model": "t", "max_tokens": 7, "temperature": 0, **body}
        ends = s.post(path, body).json()
        assert ends["choices"][0]["finish_reason"] == "stop" and ends["usage"]["completion_tokens"] == 0
        full = s.post(path, {**body, "ignore_eos": True}).json()
        assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 7
