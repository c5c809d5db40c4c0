"""`moeserve serve --profile-dir`: POST /start_profile and /stop_profile on a real server. The trace holds the model
thread's steps, labelled by phase, and the summary counts exactly the model calls the requests made; the endpoints
refuse what cannot be done (off, twice, without the token), a forgotten profile stops at its limit, and one running
at shutdown is written."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

from moeserve.cli import main
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.profiling import PHASES, Halted, phase
from moeserve.serve.state import MODEL_THREAD, ServeConfig

from .conftest import live_server, wait_until

KEY = {"Authorization": "Bearer k"}
PROMPT = "def f(x):"


def _server(tiny_ckpt: Path, out: Path, **kw):
    cfg = ServeConfig(model_name="tiny", api_key="k", profile_dir=out, **kw)
    return live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg)


def _complete(s, n: int) -> dict:
    r = s.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": n, "temperature": 0,
                                   "ignore_eos": True}, headers=KEY)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_profile_holds_the_steps_of_the_requests_between_start_and_stop(tiny_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "profiles"
    writers = []  # the threads that wrote a stopped profile: never the model thread, which streams meanwhile
    write = Halted._write
    monkeypatch.setattr(Halted, "_write", lambda self: writers.append(threading.current_thread().name) or write(self))
    engine = Engine.load(tiny_ckpt, dtype="float32", device="cpu")
    want = engine.complete([PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].text
    with _server(tiny_ckpt, out) as s:
        assert s.client.post("/start_profile").status_code == 401  # the bearer token, as on /v1/*
        r = s.client.post("/stop_profile", headers=KEY)
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
        assert "no profile is running" in r.json()["error"]["message"]
        r = s.client.post("/start_profile", headers=KEY)
        assert r.status_code == 200 and r.json()["profiling"] is True and r.json()["dir"] == str(out)
        r = s.client.post("/start_profile", headers=KEY)
        assert r.status_code == 409 and "already running" in r.json()["error"]["message"]
        assert _complete(s, 8)["choices"][0]["text"] == want  # a profiled server answers as any other
        r = s.client.post("/stop_profile", headers=KEY)
        assert r.status_code == 200, r.text
        report = r.json()
        assert s.client.post("/stop_profile", headers=KEY).status_code == 409
    assert len(writers) == 1 and writers[0] != MODEL_THREAD, writers
    # one prompt call (its first token), then one decode call for each of the other 7; a choice for each
    phases = report["phases"]
    assert phases["prefill"]["calls"] == 1 and phases["decode"]["calls"] == 7
    assert phases["sample"]["calls"] == 8 and phases["output"]["calls"] == 8
    assert report["turns"] >= 8 and phases["plan"]["calls"] == report["turns"]
    assert report["stopped"] == "asked" and report["device_busy"] is None  # no GPU here
    assert 0 < report["span_s"] <= report["wall_s"] and 0 < report["model_thread_busy"] <= 1
    assert 0 < report["model_thread_cpu"] <= 1
    if Path("/proc/thread-self/schedstat").exists():
        assert 0 <= report["model_thread_runnable"] <= 1
    turn = phases["turn"]["total_ms"]
    assert all(0 < phases[p]["total_ms"] <= turn for p in ("plan", "prefill", "decode", "sample", "output"))
    trace = Path(report["trace"])
    assert trace.parent == out and trace.name.endswith(".pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert set(PHASES) <= names
    assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names  # the model's ops beneath
    assert json.loads(trace.with_name(trace.name.replace(".pt.trace.json.gz", ".summary.json")).read_text()) == report
    assert "Self CPU" in Path(report["table"]).read_text()


def test_profiling_is_off_without_profile_dir(live):
    r = live.client.post("/start_profile")
    assert r.status_code == 404 and "--profile-dir" in r.json()["error"]["message"]


def test_a_forgotten_profile_stops_itself_and_one_running_at_shutdown_is_written(tiny_ckpt, tmp_path):
    out = tmp_path / "profiles"
    with _server(tiny_ckpt, out, profile_max_s=0.05) as s:
        assert s.client.post("/start_profile", headers=KEY).status_code == 200
        time.sleep(0.1)
        _complete(s, 2)  # its first turn is past the limit: the profile stops there, written
        wait_until(lambda: list(out.glob("*.summary.json")), "the profile at its limit written")
        report = s.client.post("/stop_profile", headers=KEY).json()
        assert report["stopped"] == "limit" and Path(report["trace"]).exists()
        assert s.client.post("/stop_profile", headers=KEY).status_code == 409  # that one was taken
        s.state.batcher.profiler.max_s = 600.0  # the next one is ended by the shutdown, not by the limit
        assert s.client.post("/start_profile", headers=KEY).status_code == 200  # and a new one runs
    summaries = sorted(out.glob("*.summary.json"), key=lambda p: p.stat().st_mtime)
    assert len(summaries) == 2 and json.loads(summaries[-1].read_text())["stopped"] == "shutdown"


def test_phase_is_free_while_no_profile_runs():
    assert phase("moeserve.turn") is phase("moeserve.plan")  # one shared nullcontext, no record_function


def test_serve_refuses_a_profile_dir_it_cannot_write(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["serve", str(tmp_path), "--profile-dir", str(tmp_path / "file" / "sub")]) == 2
    assert "--profile-dir" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--ray", "--profile-dir", str(tmp_path / "p")]) == 2
    assert "not with --ray" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--profile-max-s", "0"]) == 2
    assert "profile_max_s" in capsys.readouterr().err

