"""Training end to end on the `tiny` preset: every router learns, and resume is exact."""

import json
from dataclasses import replace

import pytest

from moeserve.checkpoint import load_checkpoint
from moeserve.config import preset
from moeserve.training import data as data_mod
from moeserve.training import trainer as trainer_mod
from moeserve.training.data import load_corpus
from moeserve.training.trainer import LOG_NAME, TrainConfig, fit_steps, lr_at, train


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


def killed_at(step: int, monkeypatch, run) -> None:
    """Run `run` with the batch of `step` raising KeyboardInterrupt, as a kill there would end it."""
    real_get = data_mod.Batcher.get

    def get(self, s):
        if s == step:
            raise KeyboardInterrupt("simulated kill")
        return real_get(self, s)

    with monkeypatch.context() as m:
        m.setattr(data_mod.Batcher, "get", get)
        with pytest.raises(KeyboardInterrupt):
            run()


def _losses(out):
    return [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]


@pytest.mark.parametrize("overrides,optimizer", [(dict(router="vq"), "adamw"), (dict(router="xmoe"), "omoe")],
                         ids=["vq-adamw", "xmoe-omoe"])
def test_resume_reproduces_uninterrupted_run(tmp_path, corpus, monkeypatch, overrides, optimizer):
    cfg = preset("tiny", **overrides)
    tc = _tc(steps=24, save_every=8, eval_every=12, optimizer=optimizer)
    train(cfg, tc, tmp_path / "a", progress=False, corpus=corpus)

    killed_at(19, monkeypatch, lambda: train(cfg, tc, tmp_path / "b", progress=False, corpus=corpus))
    assert load_checkpoint(tmp_path / "b", load_train_state=True).train_meta["step"] == 16
    train(cfg, tc, tmp_path / "b", resume=True, progress=False, corpus=corpus)

    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(24))  # nothing missing, nothing twice
    for ra, rb in zip(a, b):
        for key in ("loss", "balance_loss", "vq_codebook_loss", "grad_norm", "val_loss", "routing_fluctuation"):
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    # the routing fluctuation between the two evaluations: the resumed run kept the first one's routing
    assert "routing_fluctuation" not in b[11] and len(b[23]["routing_fluctuation"]) == cfg.n_layers
    assert all(0 <= rf <= 1 for rf in b[23]["routing_fluctuation"]) and any(rf > 0 for rf in b[23]["routing_fluctuation"])
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


# ---- a time budget fits the run to the machine ---------------------------------------------------------
def test_fit_steps_at_a_given_pace():
    tc = TrainConfig(steps=300, warmup_steps=30, eval_every=100, eval_batches=8, time_budget_s=220)
    first_slow = [2.0] + [1.0] * 9  # the first step is left out of the pace
    # 11 s spent; n steps cost (n - 10) s more, plus 3 evaluations of 8 batches at a third of a step each
    assert fit_steps(tc, first_slow, elapsed=11.0, done=10) == 211
    assert fit_steps(tc, [0.5] * 10, elapsed=5.0, done=10) == 300  # fast enough: never more than asked
    assert fit_steps(tc, [10.0] * 10, elapsed=100.0, done=10) == 30  # never less than the warm-up


@pytest.mark.parametrize("field,value", [("time_budget_s", 0.0), ("time_budget_s", float("inf")),
                                         ("pace_steps", 40), ("pace_steps", 1)])
def test_budget_options_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{"warmup_steps": 30, "time_budget_s": 100.0, field: value})


def test_a_budget_run_equals_the_run_asked_for_its_fitted_steps(tmp_path, corpus):
    cfg = preset("tiny")
    tc = _tc(steps=400, eval_every=20, time_budget_s=1.0, pace_steps=5)
    metrics = train(cfg, tc, tmp_path / "fit", progress=False, corpus=corpus)
    n = load_checkpoint(tmp_path / "fit").manifest["recipe"]["train"]["steps"]
    assert 10 <= n < 400 and metrics["step"] == n
    fitted = _losses(tmp_path / "fit")
    assert [r["step"] for r in fitted] == list(range(n))
    assert fitted[-1]["lr"] == pytest.approx(lr_at(n - 1, TrainConfig(steps=n, warmup_steps=10)))  # schedule of n steps

    train(cfg, replace(tc, steps=n, time_budget_s=None), tmp_path / "asked", progress=False, corpus=corpus)
    asked = _losses(tmp_path / "asked")
    assert [(r["loss"], r["lr"], r.get("val_loss")) for r in asked] == [
        (r["loss"], r["lr"], r.get("val_loss")) for r in fitted]
    sa, sb = load_checkpoint(tmp_path / "fit").state_dict, load_checkpoint(tmp_path / "asked").state_dict
    assert all(sa[k].equal(sb[k]) for k in sa)


def test_a_resumed_budget_run_keeps_its_fitted_steps(tmp_path, corpus, monkeypatch):
    """The fit is timing, so it is pinned here: 18 steps; the resumed process would fit 30, and must not."""
    cfg = preset("tiny")
    tc = _tc(steps=60, save_every=8, eval_every=12, time_budget_s=100.0, pace_steps=5)
    monkeypatch.setattr(trainer_mod, "fit_steps", lambda *a: 18)
    train(cfg, tc, tmp_path / "a", progress=False, corpus=corpus)

    killed_at(13, monkeypatch, lambda: train(cfg, tc, tmp_path / "b", progress=False, corpus=corpus))
    monkeypatch.setattr(trainer_mod, "fit_steps", lambda *a: 30)
    train(cfg, tc, tmp_path / "b", resume=True, progress=False, corpus=corpus)

    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(18))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert load_checkpoint(tmp_path / "b").manifest["recipe"]["train"]["steps"] == 18
