"""ONNX Runtime's CUDA provider behind the Engine: the fused export's scores and greedy tokens equal the torch
Engine's on the CPU, and a KV-cache export decodes every sequence in one session call with its cache on the GPU.
Run by `pytest -m cuda` (and `moeserve bench gpu`); skipped, naming why, where this onnxruntime has no CUDA
provider (onnxruntime-gpu has it)."""

from __future__ import annotations

import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.export.onnx_export import export_onnx
from moeserve.runtime.engine import Engine, SamplingParams, load_engine
from moeserve.runtime.steps import Sequence
from moeserve.runtime.model import Transformer

TEXTS = ["import os\nprint(os.getcwd())", "x", "def f(a, b):\n    return a + b\n"]


def require_cuda_provider():
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDA provider (has "
                    f"{', '.join(ort.get_available_providers())}); onnxruntime-gpu has it")


@pytest.mark.cuda
def test_onnxruntime_on_cuda_equals_the_torch_engine(tmp_path):
    require_cuda_provider()
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe", init_std=0.1))  # logits spread: no near-tie greedy choices
    ckpt = save_checkpoint(tmp_path / "xmoe", model.cfg, model.state_dict())
    onnx_path = export_onnx(ckpt, tmp_path / "xmoe.onnx", "fused").output
    ref, got = Engine.load(ckpt, dtype="float32", device="cpu"), load_engine(onnx_path, device="cuda")
    for a, b in zip(got.score(TEXTS), ref.score(TEXTS)):
        assert a.n_tokens == b.n_tokens and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    prompts = ["def ", "import numpy as np\n", "x"]
    assert got.generate(prompts, max_new_tokens=12) == ref.generate(prompts, max_new_tokens=12)


@pytest.mark.cuda
def test_a_kv_cache_export_decodes_on_the_gpu_in_one_call_a_step(tmp_path):
    require_cuda_provider()
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax", init_std=0.1))
    ckpt = save_checkpoint(tmp_path / "softmax", model.cfg, model.state_dict())
    onnx_path = export_onnx(ckpt, tmp_path / "kv.onnx", "fused", kv_cache=True).output
    ref, got = Engine.load(ckpt, dtype="float32", device="cpu"), load_engine(onnx_path, device="cuda")
    assert got.runner.device.type == "cuda"
    prompts = ["def ", "import numpy as np\n", "x"]
    steps = got.step_engine(slots=3)
    seqs = [Sequence(got.encode(p), SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    for seq in seqs:
        steps.add(seq)
    while not steps.idle:
        steps.step()
        rows = steps.cache.rows
        assert rows is None or all(p.is_cuda for p in rows.past)  # the cache never leaves the GPU
    want = [c.token_ids for c in ref.complete(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    assert [s.out for s in seqs] == want
    assert got.runner.session_calls == steps.model_calls  # 3 prompts, then one call a step for all three
