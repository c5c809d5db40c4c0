"""Training end to end on the `tiny` preset: every router learns, and resume is exact."""

import json

import pytest

from moeserve.checkpoint import load_checkpoint
from moeserve.config import preset
from moeserve.training import data as data_mod
from moeserve.training.data import load_corpus
from moeserve.training.trainer import LOG_NAME, TrainConfig, lr_at, train


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def _tc(**kw) -> TrainConfig:
    base = dict(steps=60, batch_size=16, seq_len=64, lr=3e-3, warmup_steps=10, eval_every=60, eval_batches=4)
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,optimizer",
    [
        (dict(router="softmax"), "adamw"),
        (dict(router="sigmoid"), "adamw"),
        (dict(router="xmoe"), "adamw"),
        (dict(router="xmoe", xmoe_gate="sigmoid"), "adamw"),
        (dict(router="vq"), "adamw"),
        (dict(router="xmoe"), "omoe"),
    ],
    ids=["softmax", "sigmoid", "xmoe", "xmoe-sigmoid", "vq", "xmoe-omoe"],
)
def test_tiny_beats_unigram(tmp_path, corpus, overrides, optimizer):
    metrics = train(preset("tiny", **overrides), _tc(optimizer=optimizer), tmp_path / "ckpt", progress=False,
                    corpus=corpus)
    assert metrics["val_bits_per_byte"] < metrics["unigram_bits_per_byte"] - 0.3, metrics
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.manifest["metrics"]["val_bits_per_byte"] == metrics["val_bits_per_byte"]
    assert ckpt.manifest["recipe"]["corpus_sha256"] == corpus.sha256


def _losses(out):
    return [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]


@pytest.mark.parametrize("overrides,optimizer", [(dict(router="vq"), "adamw"), (dict(router="xmoe"), "omoe")],
                         ids=["vq-adamw", "xmoe-omoe"])
def test_resume_reproduces_uninterrupted_run(tmp_path, corpus, monkeypatch, overrides, optimizer):
    cfg = preset("tiny", **overrides)
    tc = _tc(steps=24, save_every=8, eval_every=12, optimizer=optimizer)
    train(cfg, tc, tmp_path / "a", progress=False, corpus=corpus)

    real_get = data_mod.Batcher.get

    def crash_at_19(self, step):
        if step == 19:
            raise KeyboardInterrupt("simulated kill")
        return real_get(self, step)

    monkeypatch.setattr(data_mod.Batcher, "get", crash_at_19)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tc, tmp_path / "b", progress=False, corpus=corpus)
    monkeypatch.setattr(data_mod.Batcher, "get", real_get)
    assert load_checkpoint(tmp_path / "b", load_train_state=True).train_meta["step"] == 16
    train(cfg, tc, tmp_path / "b", resume=True, progress=False, corpus=corpus)

    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(24))  # nothing missing, nothing twice
    for ra, rb in zip(a, b):
        for key in ("loss", "balance_loss", "vq_codebook_loss", "grad_norm", "val_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    sa, sb = load_checkpoint(tmp_path / "a").state_dict, load_checkpoint(tmp_path / "b").state_dict
    assert all(sa[k].equal(sb[k]) for k in sa)


def test_refuses_to_overwrite_without_resume(tmp_path, corpus):
    out = tmp_path / "c"
    train(preset("tiny"), _tc(steps=2, eval_every=2), out, progress=False, corpus=corpus)
    with pytest.raises(FileExistsError, match="resume"):
        train(preset("tiny"), _tc(steps=2, eval_every=2), out, progress=False, corpus=corpus)


def test_resume_with_other_config_is_refused(tmp_path, corpus):
    out = tmp_path / "d"
    train(preset("tiny"), _tc(steps=2, eval_every=2), out, progress=False, corpus=corpus)
    with pytest.raises(Exception, match="differs"):
        train(preset("tiny", top_k=1), _tc(steps=4, eval_every=2), out, resume=True, progress=False, corpus=corpus)


def test_lr_schedule_warmup_and_decay():
    tc = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, tc) == pytest.approx(0.1)
    assert lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(10, tc) == pytest.approx(1.0)
    assert lr_at(55, tc) == pytest.approx(0.55)
    assert lr_at(100, tc) == pytest.approx(0.1)


@pytest.mark.parametrize("field,value", [("steps", 0), ("lr", -1.0), ("optimizer", "sgd"), ("dtype", "int8"),
                                         ("batch_size", 1.5)])
def test_train_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_resume_on_other_data_is_refused(tmp_path, corpus):
    out = tmp_path / "e"
    train(preset("tiny"), _tc(steps=2, eval_every=2), out, progress=False, corpus=corpus)
    text = tmp_path / "other.txt"
    text.write_text("a different corpus entirely\n" * 400)
    with pytest.raises(Exception, match="same --data"):
        train(preset("tiny"), _tc(steps=4, eval_every=2, data=[str(text)]), out, resume=True, progress=False)
