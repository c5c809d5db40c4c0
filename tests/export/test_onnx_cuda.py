"""ONNX Runtime's CUDA provider behind the Engine: the fused export's scores and greedy tokens equal the torch
Engine's on the CPU. Run by `pytest -m cuda` (and `moeserve bench gpu`); skipped, naming why, where this
onnxruntime has no CUDA provider (onnxruntime-gpu has it)."""

from __future__ import annotations

import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.export.onnx_export import export_onnx
from moeserve.runtime.engine import Engine, load_engine
from moeserve.runtime.model import Transformer

TEXTS = ["import os\nprint(os.getcwd())", "x", "def f(a, b):\n    return a + b\n"]


@pytest.mark.cuda
def test_onnxruntime_on_cuda_equals_the_torch_engine(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDA provider (has "
                    f"{', '.join(ort.get_available_providers())}); onnxruntime-gpu has it")
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe", init_std=0.1))  # logits spread: no near-tie greedy choices
    ckpt = save_checkpoint(tmp_path / "xmoe", model.cfg, model.state_dict())
    onnx_path = export_onnx(ckpt, tmp_path / "xmoe.onnx", "fused").output
    ref, got = Engine.load(ckpt, dtype="float32", device="cpu"), load_engine(onnx_path, device="cuda")
    for a, b in zip(got.score(TEXTS), ref.score(TEXTS)):
        assert a.n_tokens == b.n_tokens and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    prompts = ["def ", "import numpy as np\n", "x"]
    assert got.generate(prompts, max_new_tokens=12) == ref.generate(prompts, max_new_tokens=12)
