"""Whose fault an error is decides its status, over a real socket: a UserError (the caller asked for what cannot
be done) is a 422 with its message; a bare ValueError is a bug in the server, a 500 that is logged, never blamed
on the caller. Both where a handler raises it (encoding the input) and where the model's thread does."""

from __future__ import annotations

import logging

import httpx
import pytest

from moeserve.errors import MoeServeError, UserError
from moeserve.runtime.engine import Engine, EngineError
from moeserve.serve.batcher import BatchConfig
from moeserve.serve.state import ServeConfig

from .conftest import live_server


class Tokenizer:
    """The model's tokenizer, failing on two texts as the handler encodes them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, bos: bool = False) -> list[int]:
        if text == "tok-user":
            raise UserError("tok-user is refused")
        if text == "tok-bug":
            raise ValueError("tok-bug broke the tokenizer")
        return self.tokenizer.encode(text, bos=bos)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class FailingRunner:
    """The engine's runner, failing, on the model's thread, a prompt that reads "run-user" or "run-bug"."""

    def __init__(self, runner, tokenizer):
        self.runner, self.tokenizer = runner, tokenizer

    def _check(self, rows) -> None:
        texts = {self.tokenizer.decode([int(t) for t in r]) for r in rows}
        if any("run-user" in t for t in texts):
            raise EngineError("run-user cannot be served")
        if any("run-bug" in t for t in texts):
            raise ValueError("run-bug broke the model")

    def prefill(self, cache, slot, ids_S, start, all_logits=False):
        self._check([ids_S.tolist()])
        return self.runner.prefill(cache, slot, ids_S, start, all_logits)

    def step_rows(self, cache, slots, ids, starts):
        self._check(ids)
        return self.runner.step_rows(cache, slots, ids, starts)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def _load(ckpt) -> Engine:
    engine = Engine.load(ckpt, dtype="float32", device="cpu")
    engine.runner = FailingRunner(engine.runner, engine.tokenizer)
    engine.tokenizer = Tokenizer(engine.tokenizer)
    return engine


@pytest.fixture(scope="module")
def failing(tiny_ckpt):
    cfg = ServeConfig(model_name="tiny", batch=BatchConfig(wait_s=0.0), scheduler="batch")
    with live_server(lambda: _load(tiny_ckpt), cfg) as s:
        yield s


def test_project_errors_share_one_base():
    assert issubclass(EngineError, UserError) and issubclass(UserError, MoeServeError)
    assert issubclass(UserError, ValueError)  # what `except ValueError` caught before still is caught
    assert not issubclass(ValueError, UserError)


@pytest.mark.parametrize("path, field, text", [("/v1/score", "input", "tok-user"),
                                               ("/v1/completions", "prompt", "run-user")])
def test_a_user_error_is_a_422_with_its_message(failing, path, field, text):
    body = {"model": "tiny", field: text, "max_tokens": 2} if field == "prompt" else {"model": "tiny", field: text}
    r = failing.post(path, body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and err["type"] == "invalid_request_error"
    assert err["message"] == ("tok-user is refused" if text == "tok-user" else "run-user cannot be served")


@pytest.mark.parametrize("path, field, text", [("/v1/score", "input", "tok-bug"),
                                               ("/v1/completions", "prompt", "run-bug")])
def test_a_bare_value_error_is_a_logged_500(failing, caplog, path, field, text):
    body = {"model": "tiny", field: text, "max_tokens": 2} if field == "prompt" else {"model": "tiny", field: text}
    with caplog.at_level(logging.ERROR, logger="moeserve.serve"):
        # a connection of its own: Starlette re-raises a handler's crash after its 500, and uvicorn then closes it
        r = httpx.post(failing.url + path, json=body, timeout=30)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "internal_error" and err["type"] == "server_error"
    assert "ValueError" in err["message"] and "broke" not in err["message"]  # the bug's text stays in the log
    logged = [rec for rec in caplog.records if rec.exc_info and isinstance(rec.exc_info[1], ValueError)]
    assert logged and "broke" in str(logged[0].exc_info[1])


def test_the_server_still_serves_after_both(failing):
    r = failing.post("/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
