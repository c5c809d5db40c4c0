"""The bad-input matrix: every kind of malformed, mistyped, out-of-range or unauthorized request, sent
over a socket to a real server, gets its exact status and error body, and never a 5xx.

Each row of CASES is one request and what must come back: the status (as protocol.STATUS gives it for
the code), `error.code`, `error.param` (the field at fault, named in the message too) and `error.limit`
(None: the error has no limit). Limits that depend on the model are computed from the tiny checkpoint:
a context of CTX tokens, a byte tokenizer of VOCAB ids, and a text prompt encoded as <bos> + its UTF-8
bytes. Two servers answer: `live` with the default limits, and `guarded` with a bearer token and a small
body limit. After the matrix both still serve a normal completion, and /metrics has counted no 5xx.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from moeserve.runtime.engine import Engine
from moeserve.serve.state import ServeConfig
from moeserve.serve.protocol import MAX_SEED, STATUS, error_type

from .conftest import Live, live_server

CTX = 64  # the tiny model's context
VOCAB = 259  # byte tokenizer: 256 bytes, <bos>, <eos>, <pad>
MAX_INPUTS = 32  # ServeConfig.max_inputs default
DEFAULT_BODY_LIMIT = 1 << 20  # ServeConfig.max_body_bytes default
TOKEN = "secret"  # the guarded server's api_key
GUARDED_BODY_LIMIT = 2048  # the guarded server's max_body_bytes

CMPL, SCORE, CLASSIFY, MODELS = "/v1/completions", "/v1/score", "/v1/classify", "/v1/models"
CHAT = "/v1/chat/completions"
JSON = "application/json"


def n_tokens(text: str) -> int:
    """A text prompt's length in tokens: <bos> + one per UTF-8 byte."""
    return 1 + len(text.encode("utf-8"))


def cmpl(**fields) -> dict:
    """A valid completion request with `fields` changed (a value of ... removes the field)."""
    body = {"model": "tiny", "prompt": "hi", **fields}
    return {k: v for k, v in body.items() if v is not ...}


def chat(**fields) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return {k: v for k, v in body.items() if v is not ...}


def message(**fields) -> dict:
    """A chat request whose one message has `fields` changed."""
    m = {"role": "user", "content": "hi", **fields}
    return chat(messages=[{k: v for k, v in m.items() if v is not ...}])


def score(**fields) -> dict:
    body = {"model": "tiny", "input": "hello", **fields}
    return {k: v for k, v in body.items() if v is not ...}


def raw(body: dict, **raw_fields: str) -> bytes:
    """`body` as JSON with fields spliced in as raw JSON text (NaN, 1e400, a lone-surrogate escape...)."""
    text = json.dumps(body)
    return (text[:-1] + "".join(f', "{k}": {v}' for k, v in raw_fields.items()) + "}").encode()


def exactly(n: int) -> bytes:
    """A completion request body of exactly n bytes (its prompt fills the rest)."""
    head = json.dumps(cmpl(prompt="")).encode()
    body = json.dumps(cmpl(prompt="x" * (n - len(head)))).encode()
    assert len(body) == n
    return body


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str
    body: Any  # bytes: sent as they are; None: no body; anything else: sent as JSON
    status: int
    code: str
    param: str | None = None
    limit: Any = None  # None: the error must have no "limit"
    headers: dict = field(default_factory=dict)  # request headers over the defaults; a None value removes one
    server: str = "live"  # "live" (default limits) or "guarded" (bearer token, small body limit)
    send: str = "httpx"  # "httpx"; "chunked": the body in chunks, no Content-Length; "raw": a socket, headers as given
    expect_headers: dict = field(default_factory=dict)  # response headers that must be there


def C(id, method, path, body, status, code, param=None, limit=None, **kw) -> pytest.param:
    return pytest.param(Case(id, method, path, body, status, code, param, limit, **kw), id=id)


def bad(id, path, body, param, limit=None, **kw) -> pytest.param:
    """The common row: a POST refused with 422 invalid_value."""
    return C(id, "POST", path, body, 422, "invalid_value", param, limit, **kw)


NO_TOKEN = {"authorization": None}
UNAUTHORIZED = {"expect_headers": {"www-authenticate": "Bearer"}}

CASES = [
    # ---- not JSON: 400 invalid_json ---------------------------------------------------------------
    C("json-truncated", "POST", CMPL, b'{"model": "tiny", "prompt": "hi"', 400, "invalid_json", "body"),
    C("json-trailing-garbage", "POST", CMPL, b'{"model": "tiny", "prompt": "hi"} xx', 400, "invalid_json", "body"),
    C("json-empty-body", "POST", CMPL, b"", 400, "invalid_json", "body"),
    C("json-whitespace-body", "POST", CMPL, b" \n\t", 400, "invalid_json", "body"),
    C("json-single-quotes", "POST", CMPL, b"{'model': 'tiny', 'prompt': 'hi'}", 400, "invalid_json", "body"),
    C("json-not-utf8", "POST", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "invalid_json", "body"),
    C("json-latin1", "POST", CMPL, '{"model": "tiny", "prompt": "café"}'.encode("latin-1"), 400, "invalid_json",
      "body"),
    C("json-nested-100k-deep", "POST", CMPL, b"[" * 100_000, 400, "invalid_json", "body"),
    C("json-int-5000-digits", "POST", CMPL, raw(cmpl(), max_tokens="9" * 5000), 400, "invalid_json", "body"),
    C("score-json-truncated", "POST", SCORE, b'{"model": "tiny", "input": ', 400, "invalid_json", "body"),
    # ---- JSON, but not an object: 422 on the body -------------------------------------------------
    bad("body-array", CMPL, b'[{"model": "tiny", "prompt": "hi"}]', "body"),
    bad("body-bare-string", CMPL, b'"hello"', "body"),
    bad("body-null", CMPL, b"null", "body"),
    bad("body-number", CMPL, b"42", "body"),
    bad("score-body-array", SCORE, b"[]", "body"),
    # ---- wrong types (strict: no "1" for 1, no true for 1, no 5.0 for 5) --------------------------
    bad("prompt-number", CMPL, cmpl(prompt=5), "prompt"),
    bad("prompt-object", CMPL, cmpl(prompt={"text": "hi"}), "prompt"),
    bad("prompt-mixed-list", CMPL, cmpl(prompt=["a", 1]), "prompt"),
    bad("prompt-ids-and-text", CMPL, cmpl(prompt=[[1, 2], "a"]), "prompt"),
    bad("prompt-bool", CMPL, cmpl(prompt=True), "prompt"),
    bad("prompt-bool-ids", CMPL, cmpl(prompt=[True, False]), "prompt"),
    bad("prompt-null", CMPL, cmpl(prompt=None), "prompt"),
    bad("model-number", CMPL, cmpl(model=1), "model"),
    bad("max_tokens-string", CMPL, cmpl(max_tokens="5"), "max_tokens"),
    bad("max_tokens-float", CMPL, cmpl(max_tokens=5.0), "max_tokens"),
    bad("max_tokens-bool", CMPL, cmpl(max_tokens=True), "max_tokens"),
    bad("max_tokens-exponent", CMPL, raw(cmpl(), max_tokens="1e3"), "max_tokens"),
    bad("temperature-string", CMPL, cmpl(temperature="0.5"), "temperature"),
    bad("top_p-string", CMPL, cmpl(top_p="0.9"), "top_p"),
    bad("stream-yes", CMPL, cmpl(stream="yes"), "stream"),
    bad("stream-one", CMPL, cmpl(stream=1), "stream"),
    bad("stop-number", CMPL, cmpl(stop=5), "stop"),
    bad("stop-list-of-numbers", CMPL, cmpl(stop=[1, 2]), "stop"),
    bad("seed-string", CMPL, cmpl(seed="1"), "seed"),
    bad("stream_options-number", CMPL, cmpl(stream=True, stream_options=5), "stream_options"),
    bad("stream_options-include_usage-int", CMPL, cmpl(stream=True, stream_options={"include_usage": 1}),
        "stream_options.include_usage"),
    bad("score-input-ids", SCORE, score(input=[1, 2]), "input"),
    bad("score-input-number", SCORE, score(input=3), "input"),
    # ---- missing and unknown fields ---------------------------------------------------------------
    bad("missing-model", CMPL, cmpl(model=...), "model"),
    bad("missing-prompt", CMPL, cmpl(prompt=...), "prompt"),
    bad("empty-object", CMPL, {}, "model"),
    bad("score-missing-input", SCORE, score(input=...), "input"),
    bad("score-missing-model", SCORE, score(model=...), "model"),
    bad("unknown-field", CMPL, cmpl(foo=1), "foo"),
    bad("unknown-field-named-body", CMPL, cmpl(body="x"), "body"),
    bad("unknown-field-in-stream_options", CMPL, cmpl(stream=True, stream_options={"include_usage": True, "x": 1}),
        "stream_options.x"),
    bad("score-unknown-field", SCORE, score(max_tokens=5), "max_tokens"),
    # ---- prompts the model cannot take ------------------------------------------------------------
    bad("prompt-empty", CMPL, cmpl(prompt=""), "prompt"),
    bad("prompt-empty-list", CMPL, cmpl(prompt=[]), "prompt"),
    bad("prompt-list-with-empty", CMPL, cmpl(prompt=["a", ""]), "prompt"),
    bad("prompt-ids-empty-row", CMPL, cmpl(prompt=[[1, 2], []]), "prompt"),
    bad("prompt-33-prompts", CMPL, cmpl(prompt=["a"] * (MAX_INPUTS + 1)), "prompt", MAX_INPUTS),
    bad("prompt-over-context", CMPL, cmpl(prompt="x" * 200), "prompt", CTX - 1),
    bad("prompt-one-token-over", CMPL, cmpl(prompt="x" * (CTX - 1)), "prompt", CTX - 1),  # leaves no room
    bad("prompt-ids-over-context", CMPL, cmpl(prompt=[65] * CTX), "prompt", CTX - 1),
    bad("prompt-id-out-of-vocab", CMPL, cmpl(prompt=[1, VOCAB]), "prompt", VOCAB - 1),
    bad("prompt-id-negative", CMPL, cmpl(prompt=[1, -1]), "prompt", VOCAB - 1),
    bad("prompt-lone-surrogate", CMPL, raw(cmpl(prompt=...), prompt='"a\\ud800b"'), "prompt"),
    bad("prompt-list-lone-surrogate", CMPL, raw(cmpl(prompt=...), prompt='["ok", "\\udc00"]'), "prompt"),
    bad("stop-lone-surrogate", CMPL, raw(cmpl(stop=...), stop='"\\ud800"'), "stop"),
    # ---- max_tokens -------------------------------------------------------------------------------
    bad("max_tokens-negative", CMPL, cmpl(max_tokens=-1), "max_tokens", 0),
    bad("max_tokens-1e12", CMPL, cmpl(max_tokens=10**12), "max_tokens", CTX - n_tokens("hi")),
    bad("max_tokens-past-context", CMPL, cmpl(prompt="abcd", max_tokens=60), "max_tokens", CTX - n_tokens("abcd")),
    bad("max_tokens-2-after-63-tokens", CMPL, cmpl(prompt="x" * (CTX - 2), max_tokens=2), "max_tokens", 1),
    bad("max_tokens-longest-prompt-decides", CMPL, cmpl(prompt=["a", "x" * 40], max_tokens=30), "max_tokens",
        CTX - n_tokens("x" * 40)),
    # ---- sampling ---------------------------------------------------------------------------------
    bad("temperature-negative", CMPL, cmpl(temperature=-0.1), "temperature", 0),
    bad("temperature-over-2", CMPL, cmpl(temperature=2.5), "temperature", 2),
    bad("temperature-NaN", CMPL, raw(cmpl(), temperature="NaN"), "temperature"),
    bad("temperature-Infinity", CMPL, raw(cmpl(), temperature="Infinity"), "temperature"),
    bad("temperature-minus-Infinity", CMPL, raw(cmpl(), temperature="-Infinity"), "temperature"),
    bad("temperature-1e400", CMPL, raw(cmpl(), temperature="1e400"), "temperature"),
    bad("top_p-0", CMPL, cmpl(top_p=0), "top_p", 0),
    bad("top_p-1.5", CMPL, cmpl(top_p=1.5), "top_p", 1),
    bad("top_p-NaN", CMPL, raw(cmpl(), top_p="NaN"), "top_p"),
    bad("top_k-0", CMPL, cmpl(top_k=0), "top_k", 1),
    # ---- choices and log-probabilities -------------------------------------------------------------
    bad("n-0", CMPL, cmpl(n=0), "n", 1),
    bad("n-129", CMPL, cmpl(n=129), "n", 128),
    bad("n-string", CMPL, cmpl(n="2"), "n"),
    bad("n-times-prompts-over-max-inputs", CMPL, cmpl(prompt=["a"] * 8, n=5), "n", MAX_INPUTS),
    bad("best_of-times-prompts-over-max-inputs", CMPL, cmpl(prompt=["a"] * 2, n=2, best_of=17), "best_of",
        MAX_INPUTS),
    bad("best_of-less-than-n", CMPL, cmpl(n=3, best_of=2), "best_of", 3),
    bad("best_of-0", CMPL, cmpl(best_of=0), "best_of", 1),
    bad("best_of-streamed", CMPL, cmpl(n=1, best_of=2, stream=True), "best_of"),
    bad("echo-string", CMPL, cmpl(echo="yes"), "echo"),
    bad("echo-streamed", CMPL, cmpl(echo=True, stream=True), "echo"),
    bad("logprobs-21", CMPL, cmpl(logprobs=21), "logprobs", 20),
    bad("logprobs-negative", CMPL, cmpl(logprobs=-1), "logprobs", 0),
    bad("logprobs-true", CMPL, cmpl(logprobs=True), "logprobs"),
    bad("logprobs-float", CMPL, cmpl(logprobs=1.0), "logprobs"),
    bad("ignore_eos-string", CMPL, cmpl(ignore_eos="true"), "ignore_eos"),
    bad("chat-ignore_eos-int", CHAT, chat(ignore_eos=1), "ignore_eos"),
    bad("presence_penalty", CMPL, cmpl(presence_penalty=0.5), "presence_penalty", 0),
    bad("frequency_penalty", CMPL, cmpl(frequency_penalty=-0.5), "frequency_penalty", 0),
    bad("logit_bias", CMPL, cmpl(logit_bias={"1": 1.0}), "logit_bias", 0),
    bad("suffix", CMPL, cmpl(suffix="x"), "suffix"),
    bad("user-too-long", CMPL, cmpl(user="u" * 257), "user", 256),
    bad("stop-5-strings", CMPL, cmpl(stop=["a", "b", "c", "d", "e"]), "stop", 4),
    bad("stop-empty-string", CMPL, cmpl(stop=""), "stop"),
    bad("stop-list-with-empty", CMPL, cmpl(stop=["a", ""]), "stop"),
    bad("seed-negative", CMPL, cmpl(seed=-1), "seed", 0),
    bad("seed-over-int64", CMPL, cmpl(seed=MAX_SEED + 1), "seed", MAX_SEED),
    # ---- models -----------------------------------------------------------------------------------
    C("model-unknown", "POST", CMPL, cmpl(model="gpt-4"), 404, "model_not_found", "model"),
    C("model-empty", "POST", CMPL, cmpl(model=""), 404, "model_not_found", "model"),
    C("score-model-unknown", "POST", SCORE, score(model="nope"), 404, "model_not_found", "model"),
    bad("classify-on-a-language-model", CLASSIFY, {"model": "tiny", "input": "hello"}, "model"),
    bad("classify-list-on-a-language-model", CLASSIFY, {"model": "tiny", "input": ["a", "b"]}, "model"),
    # ---- score inputs -----------------------------------------------------------------------------
    bad("score-input-empty", SCORE, score(input=""), "input"),
    bad("score-input-empty-list", SCORE, score(input=[]), "input"),
    bad("score-input-list-with-empty", SCORE, score(input=["a", ""]), "input"),
    bad("score-stride-zero", SCORE, score(input="x" * 200, stride=0), "stride", 1),
    bad("score-stride-the-context", SCORE, score(input="x" * 200, stride=CTX), "stride", CTX - 1),
    bad("score-stride-string", SCORE, score(stride="8"), "stride"),
    bad("score-stride-float", SCORE, score(stride=2.5), "stride"),
    bad("score-33-inputs", SCORE, score(input=["a"] * (MAX_INPUTS + 1)), "input", MAX_INPUTS),
    bad("score-input-lone-surrogate", SCORE, raw(score(input=...), input='"a\\udc00b"'), "input"),
    # ---- chat -------------------------------------------------------------------------------------
    bad("chat-missing-messages", CHAT, chat(messages=...), "messages"),
    bad("chat-messages-empty", CHAT, chat(messages=[]), "messages", 1),
    bad("chat-messages-string", CHAT, chat(messages="hi"), "messages"),
    bad("chat-message-not-object", CHAT, chat(messages=["hi"]), "messages"),
    bad("chat-role-unknown", CHAT, message(role="wizard"), "messages[0].role"),
    bad("chat-role-missing", CHAT, message(role=...), "messages[0].role"),
    bad("chat-role-tool", CHAT, message(role="tool"), "messages[0].role"),
    bad("chat-content-missing", CHAT, message(content=...), "messages[0].content"),
    bad("chat-content-null", CHAT, message(content=None), "messages[0].content"),
    bad("chat-content-number", CHAT, message(content=5), "messages[0].content"),
    bad("chat-content-image-part", CHAT, message(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
        "messages[0].content"),
    bad("chat-content-part-without-text", CHAT, message(content=[{"type": "text"}]), "messages[0].content"),
    bad("chat-message-unknown-field", CHAT, message(tool_calls=[]), "messages[0].tool_calls"),
    bad("chat-second-message-bad", CHAT, chat(messages=[{"role": "user", "content": "a"}, {"role": "x"}]),
        "messages[1].role"),
    bad("chat-content-lone-surrogate", CHAT, raw(chat(messages=...), messages='[{"role": "user", "content": '
                                                 '"\\ud800"}]'), "messages[0].content"),
    bad("chat-logprobs-int", CHAT, chat(logprobs=1), "logprobs"),
    bad("chat-top_logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", 20),
    bad("chat-top_logprobs-without-logprobs", CHAT, chat(top_logprobs=2), "top_logprobs"),
    bad("chat-max_completion_tokens-negative", CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", 0),
    bad("chat-max_completion_tokens-past-context", CHAT, chat(max_completion_tokens=1000), "max_completion_tokens",
        CTX - len("<user>hi\n<assistant>") - 1),
    bad("chat-max_tokens-past-context", CHAT, chat(max_tokens=1000), "max_tokens", CTX - len("<user>hi\n<assistant>") - 1),
    bad("chat-conversation-over-context", CHAT, message(content="x" * 100), "messages", CTX - 1),
    bad("chat-n-0", CHAT, chat(n=0), "n", 1),
    bad("chat-best_of", CHAT, chat(best_of=2), "best_of"),
    bad("chat-unknown-field-tools", CHAT, chat(tools=[]), "tools"),
    bad("chat-stream_options-unknown", CHAT, chat(stream=True, stream_options={"x": 1}), "stream_options.x"),
    C("chat-model-unknown", "POST", CHAT, chat(model="gpt-4"), 404, "model_not_found", "model"),
    C("chat-no-template", "POST", CHAT, chat(), 400, "no_chat_template", "messages", server="guarded"),
    # ---- content type: 415 before any parsing -----------------------------------------------------
    C("content-type-text-plain", "POST", CMPL, json.dumps(cmpl()).encode(), 415, "unsupported_media_type",
      "Content-Type", headers={"content-type": "text/plain"}),
    C("content-type-none", "POST", CMPL, json.dumps(cmpl()).encode(), 415, "unsupported_media_type",
      "Content-Type", headers={"content-type": None}),
    C("content-type-multipart", "POST", CMPL, b"--x\r\n\r\n--x--\r\n", 415, "unsupported_media_type",
      "Content-Type", headers={"content-type": "multipart/form-data; boundary=x"}),
    C("content-type-form", "POST", SCORE, b"model=tiny&input=hi", 415, "unsupported_media_type", "Content-Type",
      headers={"content-type": "application/x-www-form-urlencoded"}),
    C("content-type-json-lookalike", "POST", CLASSIFY, b"{}", 415, "unsupported_media_type", "Content-Type",
      headers={"content-type": "application/jsonx"}),
    # ---- methods and paths ------------------------------------------------------------------------
    C("GET-completions", "GET", CMPL, None, 405, "method_not_allowed", expect_headers={"allow": "POST"}),
    C("DELETE-models", "DELETE", MODELS, None, 405, "method_not_allowed", expect_headers={"allow": "GET"}),
    C("PUT-score", "PUT", SCORE, score(), 405, "method_not_allowed", expect_headers={"allow": "POST"}),
    C("POST-healthz", "POST", "/healthz", {}, 405, "method_not_allowed", expect_headers={"allow": "GET"}),
    C("GET-chat", "GET", CHAT, None, 405, "method_not_allowed", expect_headers={"allow": "POST"}),
    C("GET-unknown-path", "GET", "/v1/chat", None, 404, "not_found"),
    C("POST-unknown-path", "POST", "/v1/engines", cmpl(), 404, "not_found"),
    C("GET-root", "GET", "/", None, 404, "not_found"),
    # ---- body size: 413 before the body is parsed -------------------------------------------------
    C("body-over-limit", "POST", CMPL, cmpl(prompt="x" * 4000), 413, "body_too_large", "body", GUARDED_BODY_LIMIT,
      server="guarded"),
    C("body-over-limit-chunked", "POST", CMPL, cmpl(prompt="x" * 4000), 413, "body_too_large", "body",
      GUARDED_BODY_LIMIT, server="guarded", send="chunked"),
    C("body-at-limit-is-parsed", "POST", CMPL, exactly(GUARDED_BODY_LIMIT), 422, "invalid_value", "prompt", CTX - 1,
      server="guarded"),  # not 413: the limit is inclusive; the prompt is then too long for the context
    C("content-length-over-limit", "POST", CMPL, json.dumps(cmpl()).encode(), 413, "body_too_large", "body",
      DEFAULT_BODY_LIMIT, headers={"content-length": str(2 * DEFAULT_BODY_LIMIT)}, send="raw"),
    C("content-length-over-limit-score", "POST", SCORE, json.dumps(score()).encode(), 413, "body_too_large", "body",
      GUARDED_BODY_LIMIT, headers={"content-length": str(GUARDED_BODY_LIMIT + 1)}, server="guarded", send="raw"),
    # ---- bearer token: 401 before anything else ---------------------------------------------------
    C("token-missing", "POST", CMPL, cmpl(), 401, "unauthorized", headers=NO_TOKEN, server="guarded", **UNAUTHORIZED),
    C("token-wrong", "POST", CMPL, cmpl(), 401, "unauthorized", headers={"authorization": "Bearer nope"},
      server="guarded", **UNAUTHORIZED),
    C("token-wrong-scheme", "POST", SCORE, score(), 401, "unauthorized", headers={"authorization": "Basic c2VjcmV0"},
      server="guarded", **UNAUTHORIZED),
    C("token-without-scheme", "POST", CMPL, cmpl(), 401, "unauthorized", headers={"authorization": TOKEN},
      server="guarded", **UNAUTHORIZED),
    C("token-prefix-only", "POST", CMPL, cmpl(), 401, "unauthorized", headers={"authorization": f"Bearer {TOKEN}x"},
      server="guarded", **UNAUTHORIZED),
    C("token-missing-models", "GET", MODELS, None, 401, "unauthorized", headers=NO_TOKEN, server="guarded",
      **UNAUTHORIZED),
    C("token-missing-before-415", "POST", CMPL, b"x", 401, "unauthorized",
      headers={**NO_TOKEN, "content-type": "text/plain"}, server="guarded", **UNAUTHORIZED),
    C("token-missing-before-413", "POST", CMPL, cmpl(prompt="x" * 4000), 401, "unauthorized", headers=NO_TOKEN,
      server="guarded", **UNAUTHORIZED),
]


# ---- servers and transports --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tiny_ckpt) -> Iterator[Live]:
    """A second server: bearer token required on /v1/*, bodies over GUARDED_BODY_LIMIT refused."""
    cfg = ServeConfig(model_name="tiny", api_key=TOKEN, max_body_bytes=GUARDED_BODY_LIMIT)
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        yield s


def request_headers(case: Case) -> dict[str, str]:
    headers = {"content-type": JSON} if case.body is not None else {}
    if case.server == "guarded":
        headers["authorization"] = f"Bearer {TOKEN}"
    headers.update(case.headers)
    return {k: v for k, v in headers.items() if v is not None}


def send(server: Live, case: Case) -> httpx.Response:
    body = case.body if isinstance(case.body, bytes) or case.body is None else json.dumps(case.body).encode()
    headers = request_headers(case)
    if case.send == "raw":
        return send_raw(server.url, case.method, case.path, headers, body or b"")
    if case.send == "chunked":
        content = iter([body[i:i + 512] for i in range(0, len(body), 512)])  # an iterator: Transfer-Encoding chunked
    else:
        content = body
    with httpx.Client(base_url=server.url, timeout=30) as client:  # a fresh connection per case
        return client.request(case.method, case.path, content=content, headers=headers)


def send_raw(url: str, method: str, path: str, headers: dict[str, str], body: bytes) -> httpx.Response:
    """HTTP/1.1 over a plain socket, headers exactly as given (httpx will not send a Content-Length that
    disagrees with the body); the connection closes after the answer."""
    u = urlsplit(url)
    head = f"{method} {path} HTTP/1.1\r\nHost: {u.netloc}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    data = b""
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(head.encode("latin-1") + body)
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:  # the server may drop the unread rest of the body; the answer came first
            pass
    status_and_headers, _, content = data.partition(b"\r\n\r\n")
    status_line, *header_lines = status_and_headers.decode("latin-1").split("\r\n")
    return httpx.Response(int(status_line.split()[1]), headers=[tuple(h.split(": ", 1)) for h in header_lines],
                          content=content)


# ---- the matrix ------------------------------------------------------------------------------------
def test_matrix_is_big_enough():
    assert len(CASES) >= 45
    assert len({p.id for p in CASES}) == len(CASES), "duplicate case ids"


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case: Case, request):
    server: Live = request.getfixturevalue(case.server)
    assert_answer(send(server, case), case)


def assert_answer(r: httpx.Response, case: Case) -> None:
    """The case's status, error code, param and limit, as JSON; never a 5xx."""
    assert r.status_code < 500, f"{case.id}: a server error: {r.status_code} {r.text}"
    assert STATUS[case.code] == case.status, "the table disagrees with protocol.STATUS"
    assert r.status_code == case.status, f"{case.id}: {r.status_code} {r.text}"
    assert r.headers.get("content-type", "").startswith(JSON), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert err["code"] == case.code, err
    assert err["type"] == error_type(case.status), err
    assert err["param"] == case.param, err
    if case.param is not None:
        assert case.param in err["message"], f"the message does not name {case.param!r}: {err['message']!r}"
    if case.limit is None:
        assert "limit" not in err, err
    else:
        assert err["limit"] == case.limit and type(err["limit"]) is not bool, err
    for name, value in case.expect_headers.items():
        assert r.headers.get(name) == value, (name, r.headers)


# ---- edges the server must serve -----------------------------------------------------------------
def test_limits_above_are_the_served_models(live):
    """CTX, VOCAB and the token counts in the table are the tiny model's, not guesses."""
    assert live.engine.cfg.max_seq_len == CTX
    assert live.engine.cfg.vocab_size == live.engine.tokenizer.vocab_size == VOCAB
    assert len(live.engine.tokenizer.encode("abcd", bos=True)) == n_tokens("abcd") == 5
    card = live.client.get(MODELS).json()["data"][0]
    assert (card["id"], card["max_model_len"]) == ("tiny", CTX)


def test_single_character_score(live):
    """One character is <bos> + one byte: one token scored, conditioned on <bos>. Served, not refused."""
    r = live.post(SCORE, {"model": "tiny", "input": "x"})
    assert r.status_code == 200, r.text
    item, usage = r.json()["data"][0], r.json()["usage"]
    assert item["n_tokens"] == 1 and usage["prompt_tokens"] == usage["total_tokens"] == 2
    assert math.isfinite(item["logprob"]) and item["logprob"] < 0
    assert item["perplexity"] == pytest.approx(math.exp(-item["logprob"]))
    assert item["bits_per_byte"] == pytest.approx(-item["logprob"] / math.log(2))


EDGES = [  # valid requests at the edges of the schema; some once failed with 500 in the sampler
    pytest.param(raw(cmpl(max_tokens=4), temperature="1e-300"), id="temperature-1e-300"),
    pytest.param(raw(cmpl(max_tokens=4, stream=True), temperature="5e-324"), id="temperature-5e-324-stream"),
    pytest.param(raw(cmpl(max_tokens=4), top_p="5e-324"), id="top_p-5e-324"),
    pytest.param(raw(cmpl(max_tokens=4, temperature=2.0, top_k=1), top_p="1e-45"), id="top_p-1e-45-top_k-1"),
    pytest.param(json.dumps(cmpl(max_tokens=4, seed=MAX_SEED, top_k=10**9, temperature=2.0)).encode(),
                 id="seed-max-top_k-huge"),
    pytest.param(json.dumps(cmpl(prompt="x" * (CTX - 2), max_tokens=1)).encode(), id="prompt-fills-context"),
    pytest.param(json.dumps(cmpl(prompt="abcd", max_tokens=CTX - n_tokens("abcd"), temperature=0)).encode(),
                 id="max_tokens-at-limit"),
    pytest.param(json.dumps(cmpl(prompt=[256], max_tokens=2)).encode(), id="prompt-bos-only"),
    pytest.param(json.dumps(cmpl(stream=True, stream_options=None, max_tokens=2)).encode(), id="stream_options-null"),
]


@pytest.mark.parametrize("body", EDGES)
def test_edge_values_are_served(live, body: bytes):
    r = live.client.post(CMPL, content=body, headers={"content-type": JSON})
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_score_input_filling_the_context_or_past_it_is_served(live):
    r = live.post(SCORE, {"model": "tiny", "input": ["x" * (CTX - 1), "x" * CTX]})  # <bos> + 63 bytes = 64 tokens
    assert r.status_code == 200, r.text
    assert [(d["n_tokens"], d["windows"]) for d in r.json()["data"]] == [(CTX - 1, 1), (CTX, 2)]


def test_valid_token_is_accepted(guarded):
    ok = {"authorization": f"Bearer {TOKEN}"}
    r = guarded.client.post(CMPL, json=cmpl(max_tokens=3), headers=ok)
    assert r.status_code == 200, r.text
    assert guarded.client.get(MODELS, headers=ok).status_code == 200
    assert guarded.client.get("/healthz").status_code == 200  # outside /v1/: no token needed


# ---- after the matrix: both servers still serve, and none of it was a 5xx ------------------------
def server_errors(server: Live) -> list[str]:
    lines = server.client.get("/metrics").text.splitlines()
    counted = [line for line in lines if line.startswith("moeserve_requests_total{")]
    assert counted, "no requests counted"
    return [line for line in counted if 'status="5' in line]


def test_servers_are_fine_after_the_matrix(live, guarded):
    r = live.post(CMPL, cmpl(prompt="after the matrix", max_tokens=5))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 5
    r = guarded.client.post(CMPL, json=cmpl(max_tokens=5), headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    assert server_errors(live) == []
    assert server_errors(guarded) == []
