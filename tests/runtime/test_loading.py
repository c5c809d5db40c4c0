"""Loading a checkpoint without detours: the model takes the file's tensors (memory-mapped, no random
initialisation first), converts dtype as it reads, fuses a Mixtral import's w1/w3 without a copy, and
computes exactly what a model built and filled the old way computes. The KV cache zeroes a slot the first
time it is used, not at allocation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.runtime.backends.plan import default_plan
from moeserve.runtime.backends.eager import EagerBackend
from moeserve.checkpoint import load_checkpoint, save_checkpoint
from moeserve.config import preset
from moeserve.runtime.backends.experts import _halves_of_one, fuse_expert_weights
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.loading import load_model
from moeserve.runtime.model import Transformer

ROUTERS = ["softmax", "sigmoid", "xmoe", "vq"]


def saved(tmp_path: Path, **overrides) -> tuple[Path, Transformer]:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", max_seq_len=64, **overrides)).eval()
    if overrides.get("router") == "vq":  # codes from real activations, as in test_engine.py
        with torch.no_grad():
            for layer in model.moe_layers:
                layer.quantizer.codebook.normal_()
    save_checkpoint(tmp_path / "ckpt", model.cfg, model.state_dict())
    return tmp_path / "ckpt", model


def reference(path: Path) -> Transformer:
    """The way models were loaded before: built (randomly initialised), then filled by copy."""
    ckpt = load_checkpoint(path)
    model = Transformer(ckpt.config)
    model.load_state_dict(ckpt.state_dict)
    return model.eval()


@pytest.mark.parametrize("overrides", [{"router": r} for r in ROUTERS] + [{"task": "classify", "n_classes": 3}])
def test_loaded_model_computes_what_a_filled_one_does(tmp_path, overrides):
    path, _ = saved(tmp_path, **overrides)
    model, _ = load_model(path)
    ref = reference(path)
    assert model.state_dict().keys() == ref.state_dict().keys()
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for m in (model, ref):
            EagerBackend(m, default_plan("cpu", torch.float32))
        expected = ref(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)
        if model.cfg.task == "lm":  # and through a KV cache, which the loaded model allocates on its own
            cache = KVCache.for_model(model, slots=2)
            cached = model(ids, cache=cache.rows([0, 1], [0, 0], 9)).logits
            torch.testing.assert_close(cached, expected, atol=1e-5, rtol=0)


def mapped_ranges(file: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(file.resolve())):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from Linux's /proc")
def test_weights_are_the_memory_mapped_file_and_writes_do_not_reach_it(tmp_path):
    path, _ = saved(tmp_path)
    file = path / "model.safetensors"
    before = file.read_bytes()
    model, _ = load_model(path)
    ranges = mapped_ranges(file)
    assert ranges, "the weights file is not mapped"
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert any(lo <= p.data_ptr() < hi for lo, hi in ranges), f"{name} was copied out of the file"
    with torch.no_grad():
        params["tok_embeddings.weight"].add_(1.0)  # copy-on-write: the process's page, not the file's
    assert file.read_bytes() == before
    converted, _ = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in converted.parameters())
    assert not any(lo <= converted.tok_embeddings.weight.data_ptr() < hi for lo, hi in mapped_ranges(file))


def test_dtype_is_converted_on_read_and_integer_state_is_not(tmp_path):
    path, ref = saved(tmp_path, router="vq")
    model, _ = load_model(path, dtype=torch.bfloat16)
    for name, t in ref.state_dict().items():
        got = model.state_dict()[name]
        if t.is_floating_point():
            assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16)), name
        else:
            assert got.dtype == t.dtype and torch.equal(got, t), name
    assert model.rope_cos.dtype == torch.bfloat16
    assert load_model(path, dtype=None)[0].tok_embeddings.weight.dtype == torch.float32  # as stored


def test_building_an_empty_model_allocates_and_imports_nothing_heavy():
    """Transformer.empty builds on the meta device with nn.init skipped: a random fill there goes
    through torch's decompositions, which import torch._dynamo (1.5 s of a server's start-up)."""
    code = ("import sys, torch\nfrom moeserve.config import preset\nfrom moeserve.runtime.model import Transformer\n"
            "m = Transformer.empty(preset('tiny'))\n"
            "assert all(p.is_meta for p in m.parameters())\n"
            "assert m.rope_cos.device.type == 'cpu' and not m.rope_cos.isnan().any()\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_w1_w3_halves_of_one_tensor_fuse_without_a_copy():
    E, F, D = 3, 5, 4
    w13 = torch.randn(E, 2 * F, D)
    w1, w3 = w13[:, :F], w13[:, F:]
    view = _halves_of_one(w1, w3)
    assert view is not None and view.data_ptr() == w13.data_ptr() and torch.equal(view, w13)
    fused = fuse_expert_weights(w1, torch.randn(E, D, F), w3, "swiglu", pack=False)
    assert fused.w13_EFD.data_ptr() == w13.data_ptr()
    apart = [w1.clone(), w3.clone()]  # equal values, two storages: concatenated as before
    assert _halves_of_one(*apart) is None
    assert torch.equal(fuse_expert_weights(apart[0], torch.randn(E, D, F), apart[1], "swiglu", False).w13_EFD, w13)
    assert _halves_of_one(w3, w1) is None  # the wrong order is not [w1; w3]
    assert _halves_of_one(w13[:, :F - 1], w13[:, F - 1:2 * F - 2]) is None  # rows of another stride


def test_a_slot_is_zeroed_when_first_used_and_not_before():
    """Fill the cache with NaN, as uninitialised memory may be: a sequence in slot 0 computes what it
    computes in a fresh zeroed cache, and slot 1, never used, is never written."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", max_seq_len=32)).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 7))
    cache = KVCache.for_model(model, slots=2)
    for t in (*cache.k, *cache.v):
        t.fill_(float("nan"))
    with torch.no_grad():
        out = model(ids[:, :4], cache=cache.rows([0], [0], 4)).logits
        out = torch.cat([out, model(ids[:, 4:], cache=cache.rows([0], [4], 3)).logits], dim=1)
        ref = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert all(t[1].isnan().all() for t in (*cache.k, *cache.v))
    assert not any(t[0].isnan().any() for t in (*cache.k, *cache.v))


@pytest.mark.parametrize("where", ["weights", "header"])
def test_engine_load_reports_a_hash_mismatch_found_while_it_loads(tmp_path, where):
    """Engine.load hashes on a thread while it builds the model: a flipped byte is reported as the hash
    mismatch it is, also when the bad byte (in the safetensors header) makes the load itself fail first."""
    from moeserve.checkpoint import CheckpointError
    from moeserve.runtime.engine import Engine

    path, _ = saved(tmp_path)
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[len(data) - 7 if where == "weights" else 12] ^= 0x55
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as err:
        Engine.load(path, dtype="float32", device="cpu")
    assert str(file) in str(err.value)
    if where == "header":  # unchecked, the load's own error is what is left
        with pytest.raises(CheckpointError, match="not a valid safetensors file"):
            Engine.load(path, dtype="float32", device="cpu", verify=False)
    else:  # asked not to check, it loads what is there
        Engine.load(path, dtype="float32", device="cpu", verify=False)
