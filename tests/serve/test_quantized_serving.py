"""A quantized model served over a real socket: concurrent completions join the running decode steps (continuous
batching) and each gets the tokens it gets alone; scores match the engine's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.serve.config import ServeConfig

from .conftest import live_server


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_model_serves_with_continuous_batching(tiny_ckpt, fmt):
    engine = Engine.load(tiny_ckpt, dtype="float32", device="cpu", quantize=fmt)
    prompts = ["def f(", "import os\n", "class Tree:\n    def", "x = [1, 2"]
    want = [c.text for c in engine.complete(prompts, SamplingParams(16, ignore_eos=True))]
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu", quantize=fmt),
                     ServeConfig(model_name="tiny", kv_slots=4)) as s:
        assert s.engine.cfg.quantization is not None
        body = lambda p: {"model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: s.post("/v1/completions", body(p)), prompts))
        assert [r.status_code for r in answers] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in answers] == want
        r = s.post("/v1/score", {"model": "tiny", "input": ["some text to score"]})
        assert r.status_code == 200
        assert r.json()["data"][0]["logprob"] == pytest.approx(engine.score(["some text to score"])[0].logprob,
                                                                rel=1e-5)
