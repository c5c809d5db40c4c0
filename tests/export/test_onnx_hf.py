"""A Hugging Face Qwen3-MoE directory (written by transformers itself, tiny and random: per-head QK-norm, a head width
that is not hidden / heads, grouped-query attention, renormalised gates, a dense layer wider than the experts) through
`moeserve export onnx` and ONNX Runtime: the graph's logits, from an empty cache and as a decode step on a cache,
equal transformers' within 1e-4, and moeserve's ONNX backend serves the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
import onnxruntime as ort  # noqa: E402

from moeserve.export.onnx_export import export_onnx  # noqa: E402
from moeserve.runtime.backends.onnx import OnnxBackend, presents_as_past, session_feed  # noqa: E402
from moeserve.runtime.engine import load_engine  # noqa: E402

from ..test_hf_families import hf_model, ids_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4  # fp32


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(transformers' model, its directory)."""
    root = tmp_path_factory.mktemp("qwen3-onnx")
    return hf_model("qwen3_moe", root / "hf"), root / "hf"


@pytest.mark.parametrize("mode", ["portable", "fused"])
def test_qwen3_moe_directory_exports_and_matches_transformers(qwen3, tmp_path, mode):
    hf, directory = qwen3
    report = export_onnx(directory, tmp_path / "m.onnx", mode, kv_cache=True)
    assert report.passed and max(d["max_abs_diff"] for d in report.outputs.values()) <= TOL
    assert [(d["layer"], d["form"], d["fallback"]) for d in report.layers] == [(0, mode, None), (2, mode, None)]

    session = ort.InferenceSession(report.output, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(ids, mask, past=None) -> dict:
        return dict(zip(names, session.run(None, session_feed(session, ids.numpy(), mask.numpy(), past))))

    ids, mask = ids_of((3, 19), 7), torch.ones(3, 19, dtype=torch.long)
    mask[1, 11:], mask[2, 4:] = 0, 0  # right padding: the real positions' logits are compared
    real = mask.bool().numpy()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits.numpy()
        want_full = hf(ids).logits.numpy()
    assert want[real].std() > 0.05  # logits that a wrong norm or head width would move past the tolerance
    np.testing.assert_allclose(run(ids, mask)["logits"][real], want[real], rtol=0, atol=TOL)

    full = torch.ones_like(ids)  # the last token as a decode step on the cache of the 18 before it
    past = presents_as_past(run(ids[:, :-1], full[:, :-1]))
    np.testing.assert_allclose(run(ids[:, -1:], full, past)["logits"][:, -1], want_full[:, -1], rtol=0, atol=TOL)

    engine = load_engine(report.output)  # moeserve's ONNX Runtime backend serves the file
    assert isinstance(engine.runner, OnnxBackend) and engine.runner.kv_cache
    np.testing.assert_allclose(engine.forward(ids, mask).numpy()[real], want[real], rtol=0, atol=TOL)
