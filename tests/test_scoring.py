"""`moeserve score`: scores equal Engine.score, a bad record is an error line and the run goes on,
nothing is clobbered, and a run killed at any point resumes to exactly the uninterrupted output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.cli import main
from moeserve.config import preset
from moeserve.runtime.engine import Engine
from moeserve.runtime.model import Transformer
from moeserve.scoring import ScoreConfig, plan_batches, score_file

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["def f(x):\n    return x + 1", "a", "import os", "héllo wörld ✓", "x = [1, 2, 3]\n" * 3, "class A: pass"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))  # random weights: max_seq_len 64, byte tokenizer
    return save_checkpoint(tmp_path_factory.mktemp("score") / "ckpt", model.cfg, model.state_dict())


@pytest.fixture(scope="module")
def engine(ckpt) -> Engine:
    return Engine.load(ckpt, dtype="float32", device="cpu")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run(ckpt, engine, tmp_path, inp, out="out.jsonl", **kw):
    cfg = ScoreConfig(input=inp, output=tmp_path / out, device="cpu", progress=False, **kw)
    return score_file(ckpt, cfg, engine=engine), read_jsonl(tmp_path / out)


def assert_scores(engine, got: list[dict], texts: list[str], stride: int | None = None) -> None:
    want = engine.score(texts, stride)
    for g, w in zip(got, want):
        assert g["n_tokens"] == w.n_tokens and g["windows"] == w.windows
        assert g["logprob"] == pytest.approx(w.logprob, rel=1e-5, abs=1e-5)
        assert g["bits_per_byte"] == pytest.approx(w.bits_per_byte, rel=1e-5, abs=1e-5)


# ---- results ----------------------------------------------------------------------------------
def test_scores_equal_engine_score_in_input_order(ckpt, engine, tmp_path):
    rows = [{"id": f"doc-{i}", "text": t} for i, t in enumerate(TEXTS)]
    rows[2] = {"text": TEXTS[2]}  # no id: its line number
    summary, out = run(ckpt, engine, tmp_path, write_jsonl(tmp_path / "in.jsonl", rows), batch_size=2, chunk_size=4)
    assert [r["id"] for r in out] == ["doc-0", "doc-1", 3, "doc-3", "doc-4", "doc-5"]
    assert all(set(r) == {"id", "logprob", "n_tokens", "bits_per_byte", "windows"} for r in out)
    assert [r["windows"] for r in out] == [1] * 6
    assert_scores(engine, out, TEXTS)
    assert (summary.scored, summary.errors, summary.records) == (6, 0, 6)
    assert not (tmp_path / "out.jsonl.partial").exists() and not (tmp_path / "out.jsonl.progress.json").exists()


def test_batch_limits_do_not_change_scores(ckpt, engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    _, one = run(ckpt, engine, tmp_path, inp, "a.jsonl", batch_size=1)
    _, all_ = run(ckpt, engine, tmp_path, inp, "b.jsonl", batch_tokens=64 * 6)
    for a, b in zip(one, all_):
        assert a["id"] == b["id"] and a["n_tokens"] == b["n_tokens"]
        assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-5, abs=1e-5)


def test_plan_batches_asks_the_cap_as_it_cuts_each_batch():
    caps = iter([4, 8, 100])  # a sizer doubling between batches
    batches = list(plan_batches([2] * 10, 64, lambda: next(caps)))
    assert [len(b) for b in batches] == [2, 4, 4]


def test_measured_batch_size_is_recorded_and_a_resume_keeps_it(ckpt, engine, tmp_path, monkeypatch):
    """With --batch-tokens auto, a run that finds bigger batches faster settles at the limit, says so, records the
    size in its progress file with the chunk, and a resumed run scores the rest at that size: the scores are
    those of fixed batches, and the resumed output is the uninterrupted one's."""
    from moeserve import batch_size, scoring

    monkeypatch.setattr(batch_size, "AUTO_START", 64)
    monkeypatch.setattr(batch_size, "AUTO_LIMIT", 256)
    clock = [0.0]

    def perf_counter() -> float:  # every batch takes 1 s whatever its size: bigger batches, more tokens/s
        clock[0] += 0.5
        return clock[0]

    monkeypatch.setattr(scoring.time, "perf_counter", perf_counter)
    inp = write_jsonl(tmp_path / "in.jsonl", many_records(60))
    settings = dict(chunk_size=20, batch_size=64)
    logs: list[str] = []
    cfg = ScoreConfig(input=inp, output=tmp_path / "want.jsonl", device="cpu", progress=False, **settings)
    score_file(ckpt, cfg, engine=engine, log=logs.append)
    assert any("batches of up to 256 tokens" in m and "64: " in m and "128: " in m for m in logs), logs
    want = read_jsonl(tmp_path / "want.jsonl")
    _, fixed = run(ckpt, engine, tmp_path, inp, "fixed.jsonl", batch_tokens=256, **settings)
    for a, b in zip(want, fixed):
        assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-5, abs=1e-5)

    seen: list[int] = []
    real = engine.score_ids
    with monkeypatch.context() as m:
        def score_ids(rows, *args, max_batch_tokens, **kw):
            seen.append(max_batch_tokens)
            if sum(t == 256 for t in seen) > 3:  # settled in chunk 1 or 2; stopped in a later chunk
                raise KeyboardInterrupt
            return real(rows, *args, max_batch_tokens=max_batch_tokens, **kw)
        m.setattr(engine, "score_ids", score_ids)
        with pytest.raises(KeyboardInterrupt):
            run(ckpt, engine, tmp_path, inp, **settings)
    progress = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    assert progress["batch_tokens_chosen"] == 256 and 0 < progress["records_done"] < 60
    seen.clear()
    with monkeypatch.context() as m:
        m.setattr(engine, "score_ids", lambda rows, *a, max_batch_tokens, **kw: (
            seen.append(max_batch_tokens), real(rows, *a, max_batch_tokens=max_batch_tokens, **kw))[1])
        run(ckpt, engine, tmp_path, inp, resume=True, **settings)
    assert set(seen) == {256}  # no search again
    assert read_jsonl(tmp_path / "out.jsonl") == want


def test_bad_records_are_error_lines_and_the_run_goes_on(ckpt, engine, tmp_path):
    lines = [{"id": "ok1", "text": "fine"}, "not json {", "[1, 2]", {"id": "no-text", "body": "x"},
             {"id": "int", "text": 5}, {"id": "null", "text": None}, {"id": "empty", "text": ""},
             {"id": "long", "text": "y" * 64}, {"id": "edge", "text": "x" * 63}, '{"id": "sur", "text": "\\ud800"}',
             {"id": "ok2", "text": "also fine"}]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    with open(inp, "ab") as f:
        f.write(b'{"text": "\xff"}\n')  # line 12: not UTF-8
    summary, out = run(ckpt, engine, tmp_path, inp)
    assert [r["id"] for r in out] == ["ok1", 2, 3, "no-text", "int", "null", "empty", "long", "edge", "sur", "ok2", 12]
    errors = {r["id"]: r["error"] for r in out if "error" in r}
    assert "line 2" in errors[2] and "invalid JSON" in errors[2]
    assert "line 3" in errors[3] and "JSON object" in errors[3] and "array" in errors[3]
    assert "line 4" in errors["no-text"] and "'text'" in errors["no-text"]
    assert "must be a string" in errors["int"] and "int" in errors["int"]
    assert "must be a string" in errors["null"]
    assert "line 7" in errors["empty"] and "empty" in errors["empty"]
    assert "Unicode" in errors["sur"]
    assert "line 12" in errors[12] and "UTF-8" in errors[12]
    scored = [r for r in out if "error" not in r]
    assert [r["id"] for r in scored] == ["ok1", "long", "edge", "ok2"]
    assert_scores(engine, scored, ["fine", "y" * 64, "x" * 63, "also fine"])
    assert [r["windows"] for r in scored] == [1, 2, 1, 1]  # 65 tokens on a context of 64: two windows
    assert (summary.scored, summary.errors) == (4, 8)


def test_texts_longer_than_the_context_are_scored_in_windows(ckpt, engine, tmp_path):
    """A 300-byte text on a 64-token context: every token scored once, in windows `stride` apart, as the
    engine scores it (whose windows tests/runtime/test_windows.py checks against a direct computation)."""
    texts = ["def f(x):\n    return x * 2\n" * 11, "short", "z" * 640]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    for stride, windows in ((None, [9, 1, 20]), (8, [31, 1, 74]), (63, [5, 1, 11])):
        out_name = f"out-{stride}.jsonl"
        _, out = run(ckpt, engine, tmp_path, inp, out_name, stride=stride, batch_tokens=256)
        assert [r["n_tokens"] for r in out] == [len(t) for t in texts]
        assert [r["windows"] for r in out] == windows
        assert_scores(engine, out, texts, stride)
    with pytest.raises(ValueError, match=r"stride = 64: expected an integer in \[1, 63\]"):
        run(ckpt, engine, tmp_path, inp, "bad.jsonl", stride=64)
    with pytest.raises(ValueError, match="stride = 0"):
        ScoreConfig(input=inp, output=tmp_path / "x.jsonl", stride=0)


def test_plain_text_input_one_record_per_non_blank_line(ckpt, engine, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_bytes(b"first line\n\n   \nsecond line\r\nthird\n")
    _, out = run(ckpt, engine, tmp_path, inp)
    assert [r["id"] for r in out] == [1, 4, 5]
    assert_scores(engine, out, ["first line", "second line", "third"])
    # --format text reads a .jsonl file as text: each JSON line is just a string to score
    as_jsonl = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}])
    _, forced = run(ckpt, engine, tmp_path, as_jsonl, "f.jsonl", format="text")
    assert_scores(engine, forced, ['{"text": "a"}'])


def test_text_and_id_fields(ckpt, engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"key": 10, "body": "abc"}, {"body": "de"}])
    _, out = run(ckpt, engine, tmp_path, inp, text_field="body", id_field="key")
    assert [r["id"] for r in out] == [10, 2]
    assert_scores(engine, out, ["abc", "de"])


@pytest.mark.parametrize("batch_size,batch_tokens", [(1, 10_000), (3, 10_000), (100, 40), (4, 1)])
def test_plan_batches_covers_each_row_once_within_limits(batch_size, batch_tokens):
    lengths = [5, 1, 9, 3, 3, 20, 7, 2, 9, 11]
    batches = list(plan_batches(lengths, batch_size, lambda: batch_tokens))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)
    for b in batches:
        assert len(b) <= batch_size
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= batch_tokens


# ---- refusals and user errors ------------------------------------------------------------------------
def test_existing_output_or_partial_is_refused_until_overwrite(ckpt, engine, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    out = tmp_path / "out.jsonl"
    for existing in (out, tmp_path / "out.jsonl.partial"):
        existing.write_text("old\n")
        assert main(["score", str(ckpt), "--input", str(inp), "--output", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeserve score: error:") and existing.name in err
        assert "--resume" in err and "--overwrite" in err
        assert existing.read_text() == "old\n"  # untouched
        existing.unlink()
    out.write_text("old\n")
    (tmp_path / "out.jsonl.partial").write_text("old\n")
    assert main(["score", str(ckpt), "--input", str(inp), "--output", str(out), "--quiet", "--overwrite"]) == 0
    assert "scored 1, errors 0" in capsys.readouterr().err
    assert read_jsonl(out)[0]["id"] == 1 and not (tmp_path / "out.jsonl.partial").exists()


def test_resume_of_a_complete_output_says_so(ckpt, engine, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}, {"text": "de"}])
    out = tmp_path / "out.jsonl"
    assert main(["score", str(ckpt), "--input", str(inp), "--output", str(out), "--quiet"]) == 0
    before = out.read_bytes()
    assert main(["score", str(ckpt), "--input", str(inp), "--output", str(out), "--quiet", "--resume"]) == 0
    assert "already complete" in capsys.readouterr().err and out.read_bytes() == before


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/nowhere", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/o.jsonl"], "nowhere"),
    (["{ckpt}", "--input", "{tmp}/missing.jsonl", "--output", "{tmp}/o.jsonl"], "missing.jsonl"),
    (["{ckpt}", "--input", "{tmp}", "--output", "{tmp}/o.jsonl"], "not a regular file"),
    (["{ckpt}", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/no/dir/o.jsonl"], "does not exist"),
    (["{ckpt}", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/o.jsonl", "--chunk-size", "0"], "chunk_size"),
    (["{ckpt}", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/o.jsonl", "--batch-tokens", "-1"], "batch_tokens"),
    (["{ckpt}", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/o.jsonl", "--stride", "64"], "stride = 64"),
])
def test_user_errors_exit_2_naming_the_cause(ckpt, tmp_path, capsys, args, needle):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    assert main(["score", *[a.format(tmp=tmp_path, ckpt=ckpt) for a in args], "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeserve score: error:") and needle in err and "Traceback" not in err


# ---- interruption and resume ----------------------------------------------------------------------
def interrupt_after(engine, monkeypatch, calls: int) -> None:
    """Make the engine's `calls`+1-th score_ids raise KeyboardInterrupt (Ctrl-C mid-run)."""
    real, n = engine.score_ids, [0]

    def score_ids(rows, *args, **kwargs):
        n[0] += 1
        if n[0] > calls:
            raise KeyboardInterrupt
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(engine, "score_ids", score_ids)


def many_records(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    words = ["def", "x", "return", "(", ")", ":", "self", "import", "os", "\n", "  ", "1", "==", "é"]
    return [{"id": f"r{i}", "text": " ".join(words[j] for j in torch.randint(len(words), (int(k),), generator=g))}
            for i, k in enumerate(torch.randint(1, 9, (n,), generator=g))]


def test_resume_after_an_interrupt_and_a_half_written_chunk_is_exact(ckpt, engine, tmp_path, monkeypatch):
    inp = write_jsonl(tmp_path / "in.jsonl", many_records(40))
    settings = dict(chunk_size=6, batch_size=4)
    run(ckpt, engine, tmp_path, inp, "want.jsonl", **settings)
    want = (tmp_path / "want.jsonl").read_bytes()
    with monkeypatch.context() as m:
        interrupt_after(engine, m, 5)  # chunk 1 (two batches) and 2 committed, chunk 3 under way
        with pytest.raises(KeyboardInterrupt):
            run(ckpt, engine, tmp_path, inp, **settings)
    progress = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    assert progress["records_done"] == 12 and not (tmp_path / "out.jsonl").exists()
    assert progress["input"] == str(inp) and progress["checkpoint"] == str(ckpt) and len(progress["input_sha256"]) == 64
    assert progress["settings"] == {"format": "jsonl", "text_field": "text", "id_field": "id", "dtype": "float32",
                                    "device": "cpu", "quantization": None, "chunk_size": 6, "batch_size": 4,
                                    "batch_tokens": None, "stride": 32}
    with open(tmp_path / "out.jsonl.partial", "ab") as f:
        f.write(b'{"id": "r12", "logprob": -3')  # what a kill between write and commit leaves
    summary, _ = run(ckpt, engine, tmp_path, inp, resume=True, **settings)
    assert (tmp_path / "out.jsonl").read_bytes() == want
    assert summary.resumed_at == 12 and (summary.scored, summary.errors) == (40, 0)
    assert not (tmp_path / "out.jsonl.partial").exists() and not (tmp_path / "out.jsonl.progress.json").exists()


@pytest.mark.parametrize("change,needle", [
    (["--chunk-size", "7"], "chunk_size: 6 in the run, 7 now"),
    (["--batch-size", "2"], "batch_size"),
    (["--text-field", "body"], "text_field"),
    (["--stride", "8"], "stride: 32 in the run, 8 now"),  # the default stride is written as the number
    ("input", "input:"),
])
def test_resume_with_other_settings_or_input_is_refused(ckpt, engine, tmp_path, monkeypatch, capsys, change, needle):
    inp = write_jsonl(tmp_path / "in.jsonl", many_records(20))
    with monkeypatch.context() as m:
        interrupt_after(engine, m, 1)
        with pytest.raises(KeyboardInterrupt):
            run(ckpt, engine, tmp_path, inp, chunk_size=6, batch_size=4)
    partial = (tmp_path / "out.jsonl.partial").read_bytes()
    if change == "input":
        write_jsonl(inp, many_records(21))
        change = []
    argv = ["score", str(ckpt), "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--chunk-size", "6",
            "--batch-size", "4", "--device", "cpu", "--quiet", "--resume"]
    assert main([*argv, *change]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeserve score: error: cannot resume") and needle in err and "--overwrite" in err
    assert (tmp_path / "out.jsonl.partial").read_bytes() == partial  # nothing lost


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "moeserve.cli", "score", *map(str, args)]


def test_resume_after_sigkill_equals_an_uninterrupted_run(ckpt, tmp_path):
    # One thread (see one_thread), and the same for every run, so their bytes can be compared.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")])}
    inp = write_jsonl(tmp_path / "in.jsonl", many_records(240))
    flags = ["--chunk-size", "3", "--batch-size", "2", "--device", "cpu", "--quiet"]
    subprocess.run(cli(ckpt, "--input", inp, "--output", tmp_path / "want.jsonl", *flags), env=env, check=True,
                   timeout=300, capture_output=True)
    want = (tmp_path / "want.jsonl").read_bytes()

    out, progress = tmp_path / "out.jsonl", tmp_path / "out.jsonl.progress.json"
    proc = subprocess.Popen(cli(ckpt, "--input", inp, "--output", out, *flags), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(progress.read_text())["records_done"] > 0:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read().decode()
    proc.stderr.close()
    done = json.loads(progress.read_text())["records_done"]
    assert 0 < done < 240 and not out.exists()

    p = subprocess.run(cli(ckpt, "--input", inp, "--output", out, *flags, "--resume"), env=env, timeout=300,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f"resuming at record {done + 1} of 240" in p.stderr and "scored 240, errors 0" in p.stderr
    assert out.read_bytes() == want
    assert [r["id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(240)]
    assert not progress.exists() and not (tmp_path / "out.jsonl.partial").exists()
