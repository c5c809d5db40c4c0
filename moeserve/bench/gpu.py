"""`moeserve bench gpu`: the one run whoever has a GPU makes first, written to one JSON.

It runs, on the first CUDA device:
1. the `cuda` tests (pytest -m cuda over the runtime, the engine bench and the exports): fp32 parity with the CPU,
   bf16 within its rounding, no host sync in a replay, graphs used, ONNX Runtime CUDA and TensorRT parity where
   those are installed. Each skip comes back with its reason;
2. `moeserve bench engine` on the 2.4B Mixtral in bf16 at batch 1 and 32: eager, compiled with indexed experts,
   compiled with grouped_mm experts, and transformers' `generate` on the same weights in the same run; at batch 1
   also compiled with GEMV experts (decode_reduce_max), and on int8, int4 and fp8 weights quantized at load;
3. decode at ~100 tokens of context for the same weights declared with a 2k and a 32k context: a step reads the
   keys its rows can see, not the whole cache, so the two should match;
4. the built-in model served (`moeserve serve`, `bench serve`'s closed loop of 32 clients) on the GPU and on two of
   this machine's CPU cores, where it is cached here (`served`), with each server's threads' CPU over the load:
   a GPU server's model thread near one core busy is bound by its host work, not by the GPU.

The issue's goals are computed from those numbers (`goals`), each with the value it asks for. What could not run
here is in `skipped`, with why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from moeserve.bench.engine import _sync, bench_engine, write_mixtral
from moeserve.bench.report import BenchError, run_bench
from moeserve.bench.serve import ServeBenchConfig, bench_serve
from moeserve.bench.server_process import ServerLog, cores_busy, running_server, thread_cpu
from moeserve.runtime import GPU_QUANT_FORMATS, QUANT_FORMATS
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.training.default_model import default_model_dir

TESTS = ["tests/runtime", "tests/bench/test_engine_bench.py", "tests/export/test_tensorrt.py",
         "tests/export/test_onnx_cuda.py"]
CONTEXTS = (2048, 32768)
BATCHES = (1, 32)
QUANTIZED = QUANT_FORMATS + GPU_QUANT_FORMATS  # batch 1 again on each weight format (issue 39's GPU goal)
PATH_COUNTERS = ("moeserve_decode_tokens", "moeserve_prefill_tokens")  # read from a served run's /metrics
SERVED_CLIENTS, SERVED_CORES, SERVED_GOAL = 32, 2, 10.0  # issue 40: the GPU server >= 10x two CPU cores' req/s
SERVED_READY_S = 420.0  # a GPU server compiles its decode and prompt graphs before it says ready
SERVED_CLIENT_PROCS = 4  # the load generator's processes: 4 x ~10k tokens/s, past the 10x goal's ~11k
PROFILE_S = 2.0  # a second level under the server's profiler (where a turn's time goes): short, its trace is large


def run_tests(root: Path, timeout: float, paths: list[str] = TESTS) -> dict:
    """pytest -m cuda over `paths` in a child process: counts, the failures' names, each skip reason's count."""
    if not (root / "tests").is_dir():
        return {"skipped": f"no tests/ in {root}: run from a checkout of the repository"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-p", "no:xdist",
               f"--junitxml={xml}", *paths]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"command": " ".join(cmd[1:]), "exit_code": None, "error": f"still running after {timeout:.0f} s"}
        report = {"command": " ".join(["python", *cmd[1:]]).replace(f" --junitxml={xml}", ""),
                  "exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if not xml.exists():
            return report | {"error": (proc.stdout + proc.stderr)[-2000:]}
        passed, failed, skipped = 0, [], Counter()
        for case in ET.parse(xml).iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
            elif (skip := case.find("skipped")) is not None:
                skipped[skip.get("message", "")] += 1
            else:
                passed += 1
    return report | {"passed": passed, "failed": failed, "skipped": dict(skipped)}


def with_context(path: Path, context: int, into: Path) -> Path:
    """The checkpoint at `path` declared with a `context`-token context: its config rewritten, its weights linked."""
    into.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json" and not (into / f.name).exists():
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((path / "config.json").read_text())
    (into / "config.json").write_text(json.dumps(config | {"max_position_embeddings": context}))
    return into


def live_length(path: Path, contexts=CONTEXTS, context_tokens: int = 100, new_tokens: int = 32,
                repeats: int = 5, device: str = "cuda", dtype: str = "bfloat16", progress=print) -> dict:
    """ms per decode step (compiled, batch 1) from `context_tokens` of context, for each declared context."""
    rows = {}
    prompt = torch.randint(0, 1000, (1, context_tokens), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        for context in contexts:
            progress(f"live length: {context}-token context ...")
            engine = Engine.load(with_context(path, context, Path(tmp) / str(context)), dtype=dtype,
                                 device=device, compile="on")
            engine.runner.graph_prefill = False  # decode is timed here: the prompt eager, no prompt graphs to build
            t0 = time.perf_counter()
            engine.executor.warm_up(1)

            def generate(n: int) -> float:
                _sync(device)
                t = time.perf_counter()
                engine.complete(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
                _sync(device)
                return time.perf_counter() - t

            generate(new_tokens + 1)
            build_s = time.perf_counter() - t0
            steps = [(generate(new_tokens + 1) - generate(1)) / new_tokens for _ in range(repeats)]
            rows[str(context)] = {"decode_ms": round(1e3 * statistics.median(steps), 3),
                                  "spans": engine.runner._decode.spans, "warm_up_s": round(build_s, 1)}
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    first, last = (rows[str(c)]["decode_ms"] for c in (contexts[0], contexts[-1]))
    return {"context_tokens": context_tokens, "new_tokens": new_tokens, "contexts": rows,
            "ratio": round(last / first, 3)}


def _quantized(impl: str) -> str | None:
    """The weight format of a `bench engine --quantize` row ("moeserve Engine, int8, compiled decode"), or None."""
    return next((f for f in QUANT_FORMATS if f", {f}" in impl), None)


def on_cores(n: int) -> list[str] | None:
    """A command prefix that runs a process on `n` of this process's CPU cores (`taskset -c`), or None where
    taskset or that many cores are missing."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if shutil.which("taskset") is None or len(cores) < n:
        return None
    return ["taskset", "-c", ",".join(map(str, cores[:n]))]


@contextlib.contextmanager
def pinned(cores: list[int]):
    """This process (and what it starts meanwhile) on `cores`, then as before; nowhere new where `cores` is empty."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if not cores or before is None:
        yield
        return
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def served(checkpoint: Path, device: str = "cuda", clients: int = SERVED_CLIENTS, cores: int = SERVED_CORES,
           duration_s: float = 15.0, input_len: int = 128, output_len: int = 64,
           profile_dir: Path | None = None) -> dict:
    """Issue 40's served goal, in one run: `checkpoint` served on `device` with a cache slot a client, then on
    `cores` CPU cores (taskset, --device cpu --threads cores, its default slots), each under `bench serve`'s closed
    loop of `clients` streams; req/s of each, and their ratio. The load generator runs on the other cores, in up to
    SERVED_CLIENT_PROCS processes: one process streams ~10k tokens/s at most, less than the goal asks of the GPU.
    Then a short level under each server's profiler (`profiled`), its traces in `profile_dir` (None: a temporary
    directory, the summaries kept)."""
    prefix = on_cores(cores)
    if prefix is None:
        raise BenchError(f"cannot pin a server to {cores} cores here (taskset, or as many cores, is missing)")
    rest = sorted(os.sched_getaffinity(0))[cores:]
    procs = max(1, min(SERVED_CLIENT_PROCS, len(rest)))
    out = {"clients": clients, "input_len": input_len, "output_len": output_len, "duration_s": duration_s,
           "client_procs": procs, "client_cores": len(rest) or "shared with the servers"}
    with contextlib.ExitStack() as stack:
        traces = profile_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for name, pin, extra in [(device, [], ["--device", device, "--kv-slots", str(clients)]),
                                 (f"{cores} CPU cores", prefix, ["--device", "cpu", "--threads", str(cores)])]:
            log, t0 = ServerLog(), time.perf_counter()
            profiling = ["--profile-dir", str(traces / name.replace(" ", "-"))]
            with running_server(checkpoint, "auto", extra + profiling, log, prefix=pin,
                                ready_timeout_s=SERVED_READY_S) as url:
                ready_s = time.perf_counter() - t0
                cfg = ServeBenchConfig(url=url, concurrency=(clients,), duration_s=duration_s,
                                       input_len=(input_len, input_len), output_len=(output_len, output_len),
                                       timeout_s=120, client_procs=procs)
                with pinned(rest):
                    before = thread_cpu(log.pid)
                    level = bench_serve(cfg)["levels"][0]
                    after = thread_cpu(log.pid)
                paths = call_paths(url)
                with pinned(rest):
                    profile = profiled(url, cfg)
                if profile_dir is None:  # the trace went with the temporary directory
                    del profile["trace"]
            out[name] = {"command": " ".join([*pin, "moeserve serve", *extra]), "requests_per_s":
                         round(level["requests_per_s"], 2), "itl_ms_p50": round(level["itl_ms"]["p50"], 2),
                         "errors": level["errors"], "tokens_by_path": paths, "ready_s": round(ready_s, 1),
                         "server_cores_busy": cores_busy(before, after, level["wall_s"]), "profile": profile}
    out["ratio"] = round(out[device]["requests_per_s"] / max(out[f"{cores} CPU cores"]["requests_per_s"], 1e-9), 2)
    out["goal"] = SERVED_GOAL
    return out


def profiled(url: str, cfg: ServeBenchConfig, seconds: float = PROFILE_S) -> dict:
    """`cfg`'s load again for `seconds`, between the server's POST /start_profile and /stop_profile: where its model
    thread's turns went, by phase, how busy that thread and the device were (the profiler's own cost included: this
    level's req/s says how much), and where the trace is."""
    _post(f"{url}/start_profile")
    level = bench_serve(dataclasses.replace(cfg, duration_s=seconds))["levels"][0]
    report = _post(f"{url}/stop_profile")
    per_turn = {name: p["ms_per_turn"] for name, p in report["phases"].items()}
    return {"requests_per_s": round(level["requests_per_s"], 2), "turns_per_s": round(report["turns"] /
            max(report["span_s"], 1e-9), 1), "model_thread_busy": report["model_thread_busy"],
            "model_thread_cpu": report["model_thread_cpu"], "model_thread_runnable": report["model_thread_runnable"],
            "device_busy": report["device_busy"], "ms_per_turn": per_turn, "trace": report["trace"]}


def _post(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=120) as r:
        return json.loads(r.read())


def call_paths(url: str) -> dict:
    """The server's decode and prompt tokens by how their calls ran (moeserve_{decode,prefill}_tokens_total{path}):
    on a GPU both should be nearly all "graph" under load."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {f.name.removeprefix("moeserve_").removesuffix("_tokens"): {s.labels["path"]: int(s.value) for s in f.samples
                                                                       if s.name.endswith("_total")}
            for f in text_string_to_metric_families(text) if f.name in PATH_COUNTERS}


def goals(engine: dict) -> dict:
    """Issue 40's performance goals against this run's numbers (moeserve's fastest bf16 row against transformers'),
    and issue 39's at batch 1: the fastest int8 row against that bf16 row."""
    out = {}
    for batch, report in engine.items():
        rows = report["results"]
        fastest = lambda rs: max(rs, key=lambda r: r["decode_tokens_per_s"])  # noqa: E731
        ours = fastest([r for r in rows if r["impl"].startswith("moeserve") and not _quantized(r["impl"])])
        theirs = fastest([r for r in rows if r["impl"].startswith("transformers")])
        speedup = round(ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 2)
        goal = {"ours": ours["impl"], "theirs": theirs["impl"], "decode_speedup": speedup,
                "decode_speedup_goal": 3.0 if batch == "1" else 2.0}
        if "pct_of_read_bandwidth" in ours:
            goal |= {"pct_of_read_bandwidth": ours["pct_of_read_bandwidth"], "pct_of_read_bandwidth_goal": 50.0}
        out[f"batch_{batch}"] = goal
        int8 = [r for r in rows if _quantized(r["impl"]) == "int8"]
        if batch == "1" and int8:
            best = fastest(int8)
            out["int8_batch_1"] = {"ours": best["impl"], "theirs": ours["impl"], "decode_speedup_goal": 1.5,
                                   "decode_speedup": round(best["decode_tokens_per_s"] / ours["decode_tokens_per_s"], 2)}
    return out


@contextlib.contextmanager
def _kept(errors: dict, part: str):
    """A part that fails is written down and the run goes on: one GPU run is all a session may get."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure is a finding of the run, kept in its report
        errors[part] = f"{type(e).__name__}: {e}"[:2000]


def bench_gpu(checkpoint: Path | None = None, tests: bool = True, root: Path | None = None,
              test_timeout: float = 240.0, progress=print, save=None, serve: bool = True,
              profile_dir: Path | None = None, engine: bool = True) -> dict:
    """The run (module docstring). `save(report)`, if given, after each part with what is measured so far: a GPU
    lent for minutes can be taken back mid-run, and the parts done should survive it (`main` writes them to --json,
    marked partial, until the whole report replaces them). `profile_dir`: where the served servers' profiler traces
    go (`main`: beside --json)."""
    save = save or (lambda report: None)
    if not torch.cuda.is_available():
        raise BenchError("no CUDA device here (torch.cuda.is_available() is False): this bench is for a GPU")
    started = time.perf_counter()
    seconds, skipped = {}, {}
    root = root or Path(__file__).resolve().parents[2]
    report: dict = {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    if tests:
        progress("cuda tests ...")
        report["tests"] = run_tests(root, test_timeout)
        seconds["tests"] = round(time.perf_counter() - started, 1)
        if "skipped" in report["tests"] and isinstance(report["tests"]["skipped"], str):
            skipped["tests"] = report["tests"]["skipped"]
        save(report)
    else:
        skipped["tests"] = "--skip-tests"
    report["model"], report["engine"], errors = None, {}, {}
    if not engine:
        skipped["engine"] = "--skip-engine: the 2.4B Mixtral's engine bench and its decode over two contexts"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            if checkpoint is None:
                progress("writing a random 2.4B Mixtral (bf16) with transformers ...")
                checkpoint = write_mixtral(Path(tmp) / "mixtral-2.4b", "2.4b", dtype=torch.bfloat16)
            report["model"] = str(checkpoint)
            for batch in BATCHES:
                progress(f"bench engine, batch {batch} ...")
                with _kept(errors, f"engine batch {batch}"):
                    report["engine"][str(batch)] = bench_engine(
                        ["bfloat16"], new_tokens=64, repeats=3, checkpoint=checkpoint, compiled=True, device="cuda",
                        batch=batch, quantize=QUANTIZED if batch == 1 else (), progress=lambda msg: None)
                save(report | {"errors": errors})
            seconds["engine"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            with _kept(errors, "live length"):
                report["live_length"] = live_length(checkpoint, progress=progress)
            seconds["live_length"] = round(time.perf_counter() - t0, 1)
    report["goals"] = goals(report["engine"])
    report["errors"] = errors
    model = default_model_dir()
    if not serve:
        skipped["served"] = "--skip-served"
    elif missing := [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]:
        skipped["served"] = (f"{', '.join(missing)} not installed: the server and its load generator need them "
                             "(fastapi and uvicorn come with `pip install -e .`, httpx with the dev extra)")
    elif not (model / "config.json").exists():
        skipped["served"] = (f"the built-in model is not cached here ({model}): run `moeserve serve` once, or give "
                             "$MOESERVE_CACHE a cache that holds it")
    else:
        progress("the built-in model served on the GPU and on 2 CPU cores ...")
        t0 = time.perf_counter()
        with _kept(errors, "served"):
            report["served"] = served(model, profile_dir=profile_dir)
            report["goals"]["served"] = {"ours": "the GPU server", "theirs": "2 CPU cores' server",
                                         "speedup": report["served"]["ratio"], "speedup_goal": SERVED_GOAL}
        seconds["served"] = round(time.perf_counter() - t0, 1)
    report["skipped"] = skipped
    seconds["total"] = round(time.perf_counter() - started, 1)
    report["seconds"] = seconds
    return report


def markdown(report: dict) -> str:
    lines = [f"GPU: {report['gpu']} (CUDA {report['cuda']}), model {report.get('model') or '-'}", ""]
    t = report.get("tests")
    if t and "passed" in t:
        lines += [f"cuda tests: {t['passed']} passed, {len(t['failed'])} failed, {sum(t['skipped'].values())} skipped "
                  f"in {t['seconds']} s (`{t['command']}`)"]
        lines += [f"- failed: {name}" for name in t["failed"]]
        lines += [f"- skipped ({n}): {why}" for why, n in t["skipped"].items()]
        lines += [""]
    elif t:
        lines += [f"cuda tests: {t.get('error') or t.get('skipped')}", ""]
    lines += ["| batch | implementation | decode tokens/s | same tokens | % of read bandwidth |",
              "| ---: | --- | ---: | --- | ---: |"]
    for batch, r in report["engine"].items():
        for row in r["results"]:
            lines.append(f"| {batch} | {row['impl']} | {row['decode_tokens_per_s']} | "
                         f"{'yes' if row['same_tokens'] else 'no'} | {row.get('pct_of_read_bandwidth', '-')} |")
    ll = report.get("live_length") or {"context_tokens": "-", "contexts": {}, "ratio": "-"}
    lines += ["", f"Decode at {ll['context_tokens']} tokens of context (compiled, batch 1): "
              + ", ".join(f"{c}-token context {v['decode_ms']} ms a step" for c, v in ll["contexts"].items())
              + f" (ratio {ll['ratio']})", "", "| goal | measured | asked |", "| --- | ---: | ---: |"]
    for name, g in report["goals"].items():
        speedup, goal = (g["speedup"], g["speedup_goal"]) if "speedup" in g else (g["decode_speedup"],
                                                                                 g["decode_speedup_goal"])
        lines.append(f"| {name}: {g['ours']} / {g['theirs']} | {speedup}x | {goal}x |")
        if "pct_of_read_bandwidth" in g:
            lines.append(f"| {name}: % of read bandwidth | {g['pct_of_read_bandwidth']}% | "
                         f"{g['pct_of_read_bandwidth_goal']}% |")
    lines += served_lines(report.get("served"))
    lines += [""] + [f"skipped {k}: {why}" for k, why in report["skipped"].items()]
    lines += [f"error in {k}: {why}" for k, why in report.get("errors", {}).items()]
    lines += [f"seconds: {report['seconds']}"]
    return "\n".join(lines)


def served_lines(served: dict | None) -> list[str]:
    """Each server of the served part: req/s, ITL, time to ready, and its calls by path (graph / eager)."""
    if not served:
        return []
    out = ["", f"Served, {served.get('clients', '-')} clients ({served.get('client_procs', 1)} load-generating "
               f"processes), {served.get('input_len', '-')}-token prompts, {served.get('output_len', '-')} out:"]
    for name, side in served.items():
        if not isinstance(side, dict):
            continue
        paths = "; ".join(f"{kind} tokens {', '.join(f'{p} {n}' for p, n in by.items())}"
                          for kind, by in side.get("tokens_by_path", {}).items())
        busy = ", ".join(f"{thread} {cores}" for thread, cores in side.get("server_cores_busy", {}).items())
        out.append(f"- {name}: {side['requests_per_s']} req/s, ITL p50 {side['itl_ms_p50']} ms, ready in "
                   f"{side.get('ready_s', '-')} s{'; ' + paths if paths else ''}"
                   f"{'; server threads, cores busy: ' + busy if busy else ''}")
        if prof := side.get("profile"):
            device = "" if prof["device_busy"] is None else f", the device {prof['device_busy']:.0%}"
            runnable = prof["model_thread_runnable"]
            waiting = "" if runnable is None else f", waiting for one {runnable:.0%}"
            phases = ", ".join(f"{p} {ms:.3f}" for p, ms in prof["ms_per_turn"].items() if p != "turn")
            out.append(f"  - profiled ({prof['requests_per_s']} req/s under the profiler): {prof['turns_per_s']} "
                       f"turns/s, the model thread busy {prof['model_thread_busy']:.0%} (on a core "
                       f"{prof['model_thread_cpu']:.0%}{waiting}){device}; ms a turn: "
                       f"{prof['ms_per_turn'].get('turn', 0):.3f} ({phases})")
    return out


def plot(report: dict, path: Path) -> None:
    from moeserve.bench.engine import plot as engine_plot

    engine_plot(report["engine"]["1"] | {"bench": "engine"}, path)


def save_partial(path: Path | None, report: dict) -> None:
    """What `bench_gpu` has measured so far, at the --json path (replaced by the whole report at the end)."""
    if path is not None:
        path.write_text(json.dumps({"partial": True, **report}, indent=1, allow_nan=False))


def main(args) -> int:
    if args.skip_engine and args.plot is not None:
        print("moeserve bench gpu: --plot draws the engine bench's batch 1, which --skip-engine leaves out",
              file=sys.stderr)
        return 2
    traces = args.json.with_name(f"{args.json.stem}-profiles") if args.json is not None else None
    report = run_bench(args, "gpu", lambda progress: bench_gpu(args.checkpoint, tests=not args.skip_tests,
                                                               progress=progress, serve=not args.skip_served,
                                                               save=lambda r: save_partial(args.json, r),
                                                               profile_dir=traces, engine=not args.skip_engine))
    if report is None:
        return 2
    failed = report.get("tests", {}).get("failed")
    return 1 if failed or report.get("tests", {}).get("error") or report["errors"] else 0

