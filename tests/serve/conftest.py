"""Real servers on loopback ports: uvicorn in a thread (port 0, the OS picks), talked to over sockets."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch
import uvicorn

from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.engine import Engine
from moeserve.runtime.model import Transformer
from moeserve.serve.app import ServeConfig, create_app


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """Also leaves the other core to the server's event loop."""


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))  # random weights: context 64, byte tokenizer, 2 MoE layers
    return save_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", model.cfg, model.state_dict())


class Live:
    """A running server: its base URL, its app state, and an httpx client bound to it."""

    def __init__(self, server: uvicorn.Server, app):
        self.server, self.app, self.state = server, app, app.state.serve
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def engine(self) -> Engine:
        return self.state.engine

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return self.client.post(path, json=body, **kw)

    def openai(self):
        """The openai client on this server (tests that use it importorskip openai first)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


class HeldStep:
    """The model thread's next step of continuous batching (the step engine running the scheduler's plan), held
    until `release()`. While it is held, the request in the step keeps its cache slot and nothing leaves the queue,
    so a test fills the queue without racing the model thread (on a slow or busy CPU, a sleep does not mean "the
    first request holds the slot by now")."""

    def __init__(self, batcher):
        self.stepping, self._released = threading.Event(), threading.Event()
        execute = batcher.steps.execute

        def held(plan):
            self.stepping.set()
            assert self._released.wait(60), "the test never released the held step"
            return execute(plan)

        batcher.steps.execute = held

    def wait(self) -> None:
        """Until the model thread is inside the held step."""
        assert self.stepping.wait(60), "no step started within 60 s"

    def release(self) -> None:
        self._released.set()


def wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Poll `predicate` until it holds: the event a test means, rather than a sleep that stands for it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def live_server(source, cfg: ServeConfig | None = None, ready: bool = True) -> Iterator[Live]:
    app = create_app(source, cfg or ServeConfig())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    live = Live(server, app)
    try:
        while ready and not live.state.ready:
            assert live.state.load_error is None, live.state.load_error
            assert time.monotonic() < deadline, "the model did not become ready"
            time.sleep(0.01)
        yield live
    finally:
        live.client.close()
        server.should_exit = True
        thread.join(30)


# A chat template for the tiny byte-tokenizer model, which has none of its own: roles in angle brackets.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "tiny.jinja"
    path.write_text(TINY_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def live(tiny_ckpt, tiny_chat_template) -> Iterator[Live]:
    """One shared server on the tiny checkpoint, fp32 on the CPU, default limits, a chat template given."""
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"),
                     ServeConfig(model_name="tiny", chat_template=tiny_chat_template)) as s:
        yield s
