"""`moeserve score --ray`: the scorer of scoring.py on Ray Data workers.

The driver cuts the input into the chunks a local run would score (`chunk_spans`: byte ranges and
line numbers, no parsing) and makes them a dataset, one block per chunk. A pool of actors
(`map_batches` with an actor class and `concurrency=N`, `num_gpus=1` each where the cluster has GPUs)
loads the engine once per actor and scores chunks with the local scorer's own `score_span`: each reads
its byte range of the input, so bad lines become the same error lines with the same line numbers as in
a local run, and rows are batched exactly as there. (Ray Data's `read_json` would fail a whole block
on one bad line and knows no line numbers.) Results come back in input order (`preserve_order`), and
the driver writes and commits them chunk by chunk as a local run does, so `--resume` skips every
committed id and the output is line for line the local one.

An actor that dies mid-chunk is restarted by Ray Data and its chunk retried (actors are created with
`max_restarts=-1`, `max_task_retries=-1`); a chunk's lines reach the driver once, whichever attempt
made them. The input and the checkpoint are read by path on the workers: on a cluster of several
machines, put them where every node sees the same path (shared storage).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from moeserve.ray_cluster import connect
from moeserve.runtime.engine import load_engine
from moeserve.scoring import Batching, ChunkSpan, ModelFacts, ScoreConfig, ScoreSummary, score_file, score_span

_SPAN_FIELDS = [f.name for f in dataclasses.fields(ChunkSpan)]


class ChunkScorer:
    """A Ray Data actor: one engine, loaded once; each call scores the chunks of one batch of spans."""

    def __init__(self, checkpoint: str, path: str, batching: Batching, backend: str, dtype: str, device: str,
                 quantize: str | None = None):
        self.engine = load_engine(checkpoint, backend, dtype=dtype, device=device, quantize=quantize)
        self.path, self.batching = Path(path), batching
        self.sizer = batching.sizer()  # each worker measures its own batches' throughput

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        data, errors = [], []
        for values in zip(*(batch[name] for name in _SPAN_FIELDS)):
            span = ChunkSpan(*(int(v) for v in values))
            lines, n_err = score_span(self.engine, self.path, span, self.batching, self.sizer)
            data.append(lines)
            errors.append(n_err)
        return {**batch, "data": np.array(data, dtype=object), "errors": np.array(errors, dtype=np.int64)}


def _unwrap(e: Exception) -> Exception:
    """The user's error inside a Ray task error (a bad checkpoint path, a bad setting), else e."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, (ValueError, OSError)) else e


class RayScorer:
    """Ray Data behind `score_file`: the model's facts from a worker, then scored chunks in input order."""

    def __init__(self, checkpoint: str | os.PathLike | None, cfg: ScoreConfig, workers: int | None = None):
        if checkpoint is None:
            raise ValueError("--ray needs a checkpoint path that the workers can read")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers = {workers!r}: expected an integer >= 1")
        self.ray = connect()
        self.checkpoint, self.cfg = str(Path(checkpoint).absolute()), cfg
        resources = self.ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if cfg.device != "cpu" else 0
        self.num_gpus = 1 if gpus else 0
        self.workers = workers or max(1, gpus or int(resources.get("CPU", 1)))
        facts = self.ray.remote(num_cpus=1, num_gpus=self.num_gpus)(_facts)
        try:  # the worker's device and dtype, which are not this process's where the GPUs are elsewhere
            self.model: ModelFacts = self.ray.get(facts.remote(self.checkpoint, cfg.backend, cfg.dtype, cfg.device,
                                                                cfg.quantize))
        except Exception as e:
            raise _unwrap(e) from None

    def score_spans(self, spans: Iterable[ChunkSpan]) -> Iterator[tuple[ChunkSpan, bytes, int]]:
        spans = list(spans)
        if not spans:
            return
        import ray.data

        ctx = ray.data.DataContext.get_current()
        saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start
        ctx.execution_options.preserve_order = True  # the output is written in input order as it arrives
        ctx.enable_progress_bars = ctx.print_on_execution_start = False  # the driver's own bar counts records
        try:
            cfg = self.cfg
            ds = ray.data.from_items([dataclasses.asdict(s) for s in spans], override_num_blocks=len(spans))
            scored = ds.map_batches(
                ChunkScorer, batch_size=1, compute=ray.data.ActorPoolStrategy(size=self.workers), num_cpus=1,
                num_gpus=self.num_gpus,
                fn_constructor_kwargs=dict(checkpoint=self.checkpoint, path=str(cfg.input.absolute()),
                                           batching=cfg.batching, backend=cfg.backend, dtype=cfg.dtype,
                                           device=cfg.device, quantize=cfg.quantize))
            try:
                for row in scored.iter_rows():
                    yield ChunkSpan(*(int(row[name]) for name in _SPAN_FIELDS)), bytes(row["data"]), int(row["errors"])
            except Exception as e:
                raise _unwrap(e) from None
        finally:
            ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start = saved


def score_file_ray(checkpoint: str | os.PathLike, cfg: ScoreConfig, workers: int | None = None,
                   log=lambda msg: None) -> ScoreSummary:
    """`score_file` with its chunks scored by `workers` Ray Data actors (None: one per GPU of the cluster,
    else one per CPU): the same output file, progress file and resume."""
    return score_file(checkpoint, cfg, scorer=lambda: RayScorer(checkpoint, cfg, workers), log=log)


def _facts(checkpoint: str, backend: str, dtype: str, device: str, quantize: str | None = None) -> ModelFacts:
    return ModelFacts.of(load_engine(checkpoint, backend, dtype=dtype, device=device, quantize=quantize))
