"""`moeserve score --ray` on a real local Ray (started once for the module): the same output as the local
scorer byte for byte, error lines and windows included; a run interrupted at the driver resumes to the same
bytes; a scoring actor killed mid-run is restarted by Ray Data and every id is written exactly once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from .conftest import wait_for_ray_to_exit
from moeserve.checkpoint import save_checkpoint
from moeserve.cli import main
from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.scoring import ScoreConfig, score_file
from moeserve.scoring_ray import RayScorer, score_file_ray

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"), pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    wait_for_ray_to_exit()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="vq"))  # max_seq_len 64, byte tokenizer
    return save_checkpoint(tmp_path_factory.mktemp("ray") / "ckpt", model.cfg, model.state_dict())


def records(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    words = ["def", "x", "return", "(", ")", ":", "self", "import", "os", "\n", "  ", "1", "==", "é"]
    out: list = [{"id": f"r{i}", "text": " ".join(words[j] for j in torch.randint(len(words), (int(k),), generator=g))}
                 for i, k in enumerate(torch.randint(1, 40, (n,), generator=g))]
    return out


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def score(ckpt: Path, inp: Path, out: Path, workers: int | None = None, **kw):
    """Locally, or on Ray with `workers` actors."""
    cfg = ScoreConfig(input=inp, output=out, device="cpu", progress=False, **kw)
    return score_file(ckpt, cfg) if workers is None else score_file_ray(ckpt, cfg, workers)


def test_ray_output_equals_local_output_byte_for_byte(ckpt, tmp_path):
    rows = records(60)
    rows[5:5] = ["not json {", {"id": "empty", "text": ""}, {"id": "int", "text": 3},
                 {"id": "long", "text": "def f(x):\n    return x\n" * 12}]  # 277 tokens: 8 windows of 64
    inp = write(tmp_path / "in.jsonl", rows)
    with open(inp, "ab") as f:
        f.write(b"\n\n" + b'{"text": "\xff"}\n')  # blank lines, then a line that is not UTF-8
    local = score(ckpt, inp, tmp_path / "local.jsonl", chunk_size=7, batch_size=4)
    remote = score(ckpt, inp, tmp_path / "ray.jsonl", chunk_size=7, batch_size=4, workers=2)
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    assert (remote.scored, remote.errors) == (local.scored, local.errors) == (61, 4)
    lines = [json.loads(x) for x in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert next(r for r in lines if r["id"] == "long")["windows"] == 8
    assert lines[-1]["id"] == 67 and "UTF-8" in lines[-1]["error"]


def test_ray_run_interrupted_at_the_driver_resumes_to_the_same_bytes(ckpt, tmp_path, monkeypatch):
    inp = write(tmp_path / "in.jsonl", records(40, seed=1))
    settings = dict(chunk_size=5, batch_size=3, stride=16)
    score(ckpt, inp, tmp_path / "want.jsonl", **settings)
    real = RayScorer.score_spans

    def interrupted(self, spans):
        for i, item in enumerate(real(self, spans)):
            if i == 3:
                raise KeyboardInterrupt  # Ctrl-C with chunks 0-2 committed and the rest in flight
            yield item

    with monkeypatch.context() as m:
        m.setattr(RayScorer, "score_spans", interrupted)
        with pytest.raises(KeyboardInterrupt):
            score(ckpt, inp, tmp_path / "out.jsonl", workers=2, **settings)
    progress = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    assert progress["records_done"] == 15
    summary = score(ckpt, inp, tmp_path / "out.jsonl", workers=2, resume=True, **settings)
    assert summary.resumed_at == 15 and (summary.scored, summary.errors) == (40, 0)
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "want.jsonl").read_bytes()


def scorer_pids() -> list[int]:
    """Processes of this test's scoring actors: by the title Ray gives an actor's process, among the descendants of
    this process (the Ray it started: raylet, then workers), not another run's Ray on the same machine."""
    parent, cmdline = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False

    return [pid for pid, cmd in cmdline.items() if b"ChunkScorer" in cmd and ours(pid)]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the actors' processes in /proc (Linux)")
def test_a_killed_scoring_actor_is_restarted_and_every_id_is_written_once(ckpt, tmp_path, monkeypatch):
    inp = write(tmp_path / "in.jsonl", records(120, seed=2))
    score(ckpt, inp, tmp_path / "want.jsonl", chunk_size=2)
    real, killed = RayScorer.score_spans, []

    def kill_after_two(self, spans):
        for i, item in enumerate(real(self, spans)):
            if i == 2:  # two chunks committed, the others queued or in flight on the actors
                killed.extend(scorer_pids())
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
            yield item

    monkeypatch.setattr(RayScorer, "score_spans", kill_after_two)
    summary = score(ckpt, inp, tmp_path / "out.jsonl", chunk_size=2, workers=2)
    assert len(killed) == 2, killed  # both actors were running, and both were killed
    assert all(pid not in scorer_pids() for pid in killed)  # replaced, not revived
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "want.jsonl").read_bytes()
    ids = [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(120)] and summary.scored == 120


def test_cli_ray_flags(ckpt, tmp_path, capsys):
    inp = write(tmp_path / "in.jsonl", records(6))
    out = tmp_path / "o.jsonl"
    assert main(["score", str(ckpt), "--input", str(inp), "--output", str(out), "--ray", "--workers", "1",
                 "--quiet", "--device", "cpu"]) == 0
    assert "scored 6, errors 0" in capsys.readouterr().err and len(out.read_text().splitlines()) == 6
    # user errors name their cause, also when they happen on a Ray worker
    assert main(["score", str(tmp_path / "nowhere"), "--input", str(inp), "--output", str(tmp_path / "a.jsonl"),
                 "--ray", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeserve score: error:") and "nowhere" in err and "Traceback" not in err
    assert main(["score", str(ckpt), "--input", str(inp), "--output", str(tmp_path / "b.jsonl"), "--workers", "2",
                 "--quiet"]) == 2
    assert "pass --ray too" in capsys.readouterr().err
