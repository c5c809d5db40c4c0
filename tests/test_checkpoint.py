"""Checkpoint directory: exact round trips, atomic overwrite, and a named error for every corruption."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import struct
import time
from pathlib import Path

import pytest
import torch

from moeserve import checkpoint as ckpt
from moeserve.checkpoint import (
    CheckpointError,
    describe,
    is_expert_weight,
    load_checkpoint,
    load_expert_slice,
    parameter_counts,
    save_checkpoint,
    verify_checkpoint,
)
from moeserve.config import PRESETS, MoEConfig

# Hand-computed for the state dict below (tiny preset: E=4, k=2).
EMB, ATTN, EXPERTS_PER_LAYER, NORM = 259 * 64, 64 * 64, 3 * 4 * 128 * 64, 64
TOTAL = EMB + ATTN + 2 * EXPERTS_PER_LAYER + NORM  # 217_344
EXPERTS = 2 * EXPERTS_PER_LAYER  # 196_608
ACTIVE = TOTAL - EXPERTS + EXPERTS * 2 // 4  # 119_040


def make_config(**overrides) -> MoEConfig:
    return MoEConfig(**{**PRESETS["tiny"], **overrides})


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {"tok_embeddings.weight": torch.randn(259, 64, generator=g),
             "layers.0.attention.wq.weight": torch.randn(64, 64, generator=g)}
    for i in range(2):
        state[f"layers.{i}.ffn.experts.w1"] = torch.randn(4, 128, 64, generator=g)
        state[f"layers.{i}.ffn.experts.w2"] = torch.randn(4, 64, 128, generator=g)
        state[f"layers.{i}.ffn.experts.w3"] = torch.randn(4, 128, 64, generator=g)
    state["norm.weight"] = torch.ones(64)
    return state


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "ckpt", make_config(), make_state(), recipe={"lr": 1e-3}, metrics={"loss": 2.5})


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def data_offset(file: Path) -> int:
    (n,) = struct.unpack("<Q", file.read_bytes()[:8])
    return 8 + n


# ---- round trips --------------------------------------------------------------------------------
def test_round_trip_is_exact(tmp_path: Path) -> None:
    config, state = make_config(router="xmoe"), make_state()
    state["layers.0.ffn.router.tau"] = torch.tensor(0.3, dtype=torch.bfloat16)  # 0-d, bf16
    state["layers.0.ffn.vq.usage"] = torch.arange(4, dtype=torch.int64)
    train_state = {"opt.exp_avg.tok_embeddings.weight": torch.randn(259, 64),
                   "omoe.P.0.w1.0": torch.eye(64), "rng.cpu": torch.get_rng_state()}
    assert train_state["rng.cpu"].dtype == torch.uint8
    meta = {"step": 120, "scheduler": {"last_epoch": 120}, "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95]}}
    out = save_checkpoint(tmp_path / "ckpt", config, state, recipe={"router": "xmoe", "steps": 120},
                          metrics={"loss": 1.25}, train_state=train_state, train_meta=meta)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "moeserve.json", "train_state.safetensors", "train_state.json"])
    loaded = load_checkpoint(out, load_train_state=True)
    assert loaded.config == config and loaded.path == out
    assert_same(state, loaded.state_dict)
    assert_same(train_state, loaded.train_state)
    assert loaded.train_meta == meta
    assert loaded.manifest["recipe"] == {"router": "xmoe", "steps": 120}
    assert loaded.manifest["metrics"] == {"loss": 1.25}
    assert set(loaded.manifest["files"]) == {"model.safetensors", "train_state.safetensors", "train_state.json"}
    assert json.loads((out / "config.json").read_text())["format"] == "moeserve/1"
    # without asking, training state is not loaded
    plain = load_checkpoint(out)
    assert plain.train_state is None and plain.train_meta is None


def test_sharded_round_trip(tmp_path: Path) -> None:
    state = make_state()
    out = save_checkpoint(tmp_path / "ckpt", make_config(), state, max_shard_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    assert set(index["weight_map"]) == set(state)
    loaded = load_checkpoint(out)
    assert_same(state, loaded.state_dict)
    assert set(verify_checkpoint(out)) == set(shards) | {"model.safetensors.index.json"}


@pytest.mark.parametrize("max_shard_bytes", [None, 300_000])  # one file, and experts over several
def test_expert_slices_and_the_dense_rest(tmp_path: Path, max_shard_bytes) -> None:
    """What an expert-parallel rank loads: rows [start, stop) of each stacked expert tensor, in
    the asked dtype; everything but the experts."""
    state = make_state()
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    out = save_checkpoint(tmp_path / "ckpt", make_config(), state, **kw)
    cfg, part = load_expert_slice(out, 1, 3, dtype=torch.bfloat16)
    assert cfg.n_experts == 4 and sorted(part) == sorted(k for k in state if is_expert_weight(k))
    for k, t in part.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, state[k][1:3].to(torch.bfloat16)), k
    dense = load_checkpoint(out, keep=lambda k: not is_expert_weight(k)).state_dict
    assert_same({k: v for k, v in state.items() if not is_expert_weight(k)}, dense)
    for start, stop in ((0, 0), (3, 2), (0, 5), (-1, 2)):
        with pytest.raises(CheckpointError, match=rf"experts \[{start}, {stop}\): expected a range within the "
                                                  r"model's 4"):
            load_expert_slice(out, start, stop)


def test_tied_and_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    state = make_state()
    state["output.weight"] = state["tok_embeddings.weight"]  # tied: same storage
    state["layers.0.attention.wo.weight"] = torch.randn(64, 64).t()  # non-contiguous view
    out = save_checkpoint(tmp_path / "ckpt", make_config(), state)
    loaded = load_checkpoint(out)
    assert_same(state, loaded.state_dict)
    assert loaded.manifest["tied"] == {"output.weight": "tok_embeddings.weight"}


def test_verify_returns_hashes(saved: Path) -> None:
    digest = hashlib.sha256((saved / "model.safetensors").read_bytes()).hexdigest()
    assert verify_checkpoint(saved) == {"model.safetensors": digest}


# ---- atomic overwrite -----------------------------------------------------------------------------
def test_overwrite_replaces_and_leaves_no_temp_dirs(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ckpt", make_config(), make_state(0))
    new = make_state(1)
    save_checkpoint(tmp_path / "ckpt", make_config(), new, metrics={"step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert_same(new, loaded.state_dict)
    assert loaded.manifest["metrics"] == {"step": 2}


def test_failed_write_keeps_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = make_state(0)
    save_checkpoint(tmp_path / "ckpt", make_config(), old)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "ckpt", make_config(), make_state(1))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert_same(old, load_checkpoint(tmp_path / "ckpt").state_dict)


def test_failed_swap_restores_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = make_state(0)
    save_checkpoint(tmp_path / "ckpt", make_config(), old)
    real = ckpt._rename

    def crash_moving_new_in(src: Path, dst: Path) -> None:
        if src.name.startswith(".ckpt.tmp-"):
            raise OSError("simulated crash")
        real(src, dst)

    monkeypatch.setattr(ckpt, "_rename", crash_moving_new_in)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path / "ckpt", make_config(), make_state(1))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert_same(old, load_checkpoint(tmp_path / "ckpt").state_dict)


def test_refuses_to_overwrite_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save_checkpoint(tmp_path, make_config(), make_state())
    assert (tmp_path / "notes.txt").read_text() == "precious"


# ---- corruption: each gets a named error ----------------------------------------------------------
def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="expected a checkpoint directory"):
        load_checkpoint(tmp_path / "f")


def test_missing_config(saved: Path) -> None:
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_checkpoint(saved)


def test_bad_json_config(saved: Path) -> None:
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_checkpoint(saved)


def test_invalid_config_field(saved: Path) -> None:
    data = json.loads((saved / "config.json").read_text())
    data["top_k"] = 99
    (saved / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"config\.json: config field 'top_k' = 99") as e:
        load_checkpoint(saved)
    assert "n_experts" in str(e.value)


def test_incomplete_huggingface_config_is_refused(saved: Path) -> None:
    (saved / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="Hugging Face model_type 'mixtral'"):
        load_checkpoint(saved)


def test_missing_weights(saved: Path) -> None:
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        load_checkpoint(saved)


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_weights(saved: Path, verify: bool) -> None:
    file = saved / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    expected = "sha256 mismatch" if verify else "not a valid safetensors file"
    with pytest.raises(CheckpointError, match=expected) as e:
        load_checkpoint(saved, verify=verify)
    assert "model.safetensors" in str(e.value)


def test_tampered_byte(saved: Path) -> None:
    file = saved / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[data_offset(file) + 1000] ^= 0x01
    file.write_bytes(bytes(data))
    load_checkpoint(saved, verify=False)  # still a well-formed file: only the hash can tell
    with pytest.raises(CheckpointError, match="sha256 mismatch.*tampered") as e:
        load_checkpoint(saved)
    assert "model.safetensors" in str(e.value)
    with pytest.raises(CheckpointError, match="tampered"):
        verify_checkpoint(saved)
    assert "hashes: FAILED" in describe(saved)


def test_a_byte_changed_after_a_remembered_hash_is_still_caught(saved: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash memo (cache.py) spares a restart the read; it must not spare a changed file the check."""
    from moeserve import cache

    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    hashed: list[str] = []
    real = cache.sha256_file
    counting = lambda f: hashed.append(Path(f).name) or real(f)  # noqa: E731
    monkeypatch.setattr(cache, "sha256_file", counting)
    monkeypatch.setattr(ckpt, "sha256_file", counting)
    load_checkpoint(saved)
    load_checkpoint(saved)
    assert hashed.count("model.safetensors") == 1
    assert "hashes: verified" in describe(saved)  # `moeserve inspect` reads the files whatever is remembered
    assert hashed.count("model.safetensors") == 2
    file = saved / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[data_offset(file) + 1000] ^= 0x01
    time.sleep(0.05)  # past the file system's clock tick
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch.*tampered"):
        load_checkpoint(saved)


def test_missing_manifest(saved: Path) -> None:
    (saved / "moeserve.json").unlink()
    with pytest.raises(CheckpointError, match=r"moeserve\.json: missing"):
        load_checkpoint(saved)


def test_invalid_manifest(saved: Path) -> None:
    (saved / "moeserve.json").write_text(json.dumps({"format": "moeserve/1", "files": {"../x": "0" * 64}}))
    with pytest.raises(CheckpointError, match=r"moeserve\.json.*plain file name"):
        load_checkpoint(saved)


def test_unlisted_weight_file(tmp_path: Path) -> None:
    out = save_checkpoint(tmp_path / "ckpt", make_config(), make_state(), max_shard_bytes=300_000)
    first = sorted(p.name for p in out.glob("model-*.safetensors"))[0]
    manifest = json.loads((out / "moeserve.json").read_text())
    manifest["files"].pop(first)
    (out / "moeserve.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=re.escape(first) + ": not listed"):
        load_checkpoint(out)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    out = save_checkpoint(tmp_path / "ckpt", make_config(), make_state(), max_shard_bytes=300_000)
    last = sorted(p.name for p in out.glob("model-*.safetensors"))[-1]
    (out / last).unlink()
    with pytest.raises(CheckpointError, match=r"index\.json: names shard file '" + re.escape(last)):
        load_checkpoint(out, verify=False)


class _Boom:
    """Unpickling this creates a marker file: proof that the loader ran pickle."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


def test_pickle_is_refused_and_never_run(tmp_path: Path) -> None:
    ckdir, marker = tmp_path / "hf", tmp_path / "marker"
    ckdir.mkdir()
    (ckdir / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    expected = "refusing to load pickle file .*pytorch_model.bin: moeserve loads safetensors only"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(ckdir)
    assert not marker.exists()
    (ckdir / "config.json").write_text(make_config().to_json())
    with pytest.raises(CheckpointError, match="refusing to load pickle"):
        load_checkpoint(ckdir)
    with pytest.raises(CheckpointError, match="refusing to load pickle"):
        describe(ckdir)
    assert not marker.exists()
    pickle.loads((ckdir / "pytorch_model.bin").read_bytes())  # the test's own check: the bomb is live
    assert marker.exists()


def test_package_never_unpickles() -> None:
    source = Path(ckpt.__file__).read_text()
    assert "torch.load" not in source and "import pickle" not in source


# ---- parameter counts and describe ----------------------------------------------------------------
def test_parameter_counts_by_hand() -> None:
    config = make_config()
    shapes = {k: tuple(v.shape) for k, v in make_state().items()}
    assert parameter_counts(config, shapes) == {"total": TOTAL, "active_per_token": ACTIVE, "experts": EXPERTS}
    # a tied head saved under its own name is still one matrix
    assert parameter_counts(config, {**shapes, "output.weight": (259, 64)})["total"] == TOTAL
    untied = parameter_counts(make_config(tie_embeddings=False), {**shapes, "output.weight": (259, 64)})
    assert untied["total"] == TOTAL + EMB
    # a discrete VQ layer runs one expert per token
    vq = parameter_counts(make_config(router="vq", vq_mode="discrete"), shapes)
    assert vq["active_per_token"] == TOTAL - EXPERTS + EXPERTS // 4
    with pytest.raises(CheckpointError, match="layers.0.ffn.experts.w1.*n_experts=4"):
        parameter_counts(config, {**shapes, "layers.0.ffn.experts.w1": (8, 128, 64)})


def test_describe(saved: Path) -> None:
    text = describe(saved)
    digest = hashlib.sha256((saved / "model.safetensors").read_bytes()).hexdigest()
    assert digest[:16] in text
    assert f"total: {TOTAL / 1e6:.2f}M ({TOTAL:,})" in text
    assert f"active per token: {ACTIVE / 1e6:.2f}M ({ACTIVE:,})" in text
    assert "format: moeserve/1" in text and "  d_model = 64" in text
    assert "hashes: verified" in text
    assert '"lr": 0.001' in text and '"loss": 2.5' in text
    assert "train_state: absent" in text


# ---- a real model through save -> load_model ------------------------------------------------------
def test_load_model_reproduces_outputs_exactly(tmp_path):
    from moeserve.config import preset
    from moeserve.runtime.loading import load_model
    from moeserve.runtime.model import Transformer

    torch.manual_seed(0)
    for router in ("xmoe", "vq"):
        cfg = preset("tiny", router=router)
        model = Transformer(cfg).eval()
        save_checkpoint(tmp_path / router, cfg, model.state_dict())
        loaded, ckpt = load_model(tmp_path / router)
        ids = torch.randint(0, 256, (2, 16))
        assert ckpt.config == cfg
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_load_model_names_the_tensor_when_config_and_weights_disagree(tmp_path):
    from moeserve.config import preset
    from moeserve.runtime.loading import load_model
    from moeserve.runtime.model import Transformer

    cfg = preset("tiny")
    save_checkpoint(tmp_path / "c", cfg, Transformer(cfg).state_dict())
    edited = json.loads((tmp_path / "c" / "config.json").read_text())
    edited["d_ff"] = 96  # config.json is not hashed; the weights still say 128
    (tmp_path / "c" / "config.json").write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=r"experts\.w1' has shape \(4, 128, 64\).*\(4, 96, 64\)"):
        load_model(tmp_path / "c")
    edited["d_ff"], edited["n_layers"] = 128, 3
    (tmp_path / "c" / "config.json").write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=r"missing \['layers\.2\."):
        load_model(tmp_path / "c")
