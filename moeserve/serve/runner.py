"""Where a server's requests run: the one seam between the HTTP side (gate, handlers, metrics) and the model.

    handlers -> ServerState.admit / submit -> Runner: hold a place, take a Job, answer its future (and stream its
    events through job.on_event) -> the model, wherever it is

Two runners exist. `Batcher` (batcher.py) runs jobs on this process's Engine, on the model thread. `RankRouter`
(ep_router.py) sends each job to a rank actor of an expert-parallel group (`--ray --expert-parallel N`) and
relays its events and result. Everything else of the server (schemas, limits, errors, status codes, metrics,
streaming) is the same for both.

What the handlers need of the model itself (its config, tokenizer and name, to check and encode requests) is a
`ServedModel`: the Engine where it is loaded here, `ModelFacts` where the weights live elsewhere.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from moeserve.config import MoEConfig
from moeserve.runtime.sampling import EngineError
from moeserve.tokenizer import Tokenizer

__all__ = ["ModelFacts", "Runner", "ServedModel"]


class ServedModel(Protocol):
    """The model as the handlers see it: what a request is checked and encoded against."""

    name: str
    path: Path | None
    cfg: MoEConfig
    tokenizer: Tokenizer | None

    def text_tokenizer(self) -> Tokenizer: ...


@dataclass
class ModelFacts:
    """A model known by its checkpoint's config and tokenizer, its weights held elsewhere (the rank actors)."""

    name: str
    path: Path | None
    cfg: MoEConfig
    tokenizer: Tokenizer | None

    @classmethod
    def read(cls, checkpoint: str | Path) -> "ModelFacts":
        from moeserve.checkpoint import read_config
        from moeserve.tokenizer import load_checkpoint_tokenizer

        path = Path(checkpoint)
        cfg = read_config(path)
        return cls(path.name or str(path), path, cfg, load_checkpoint_tokenizer(path, cfg))

    def text_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise EngineError(f"{self.name} has no tokenizer (no tokenizer.json); pass token ids instead of text")
        return self.tokenizer


class Held(Protocol):
    """A place held in a runner's queue for an admitted request whose body is still being read."""

    def release(self) -> bool: ...


class Runner(Protocol):
    """Runs the server's jobs (batcher.Job). `hold` and `submit` raise batcher.QueueFull or batcher.Closed when a job
    would be refused now; every other failure is the job's future's exception (batcher.Unavailable: 503)."""

    model: ServedModel

    @property
    def depth(self) -> int:
        """Requests waiting to start (the queue-depth metric)."""

    def hold(self) -> Held: ...

    def submit(self, job, place: Held | None = None) -> concurrent.futures.Future: ...

    def close(self) -> None:
        """Refuse new work; `run` returns once the running work has ended."""

    def run(self) -> None:
        """The runner's loop, on the thread the server gives it, until closed and idle."""
