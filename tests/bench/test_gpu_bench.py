"""`moeserve bench gpu`'s parts that run anywhere: the cuda tests' report from a real pytest child, the goals from
engine reports, the page, the served comparison (two real servers, the CPU standing in for the GPU), the refusal
without a GPU. The run itself is made on a GPU (docs/bench/gpu-*.json)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from moeserve.bench.gpu import goals, markdown, on_cores, run_tests, served, served_lines, with_context
from moeserve.bench.server_process import cores_busy, thread_cpu
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.serve.state import MODEL_THREAD, name_os_thread, name_team

LINUX_PROC = pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task").is_dir(), reason="no /proc/PID/task (not Linux)")


def test_run_tests_counts_failures_and_skip_reasons(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_some.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.cuda\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='no TensorRT')\n"
        "def test_trt(): pass\n")
    (tmp_path / "tests" / "test_other.py").write_text("def test_not_cuda(): assert False\n")  # deselected by -m cuda
    report = run_tests(tmp_path, 120, ["tests"])
    assert report["exit_code"] == 1
    assert report["passed"] == 1
    assert report["failed"] == ["tests.test_some::test_bad"]
    assert report["skipped"] == {"no TensorRT": 1}
    assert run_tests(tmp_path / "nowhere", 120) == {
        "skipped": f"no tests/ in {tmp_path / 'nowhere'}: run from a checkout of the repository"}


def test_run_tests_collects_the_grouped_modules_without_xdist():
    """The cuda tests run with `-p no:xdist`: the xdist_group marks of the expert-parallel modules must still be
    known markers under --strict-markers (pyproject registers them), or every such module fails to import (the
    first H200 run found it: 3 collection errors, no test run). Here their cuda tests skip without a GPU."""
    root = Path(__file__).resolve().parents[2]
    report = run_tests(root, 300, ["tests/runtime/test_expert_parallel.py",
                                   "tests/runtime/test_expert_parallel_fixed.py"])
    assert report["exit_code"] == 0, report.get("error")
    assert report["failed"] == []
    if not torch.cuda.is_available():
        assert report["passed"] == 0 and sum(report["skipped"].values()) == 4, report["skipped"]


def _engine(batch: int, ours: float, theirs: float) -> dict:
    rows = [{"impl": "moeserve Engine", "decode_tokens_per_s": ours / 3, "same_tokens": True},
            {"impl": "moeserve Engine, compiled decode", "decode_tokens_per_s": ours, "same_tokens": False},
            {"impl": "transformers generate (eager)", "decode_tokens_per_s": theirs, "same_tokens": False},
            {"impl": "transformers generate (grouped_mm)", "decode_tokens_per_s": theirs / 2, "same_tokens": False}]
    if batch == 1:
        for r in rows:
            r["pct_of_read_bandwidth"] = round(r["decode_tokens_per_s"] / 20, 1)
    return {"results": rows}


def test_goals_take_the_fastest_of_each_side_and_the_page_shows_them():
    engine = {"1": _engine(1, 600.0, 150.0), "32": _engine(32, 5000.0, 2000.0)}
    # the quantized rows are not bf16's: they answer issue 39's goal, int8 against the fastest bf16 row
    engine["1"]["results"] += [{"impl": "moeserve Engine, int8, compiled decode", "decode_tokens_per_s": 960.0,
                                "same_tokens": False},
                               {"impl": "moeserve Engine, int4, compiled decode", "decode_tokens_per_s": 1500.0,
                                "same_tokens": False}]
    got = goals(engine)
    assert got.pop("int8_batch_1") == {"ours": "moeserve Engine, int8, compiled decode",
                                       "theirs": "moeserve Engine, compiled decode", "decode_speedup": 1.6,
                                       "decode_speedup_goal": 1.5}
    assert got == {
        "batch_1": {"ours": "moeserve Engine, compiled decode", "theirs": "transformers generate (eager)",
                    "decode_speedup": 4.0, "decode_speedup_goal": 3.0, "pct_of_read_bandwidth": 30.0,
                    "pct_of_read_bandwidth_goal": 50.0},
        "batch_32": {"ours": "moeserve Engine, compiled decode", "theirs": "transformers generate (eager)",
                     "decode_speedup": 2.5, "decode_speedup_goal": 2.0}}
    report = {"gpu": "H100", "cuda": "13.0", "model": "m", "engine": engine, "goals": got,
              "tests": {"passed": 3, "failed": ["t::x"], "skipped": {"no TensorRT": 2}, "seconds": 9.0,
                        "command": "python -m pytest -m cuda"},
              "live_length": {"context_tokens": 100, "ratio": 1.01,
                              "contexts": {"2048": {"decode_ms": 1.5}, "32768": {"decode_ms": 1.515}}},
              "skipped": {"served": "not part of this run"}, "seconds": {"total": 300.0}}
    page = markdown(report)
    assert "cuda tests: 3 passed, 1 failed, 2 skipped in 9.0 s" in page
    assert "- skipped (2): no TensorRT" in page
    assert "| batch_1: % of read bandwidth | 30.0% | 50.0% |" in page
    assert "2048-token context 1.5 ms a step, 32768-token context 1.515 ms a step (ratio 1.01)" in page
    assert "skipped served: not part of this run" in page
    report["served"] = {"clients": 32, "input_len": 128, "output_len": 64, "client_procs": 4, "ratio": 5.0,
                        "cuda": {"requests_per_s": 90.0, "itl_ms_p50": 3.1, "ready_s": 70.2, "tokens_by_path": {
                            "decode": {"graph": 900, "eager": 0}, "prefill": {"graph": 1200, "eager": 128}}},
                        "2 CPU cores": {"requests_per_s": 18.0, "itl_ms_p50": 20.0, "ready_s": 5.0}}
    report["served"]["cuda"]["profile"] = {"requests_per_s": 70.0, "turns_per_s": 250.0, "model_thread_busy": 0.97,
                                           "model_thread_cpu": 0.6, "model_thread_runnable": 0.05,
                                           "device_busy": 0.13, "ms_per_turn": {"turn": 3.9, "plan": 0.2,
                                                                                 "decode": 0.5, "sample": 2.5}}
    page = markdown(report)
    assert "Served, 32 clients (4 load-generating processes), 128-token prompts, 64 out:" in page
    assert ("- cuda: 90.0 req/s, ITL p50 3.1 ms, ready in 70.2 s; decode tokens graph 900, eager 0; prefill tokens "
            "graph 1200, eager 128") in page
    assert ("  - profiled (70.0 req/s under the profiler): 250.0 turns/s, the model thread busy 97% (on a core 60%, "
            "waiting for one 5%), the device 13%; ms a turn: 3.900 (plan 0.200, decode 0.500, sample 2.500)") in page
    assert "- 2 CPU cores: 18.0 req/s, ITL p50 20.0 ms, ready in 5.0 s" in page


def test_with_context_rewrites_the_config_and_links_the_weights(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 1024, "hidden_size": 8}))
    (src / "model.safetensors").write_bytes(b"weights")
    out = with_context(src, 32768, tmp_path / "long")
    assert json.loads((out / "config.json").read_text()) == {"max_position_embeddings": 32768, "hidden_size": 8}
    assert (out / "model.safetensors").read_bytes() == b"weights" and (out / "model.safetensors").is_symlink()
    assert json.loads((src / "config.json").read_text())["max_position_embeddings"] == 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without a GPU")
def test_refused_without_a_gpu(capsys):
    from moeserve.cli import main  # the exit status of a real process is main()'s: tests/test_cli.py

    assert main(["bench", "gpu", "--skip-tests"]) == 2
    assert "moeserve bench gpu: no CUDA device here (torch.cuda.is_available() is False)" in capsys.readouterr().err
    assert main(["bench", "gpu", "--skip-engine", "--plot", "gpu.png"]) == 2  # before anything runs, GPU or not
    assert "--plot draws the engine bench's batch 1, which --skip-engine leaves out" in capsys.readouterr().err


def test_each_part_is_saved_as_it_ends(monkeypatch, tmp_path):
    """A GPU lent for minutes can go mid-run: `save` gets the report after the tests and after each engine batch,
    and main's save_partial writes it to --json marked partial. The GPU parts are stood in for here; the run
    itself is made on a GPU."""
    from moeserve.bench import gpu

    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu.torch.cuda, "get_device_name", lambda i=0: "a GPU")
    monkeypatch.setattr(gpu, "run_tests", lambda root, timeout: {"passed": 3, "failed": [], "skipped": {}})
    monkeypatch.setattr(gpu, "write_mixtral", lambda path, size, dtype: path)
    monkeypatch.setattr(gpu, "bench_engine", lambda *a, batch, **kw: _engine(batch, 100.0 * batch, 50.0 * batch))

    def taken_back(*a, **kw):
        raise RuntimeError("the machine was taken back")

    monkeypatch.setattr(gpu, "live_length", taken_back)
    saved = []
    monkeypatch.setattr(gpu, "default_model_dir", lambda: tmp_path / "not-trained")
    report = gpu.bench_gpu(save=lambda r: saved.append(json.loads(json.dumps(r))), progress=lambda msg: None)
    assert [sorted(r.get("engine", {})) for r in saved] == [[], ["1"], ["1", "32"]]
    assert saved[0]["tests"]["passed"] == 3
    assert report["errors"] == {"live length": "RuntimeError: the machine was taken back"}
    assert report["skipped"]["served"].startswith(f"the built-in model is not cached here ({tmp_path / 'not-trained'})")
    # where it is cached, the served part runs and its ratio is a goal on the page
    (tmp_path / "not-trained").mkdir()
    (tmp_path / "not-trained" / "config.json").write_text("{}")
    traces = []
    monkeypatch.setattr(gpu, "served", lambda model, profile_dir: traces.append(profile_dir) or {"ratio": 4.9,
                                                                                               "goal": 10.0})
    report = gpu.bench_gpu(progress=lambda msg: None, profile_dir=tmp_path / "gpu-profiles")
    assert traces == [tmp_path / "gpu-profiles"]
    assert report["goals"]["served"] == {"ours": "the GPU server", "theirs": "2 CPU cores' server", "speedup": 4.9,
                                         "speedup_goal": 10.0}
    page = markdown(report | {"live_length": None, "tests": None})
    assert "| served: the GPU server / 2 CPU cores' server | 4.9x | 10.0x |" in page
    assert "served" not in gpu.bench_gpu(progress=lambda msg: None, serve=False)["goals"]
    # the second half of a split run (--skip-tests --skip-engine): the served part alone, no Mixtral written
    with monkeypatch.context() as m:
        m.setattr(gpu, "write_mixtral", taken_back)
        served_only = gpu.bench_gpu(progress=lambda msg: None, tests=False, engine=False)
    assert served_only["engine"] == {} and served_only["model"] is None and "live_length" not in served_only
    assert served_only["skipped"]["engine"].startswith("--skip-engine") and served_only["errors"] == {}
    assert list(served_only["goals"]) == ["served"] and "engine" not in served_only["seconds"]
    assert "model -" in markdown(served_only | {"tests": None})
    real_find_spec = gpu.importlib.util.find_spec
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda m: None if m == "uvicorn" else real_find_spec(m))
    assert gpu.bench_gpu(progress=lambda msg: None)["skipped"]["served"].startswith("uvicorn not installed")
    out = tmp_path / "gpu.json"
    gpu.save_partial(out, saved[1])
    assert json.loads(out.read_text()) == {"partial": True, **saved[1]}
    gpu.save_partial(None, saved[1])  # no --json: nothing written


def test_on_cores_pins_to_cores_this_process_has():
    have = sorted(os.sched_getaffinity(0))
    assert on_cores(len(have) + 1) is None  # more than there are
    pin = on_cores(1)
    if pin is not None:  # taskset is installed
        assert pin == ["taskset", "-c", str(have[0])]


@pytest.mark.slow
@pytest.mark.skipif(on_cores(2) is None, reason="needs taskset and two cores")
def test_served_runs_both_servers_and_gives_their_ratio(tmp_path):
    """Two real `moeserve serve` processes under `bench serve`, the CPU standing in for the GPU side."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", max_seq_len=256))
    ckpt = save_checkpoint(tmp_path / "tiny", model.cfg, model.state_dict())
    got = served(ckpt, device="cpu", clients=2, duration_s=1.5, input_len=8, output_len=4,
                 profile_dir=tmp_path / "profiles")
    gpu_side, cpu_side = got["cpu"], got["2 CPU cores"]
    assert cpu_side["command"].startswith("taskset -c ") and cpu_side["command"].endswith("--threads 2")
    assert gpu_side["command"] == "moeserve serve --device cpu --kv-slots 2"
    assert gpu_side["errors"] == cpu_side["errors"] == {} and gpu_side["requests_per_s"] > 0
    assert got["ratio"] == round(gpu_side["requests_per_s"] / cpu_side["requests_per_s"], 2)
    assert got["goal"] == 10.0
    assert all(0 < side["ready_s"] < 420 for side in (gpu_side, cpu_side))
    if Path(f"/proc/{os.getpid()}/task").is_dir():  # each server's event loop and model thread worked
        for side in (gpu_side, cpu_side):
            assert side["server_cores_busy"]["main"] > 0 and side["server_cores_busy"][MODEL_THREAD] > 0, side
            assert side["server_cores_busy"][MODEL_THREAD] <= 1.1, side  # one thread: its OpenMP team apart
            assert "server threads, cores busy: " in "\n".join(served_lines(got))
    for side in (gpu_side, cpu_side):  # a level under each server's profiler, its trace kept
        prof = side["profile"]
        assert prof["requests_per_s"] > 0 and prof["turns_per_s"] > 0 and 0 < prof["model_thread_busy"] <= 1
        assert prof["device_busy"] is None and prof["ms_per_turn"]["decode"] > 0, prof
        assert 0 < prof["model_thread_cpu"] <= 1, prof
        assert Path(prof["trace"]).parent.parent == tmp_path / "profiles" and Path(prof["trace"]).exists()
    assert "  - profiled (" in "\n".join(served_lines(got))
    for side in (gpu_side, cpu_side):  # each server's /metrics, read before it stopped: no graph on a CPU by default
        paths = side["tokens_by_path"]
        assert paths["decode"]["graph"] == paths["prefill"]["graph"] == 0, paths
        assert paths["decode"]["eager"] > 0 and paths["prefill"]["eager"] >= 8, paths


NAMED = "moeserve-t3st"  # no other thread of this process has it (a server's model thread may linger here)


@LINUX_PROC
def test_name_team_renames_the_threads_the_model_thread_started():
    """Linux names a new thread after its creator: torch's OpenMP team would read as the model thread. After the
    warm-up, the server renames the threads with its name but itself; the model thread keeps its own."""
    comm = lambda tid: Path(f"/proc/self/task/{tid}/comm").read_text().strip()  # noqa: E731
    seen, done = {}, threading.Event()

    def model() -> None:
        name_os_thread("moeserve-t3ad")  # not NAMED: an OS thread outlives its join by a moment
        child = threading.Thread(target=done.wait)
        child.start()
        seen["child before"] = comm(child.native_id)
        name_team("moeserve-t3ad", "moeserve-t3am")
        seen["child after"], seen["itself"] = comm(child.native_id), comm(threading.get_native_id())
        done.set()
        child.join()

    t = threading.Thread(target=model)
    t.start()
    t.join()
    assert seen == {"child before": "moeserve-t3ad", "child after": "moeserve-t3am", "itself": "moeserve-t3ad"}


@LINUX_PROC
def test_thread_cpu_sums_by_the_name_the_os_knows():
    """A thread that names itself for the OS is counted apart from the main thread and the unnamed ones; what it
    burns between two readings shows as cores busy under its name; a process that is gone reads as nothing."""
    spun = threading.Event()

    def spin(name: str | None) -> None:
        if name:
            name_os_thread(name)
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.wait()

    before = thread_cpu(os.getpid())
    t0 = time.perf_counter()
    threads = [threading.Thread(target=spin, args=(n,)) for n in (NAMED, None)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while thread_cpu(os.getpid()).get(NAMED, 0.0) < 0.29 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = thread_cpu(os.getpid())
    spun.set()
    for t in threads:
        t.join()
    assert "main" in before and after["main"] >= before["main"]
    # the named thread's 0.3 s under its name, the unnamed one's not with it
    assert NAMED not in before and 0.29 <= after[NAMED] < 0.55, after
    busy = cores_busy(before, after, time.perf_counter() - t0)
    assert busy[NAMED] > 0 and all(v > 0 for v in busy.values()), busy
    assert thread_cpu(2**22 + 12345) == {}  # above the kernel's pid_max: no such process
