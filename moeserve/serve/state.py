"""What the server's parts share: its configuration (config.py), and the state of the one model it serves.

`ServerState` owns the model's thread (load, warm up, run the runner: runner.py) and the lifecycle flags that
the gate (gate.py) and the handlers (routes.py) read: ready, draining, the load error. The model is an Engine in
this process (its runner the Batcher), or a runner that sends the requests elsewhere (the expert-parallel ranks:
ep_router.py), which the loader returns instead of an Engine.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from moeserve.chat import ChatTemplate, load_chat_template
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.profiling import StepProfiler, prepare as prepare_profiler
from moeserve.serve.batcher import Batcher, Closed, Job, Place, QueueFull
from moeserve.serve.config import ServeConfig
from moeserve.serve.metrics import Metrics
from moeserve.serve.protocol import ApiError
from moeserve.serve.runner import Runner, ServedModel

log = logging.getLogger("moeserve.serve")
MODEL_THREAD = "moeserve-model"  # the thread that owns the model, by this name in the OS too (name_os_thread)
MODEL_TEAM = "moeserve-omp"  # the threads it starts: torch's OpenMP team (name_team)
PLACE = "moeserve.place"  # the ASGI scope key of an admitted request's place in the queue (serve/gate.py)


class ServerState:
    """What the handlers share: the model once loaded (`engine`: an Engine, or the ModelFacts of a model whose
    weights are elsewhere), the runner its requests go to, and the lifecycle flags."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.engine: ServedModel | None = None
        self.chat_template: ChatTemplate | None = None
        self.runner: Runner | None = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.name = cfg.model_name or "model"
        self.created = int(time.time())
        self.on_fatal: Callable[[], None] | None = None  # the server's exit, called if the model fails to load
        self._thread: threading.Thread | None = None
        self.torch_threads: int | None = None  # what the model's thread runs torch ops with, once loaded

    @property
    def batcher(self) -> Batcher | None:
        """The runner where it is this process's Batcher (the tests that hold its steps read it)."""
        return self.runner if isinstance(self.runner, Batcher) else None

    def start(self, source: Engine | Callable[[], Engine | Runner]) -> None:
        """Start the one thread that owns the model: it loads it (given a loader), warms it up, then runs
        the batcher. One thread for all model work, because each thread that runs torch ops gets its own
        OpenMP team, and a second team spinning beside the first makes both slower."""
        if self.cfg.profile_dir is not None:
            prepare_profiler()  # here, on the thread that imported torch
        self._thread = threading.Thread(target=self._own_model, args=(source,), name=MODEL_THREAD, daemon=True)
        self._thread.start()

    def _own_model(self, source: Engine | Callable[[], Engine | Runner]) -> None:
        name_os_thread(MODEL_THREAD)
        if self.cfg.threads is not None:
            torch.set_num_threads(self.cfg.threads)
        try:
            made = source if isinstance(source, Engine) else source()
            if isinstance(made, Engine) and made.runner.name == "onnx" and made.runner.device.type == "cpu":
                # The session has the model's threads; torch only samples here, and its OpenMP team, spinning after
                # each parallel op, slows the session's next call (2-2.8x fewer tokens/s at batch 8-32 on two cores
                # with a 32k vocabulary: docs/bench/log.md). So torch gets one thread on this, the model's, thread.
                torch.set_num_threads(1)
            self.torch_threads = torch.get_num_threads()
            runner = self._local(made) if isinstance(made, Engine) else made
            name_team(MODEL_THREAD, MODEL_TEAM)  # warmed up: its OpenMP team is started
            self.name = self.cfg.model_name or runner.model.name
            self.chat_template = self._chat_template(runner.model)
            self.engine, self.runner = runner.model, runner
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("moeserve: the model failed to load: %s", self.load_error)
            if self.on_fatal is not None:
                self.on_fatal()
            return
        freeze_loaded_heap()
        self.ready = True
        self.metrics.ready.set(1)
        log.info("moeserve: %s is ready", self.name)
        self.runner.run()

    def _local(self, engine: Engine) -> Batcher:
        """The runner of an Engine in this process, warmed up, its expert load and its calls' paths in the metrics."""
        self.metrics.watch_experts(lambda: self.engine.expert_load if self.engine else None,
                                   engine.cfg.moe_layer_ids, engine.cfg.n_experts, self.cfg.expert_metrics)
        self.metrics.watch_paths("decode", lambda: self.engine.executor.decode_tokens if self.engine else None)
        self.metrics.watch_paths("prefill", lambda: self.engine.executor.prefill_tokens if self.engine else None)
        if engine.cfg.task == "lm":
            c = self.cfg
            engine.executor.warm_up(c.kv_slots if c.scheduler == "continuous" else c.batch.max_batch_size)
        self._warm_up(engine)
        return self._batcher(engine)

    def _chat_template(self, engine: ServedModel) -> ChatTemplate | None:
        """--chat-template, else the checkpoint's (beside an ONNX export: its directory's); a template that does
        not compile fails the start-up, as a model that does not load does."""
        where = engine.path.parent if engine.path is not None and engine.path.is_file() else engine.path
        if where is None:
            return ChatTemplate.from_file(self.cfg.chat_template) if self.cfg.chat_template is not None else None
        template = load_chat_template(where, self.cfg.chat_template)
        log.info("moeserve: chat template from %s", template.origin if template else "nowhere (chat answers 400)")
        return template

    def _batcher(self, engine: Engine) -> Batcher:
        """The continuous policy for a language model, unless the run-to-completion one was asked for (or the model
        generates nothing: a classifier's requests are whole batches either way)."""
        cfg = self.cfg
        scheduler = cfg.scheduler if engine.cfg.task == "lm" else "batch"
        if scheduler == "continuous":
            log.info("moeserve: continuous batching over %d cache slots of %d positions", cfg.kv_slots,
                     engine.cfg.max_seq_len)
        batcher = Batcher(engine, cfg.batch, self.metrics, scheduler=scheduler, slots=cfg.kv_slots,
                          prefill_chunk=cfg.prefill_chunk)
        if cfg.profile_dir is not None:
            batcher.profiler = StepProfiler(cfg.profile_dir, engine.device, cfg.profile_max_s)
            log.info("moeserve: POST /start_profile and /stop_profile write traces to %s", cfg.profile_dir)
        return batcher

    def stop(self, timeout: float) -> None:
        self.draining = True
        if self.runner is not None:
            self.runner.close()
        if self._thread is not None:
            self._thread.join(timeout)

    @staticmethod
    def _warm_up(engine: Engine) -> None:
        """One batch of each kind the model serves, so the first request does not pay for first-call
        allocations; its expert load is not traffic and is reset."""
        bos = [engine.tokenizer.bos_id] if engine.tokenizer is not None and engine.tokenizer.bos_id is not None else []
        rows = [bos + [1, 2, 3], bos + [4]]
        if engine.cfg.task == "lm":
            if engine.tokenizer is not None:  # a completion is text
                engine.complete(rows, [SamplingParams(max_new_tokens=2)] * 2)
            engine.score_ids(rows)
        else:
            engine.classify(rows)
        engine.expert_load.reset()

    def require_ready(self) -> ServedModel:
        if self.draining:
            raise ApiError("shutting_down", "the server is shutting down", headers={"Retry-After": "5"})
        if not self.ready:
            msg = f"the model failed to load ({self.load_error})" if self.load_error else "the model is still loading"
            raise ApiError("not_ready", msg, headers={"Retry-After": "1"})
        return self.engine

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError("model_not_found", f"model {model!r} is not served here; this server serves "
                           f"{self.name!r}", param="model")

    def admit(self) -> Place:
        """A place in the queue for a model request, or (ApiError) the refusal it would get now whatever its
        body says: shutting down, not ready, queue full. The gate asks before it reads the body."""
        self.require_ready()
        try:
            return self.runner.hold()
        except (QueueFull, Closed) as e:
            raise _refusal(e) from e

    def submit(self, job: Job, scope: dict | None = None):
        """Queue `job`, into the place its request was admitted to (the ASGI scope's PLACE) where it has one;
        413 first if it asks for more model work than one request may."""
        work, cap = job.work(self.engine.cfg.max_seq_len), self.cfg.max_request_tokens
        if work > cap:
            what = {"complete": "prompt and max_tokens of each sequence", "score": "every window of each text",
                    "classify": "each text"}[job.kind]
            raise ApiError("too_much_work", f"this request asks for {work} tokens of model work ({what}); at most "
                           f"{cap} per request (the server's --max-request-tokens)", limit=cap)
        try:
            return self.runner.submit(job, None if scope is None else scope.get(PLACE))
        except (QueueFull, Closed) as e:
            raise _refusal(e) from e


def _refusal(e: QueueFull | Closed) -> ApiError:
    if isinstance(e, QueueFull):
        return ApiError("queue_full", str(e), headers={"Retry-After": str(e.retry_after_s)})
    return ApiError("shutting_down", str(e))


def name_os_thread(name: str) -> None:
    """The calling thread's name where the OS shows it (Linux: /proc/PID/task/TID/comm, 15 bytes; top -H, py-spy,
    the benches' CPU time by thread). Python's thread names are its own, so without it the model's thread, the event
    loop's and torch's workers read alike from outside the process. Elsewhere, nothing."""
    with contextlib.suppress(OSError):
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])


def name_team(name: str, team: str) -> None:
    """Every other thread of this process named `name` (the calling thread's) renamed `team`: Linux gives a new
    thread its creator's name, so torch's OpenMP team, started by the model's thread at its first parallel op, reads
    as that thread, and its CPU would count as the model thread's (a GPU server's model thread near one core busy
    means its host work is the bound; with the team in the sum, that reading means nothing). Elsewhere, nothing."""
    me = threading.get_native_id()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            comm = Path(f"/proc/self/task/{tid}/comm")
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                if int(tid) != me and comm.read_text().strip() == name[:15]:
                    comm.write_text(team[:15])


def freeze_loaded_heap() -> None:
    """Once a server's model is loaded: what is garbage collected, then everything left (the model, the app, the
    modules: ~211k objects for a `small` model, none of them ever garbage) moved out of the collector's sight
    (gc.freeze, as vLLM does after start-up). A full collection walked all of them: 86-151 ms with the GIL held,
    about once in 30 s of load here, a stall of every stream (and, on an expert-parallel rank, of its whole group at
    the next collective); after it, one walks the ~10k objects made since (docs/bench/log.md)."""
    gc.collect()
    gc.freeze()
