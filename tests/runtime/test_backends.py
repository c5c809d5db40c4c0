"""Every backend this machine has, against the eager reference, as one suite (runtime/backends/): one checkpoint
laid out by each gives the reference's logits on a padded batch, its scores, its greedy tokens for prompts of
different lengths decoded together, and its expert load. fp32 throughout: 1e-4 on logits and log-probabilities,
the same tokens. A backend the machine cannot run is skipped with the reason."""

from __future__ import annotations

import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.compiled import compile_unavailable
from moeserve.runtime.backends.packing import onednn_packing_available
from moeserve.runtime.engine import Engine, SamplingParams, load_engine
from moeserve.runtime.model import Transformer
from moeserve.tokenizer import ByteTokenizer

PROMPTS = ["def f(x):\n    return", "import os", "class A(B):\n    pass\n\nx ="]
KERNEL = DispatchPlan(kernel_experts=True, kernel_dense=True, kernel_norms=True)


def model(router: str) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(preset("tiny", router=router, max_seq_len=96))
    if router == "vq":  # codes from real activations, so tokens spread over several experts
        with torch.no_grad():
            for layer in m.moe_layers:
                layer.quantizer.codebook.normal_()
    return m


def why_not(backend: str) -> str | None:
    """Why this machine cannot run `backend`, or None."""
    if backend == "eager-packed" and not onednn_packing_available("cpu", torch.float32):
        return "no oneDNN packing in this build of torch"
    if backend == "cpu-kernel":
        return cpu_kernel.unavailable_reason()
    if backend == "compiled":
        return compile_unavailable(torch.device("cpu"))
    if backend == "onnx":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return "onnxruntime is not installed"
    return None


def engine(backend: str, router: str, tmp_path) -> Engine:
    tok = ByteTokenizer()
    if backend == "eager-plain":
        return Engine.from_model(model(router), tok, plan=DispatchPlan())
    if backend == "eager-packed":
        return Engine.from_model(model(router), tok, plan=DispatchPlan(pack_dense=True, pack_experts=True))
    if backend == "cpu-kernel":
        return Engine.from_model(model(router), tok, plan=KERNEL)
    if backend == "compiled":
        return Engine.from_model(model(router), tok, plan=DispatchPlan(), compile="on")
    from moeserve.export.onnx_export import export_onnx

    m = model(router)
    ckpt = save_checkpoint(tmp_path / "ckpt", m.cfg, m.state_dict())
    export_onnx(ckpt, tmp_path / "m.onnx", "portable", kv_cache=True)
    return load_engine(tmp_path / "m.onnx")


CASES = [pytest.param(b, r, id=f"{b}-{r}", marks=[pytest.mark.slow] if b in ("compiled", "onnx") else [])
         for b, routers in (("eager-packed", ("softmax", "xmoe", "vq")), ("cpu-kernel", ("softmax", "xmoe", "vq")),
                            ("compiled", ("softmax",)), ("onnx", ("softmax",)))
         for r in routers]


@pytest.mark.parametrize("backend,router", CASES)
def test_a_backend_answers_as_the_eager_reference(backend, router, tmp_path):
    why = why_not(backend)
    if why is not None:
        pytest.skip(why)
    ref, got = engine("eager-plain", router, tmp_path), engine(backend, router, tmp_path)
    assert got.runner.name == {"eager-packed": "eager"}.get(backend, backend)
    rows = [ref.encode(p) for p in PROMPTS]

    ids, mask = ref._right_pad(rows)  # a padded batch: the real positions' logits
    real = mask.bool()
    torch.testing.assert_close(got.forward(ids, mask)[real], ref.forward(ids, mask)[real], atol=1e-4, rtol=0)
    for a, b in zip(got.score_ids(rows), ref.score_ids(rows)):
        assert a.n_tokens == b.n_tokens and a.logprob == pytest.approx(b.logprob, abs=1e-4)

    ref.expert_load.reset(), got.expert_load.reset()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [c.token_ids for c in ref.complete(rows[:2], params)]  # two rows ending together: the compiled bucket 2
    assert [c.token_ids for c in got.complete(rows[:2], params)] == want
    assert torch.equal(got.expert_load.snapshot(), ref.expert_load.snapshot())
