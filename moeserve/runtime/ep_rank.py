"""One rank of an expert-parallel group: its engine (the whole model but 1/N of the experts), its own requests, and
the lockstep that brings every rank to each MoE layer together.

Each rank runs its own step engine over its own KV cache (data-parallel attention), so ranks make different model
calls at each step: a prompt's prefill chunks and a decode on one, a decode alone on another, nothing on an idle
one. The exchange inside each MoE layer (expert_parallel.py) is a collective, so every rank must make the same
number of MoE-layer calls. The protocol, once per loop iteration ("step"):

  1. plan the step (the scheduler, on the host) and count the model calls it can make at most: one per prefill
     call, one for the decode, one for a slice of scoring work, and the most tokens one of them passes;
  2. agree on the group's maxima of [that count, "not finished", those tokens, "needs eager"]: one all-to-all of
     four numbers, whose token maximum sizes the packed exchange of every MoE layer in the step
     (expert_parallel.py). A rank with a compiled decode step (RankOptions.compile) runs it, and every MoE layer
     exchanges through the fixed-size buffers such a graph holds, in the steps where no rank needs eager (a
     prefill chunk, a scoring slice, or a rank without the graph): such a step runs the same exchange on every
     rank. Any other step runs eager everywhere, decodes included;
  3. all zero: nobody runs; sleep briefly (every rank does, so the idle loop costs one small collective per sleep;
     the sleep doubles while the group stays idle, up to RankOptions.idle_sleep_max_s, and a request for this rank
     ends it at once), or leave the loop when every rank has been asked to stop and has nothing left;
  4. else run the step, count the forward passes it really made (a sequence may end in a prefill and skip the
     decode), and make up the difference to the agreed maximum with empty passes: each MoE layer called on 0
     tokens, which takes part in exactly the exchanges a real forward makes (the same modules decide them);
  5. with redundant experts (RankOptions.redundant_experts), every `rebalance_every` steps with work: the
     rebalance (expert_replicas.py), an all-reduce of the window's expert load and the new copies' weights, taken
     by every rank together since the count of steps with work is agreed.

Every forward pass of a model makes the same sequence of exchanges whatever its tokens (one per MoE layer, two for
a VQ mixed layer whose discrete path is not a table), so any real pass lines up with any other rank's real or
empty pass. A rank that would make more calls than agreed is stopped before the extra one (LockstepError) rather
than left to desynchronise the group. Sequences, scheduling, chunked prefill, n choices sharing a prefill,
log-probabilities and scoring are the step engine's and the Engine's, unchanged.

A compiled step (`compile` 'on', or 'auto' on a GPU: CUDA graphs) is built for every batch bucket at load, every
rank together, since each graph's exchange meets the other ranks'. It needs plain local experts with no copies:
int8 / int4 and biased experts, and redundant experts, size their row splits on the host (expert_parallel.py).

A group of one rank (`--ray` without --expert-parallel: plain replicas) has nobody to meet: it loads the checkpoint
as one process does (RankOptions.whole_alone), so the CPU kernel's one-call decode step runs where it builds, and
its agreement and padding take no collective.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generator

import torch

from moeserve.checkpoint import load_expert_slice, read_config
from moeserve.config import MoEConfig
from moeserve.runtime import COMPILE_MODES
from moeserve.runtime.backends.compiled import CompiledBackend, resolve_compile
from moeserve.runtime.backends.cpu import CpuKernelBackend
from moeserve.runtime.backends.expert_shards import BiasedExpertShard, ExpertShard, QuantExpertShard
from moeserve.runtime.engine import Engine, RowScore, resolve_device, resolve_dtype
from moeserve.runtime.expert_parallel import (
    EPGroup, ExchangeStats, ExpertParallelError, ExpertParallelExperts, LockstepError, join_group,
)
from moeserve.runtime.expert_replicas import Replication
from moeserve.runtime.experts import biased_experts
from moeserve.runtime.lockstep import Lockstep
from moeserve.runtime.output import EventCallback
from moeserve.runtime.quant import QuantSpec, describe
from moeserve.runtime.sampling import EngineError, SamplingParams
from moeserve.runtime.scheduler import Plan, Sequence, default_prefill_chunk
from moeserve.runtime.steps import check_request

__all__ = ["EPRank", "RankOptions", "RankStats", "load_rank_engine", "run_rank", "uncompilable_experts"]


def uncompilable_experts(cfg: MoEConfig, replicas: bool = False) -> str | None:
    """Why a rank's experts cannot exchange inside a compiled step (their row splits are sized on the host, which the
    fixed exchange does not do), or None: int8 / int4 experts, biased ones (gpt-oss), redundant copies (`replicas`)
    or a capacity limit."""
    biased = biased_experts(cfg)
    return ("int8 / int4 experts" if cfg.quantization is not None and not biased else "biased experts" if biased else
            "redundant experts" if replicas else "capacity_factor" if cfg.capacity_factor is not None else None)


def load_rank_engine(checkpoint: str, group: EPGroup, *, dtype: str | torch.dtype = "float32",
                     device: str | torch.device | None = None, calibration: str | None = None,
                     verify: bool = True, compile: str = "off", slots: int = 8, replicas: bool = False) -> Engine:
    """An Engine for this rank: the dense part of the checkpoint, and of every MoE layer only this rank's experts,
    read as safetensors slices (checkpoint.load_expert_slice). Every rank of the group must call it together: a VQ
    layer's code table is built through the exchange while the backend lays the model out. `compile` (Engine.load's
    modes): a compiled decode step for up to `slots` rows, its experts given the fixed exchange's buffers for as
    many tokens (off until the lockstep turns them on); 'on' fails with the reason where the experts cannot take it
    (`replicas`: redundant experts will be placed), 'auto' runs eager there."""
    cfg = read_config(checkpoint)
    biased = biased_experts(cfg)
    spec = None
    if cfg.quantization is not None:  # int8 / int4 checkpoints: each rank reads its experts' integers and scales
        if "bits" not in cfg.quantization:
            raise ExpertParallelError(f"{checkpoint}: {describe(cfg.quantization)} weights are quantized at load on "
                                      f"one GPU; expert parallelism serves int8 and int4 checkpoints")
        if not biased:  # experts with a bias are never quantized (Transformer.quantizable): they stay float
            spec = QuantSpec.from_dict(cfg.quantization).for_weight("experts", cfg.d_model)
    if not cfg.moe_layer_ids:
        raise ExpertParallelError(f"{checkpoint} has no MoE layer: nothing to split across ranks")
    dev = resolve_device(device or group.device)
    if dev.type != group.device.type:
        raise ExpertParallelError(f"device {dev} for a {group.backend} group, which exchanges on {group.device}")
    dt = resolve_dtype(dtype, dev)
    graph = resolve_compile(compile, dev)
    if graph and (why := uncompilable_experts(cfg, replicas)) is not None:
        if compile == "on":
            raise ExpertParallelError(f"compile = 'on' for rank {group.rank} of {group.world_size}: its {why} have no "
                                      f"compiled exchange (their rows are counted on the host); use compile 'off'")
        graph = False
    mine = group.experts_of(cfg.n_experts)
    _, tensors = load_expert_slice(checkpoint, mine.start, mine.stop, dtype=dt)

    def experts(layer_id: int) -> ExpertParallelExperts:
        prefix = f"layers.{layer_id}.ffn.experts."
        mine_t = {k.removeprefix(prefix): t.to(dev) for k, t in tensors.items() if k.startswith(prefix)}
        if biased:  # weights and biases (a gpt-oss directory's MXFP4 dequantized by its expert_slice)
            shard = BiasedExpertShard.of_tensors(list(mine), cfg.expert_act, cfg.swiglu_limit, cfg.swiglu_alpha,
                                                 mine_t)
        elif spec is not None:
            shard = QuantExpertShard.of_tensors(list(mine), spec, cfg.expert_act, mine_t)
        else:
            shard = ExpertShard(list(mine), mine_t["w1"], mine_t["w2"], mine_t.get("w3"))
        ep = ExpertParallelExperts(group, cfg.n_experts, shard)
        if graph:
            ep.use_fixed(slots, on=False)
        with torch.device(dev):  # the model is being built on the meta device; the kernel's first use self-checks
            ep.prepare_inference()
        return ep

    engine = Engine.load(checkpoint, dtype=dt, device=dev, verify=verify, calibration=calibration,
                         compile="on" if graph else "off", experts_factory=experts)
    if isinstance(engine.runner, CpuKernelBackend) and engine.runner.step is not None:  # not while experts are ours
        raise LockstepError("the CPU kernel's whole decode step would run the experts past the exchange")
    return engine


@dataclass
class RankOptions:
    """How a rank serves (what its step engine is built with), beside the checkpoint and the group."""

    slots: int = 8  # sequences this rank's KV cache holds at once
    max_len: int | None = None  # positions per slot (None: the model's context)
    prefill_chunk: int | None = None  # prompt tokens a step while others decode (None: the device's default)
    idle_sleep_s: float = 0.002  # between two steps in which no rank had work: the price of a wake-up
    # the sleep doubles over consecutive idle steps up to this: an idle group's collectives (each a round trip and
    # two thread wake-ups a rank) cost 25% of a core a rank at idle_sleep_s alone on a 2-core VM. A request for this
    # rank wakes it at once; one for another rank waits out at most this for the agreement of its first step
    idle_sleep_max_s: float = 0.02
    dtype: str = "float32"
    calibration: str | None = None  # Engine.load's; every rank should use the same plan (calibrate once per machine)
    verify: bool = True  # check the checkpoint's hashes while loading
    # replica slots per rank and MoE layer for other ranks' hot experts (expert_replicas.py; 0: off). Each costs up
    # to one expert's weights per layer, and outputs do not change; it evens out the ranks' expert work
    redundant_experts: int = 0
    # steps with work between two placements of the copies: each costs one all-reduce of [L, E + R] counts, and
    # moves the weights of the copies that changed; fewer steps follow the load sooner, on a noisier window
    rebalance_every: int = 64
    # the packed exchange (expert_parallel.py) for steps whose token count is known beforehand: two collectives a
    # MoE layer instead of three; False, always the variable exchange (every rank of a group must agree)
    packed: bool = True
    # a group of one rank loads the checkpoint as one process does (every expert, the CPU kernel's one-call decode
    # step): nothing crosses to another rank. False: through the exchange all the same (tests of the loop)
    whole_alone: bool = True
    # Engine.load's compile mode (auto: CUDA graphs on a GPU), for a whole model (a group of one) as for a rank's
    # slice, whose compiled decode step exchanges through fixed-size buffers in the steps where every rank runs it
    compile: str = "off"

    def __post_init__(self) -> None:
        if (self.slots < 1 or (self.prefill_chunk is not None and self.prefill_chunk < 1)
                or not 0 <= self.idle_sleep_s <= self.idle_sleep_max_s):
            raise ExpertParallelError(f"slots = {self.slots}, prefill_chunk = {self.prefill_chunk}, idle_sleep_s = "
                                      f"{self.idle_sleep_s}, idle_sleep_max_s = {self.idle_sleep_max_s}: expected "
                                      f">= 1, >= 1 (or None), and 0 <= idle_sleep_s <= idle_sleep_max_s")
        if self.compile not in COMPILE_MODES:
            raise ExpertParallelError(f"compile = {self.compile!r}: expected one of {', '.join(COMPILE_MODES)}")
        if self.redundant_experts < 0 or self.rebalance_every < 1:
            raise ExpertParallelError(f"redundant_experts = {self.redundant_experts}, rebalance_every = "
                                      f"{self.rebalance_every}: expected >= 0 and >= 1")


@dataclass
class RankStats:
    steps: int = 0  # steps in which some rank had work
    model_calls: int = 0  # forward passes of this rank's own work
    empty_passes: int = 0  # forward passes made only to keep step with the others
    idle_steps: int = 0  # steps in which no rank had work
    iterations: int = 0  # loop iterations completed, idle or not: the counter a health check watches advance
    last_step_at: float | None = None  # time.monotonic() at the end of the last iteration (None: none yet)


@dataclass
class _ScoreJob:
    slices: Generator[int, int | None, list[RowScore]]
    future: Future


class EPRank:
    """A rank's serving loop. Another thread (a Ray actor's method, a server's handler) calls `submit` /
    `submit_scores` and waits on the Future; one thread runs `run()` (or `step()` in a loop of its own). `stop()`
    ends the loop once every rank has been asked to stop and none has work left, so ranks leave together."""

    def __init__(self, engine: Engine, group: EPGroup, options: RankOptions | None = None):
        if engine.model is None or engine.cfg.task != "lm":
            raise ExpertParallelError(f"{engine.name}: an expert-parallel rank serves a torch language model")
        self.engine, self.group, self.options = engine, group, options or RankOptions()
        o = self.options
        self.steps = engine.step_engine(o.slots, o.max_len, o.prefill_chunk or default_prefill_chunk(engine.device))
        # an exchanging rank's decode step compiled (a graph per batch bucket, built in `load`), run in the steps the
        # lockstep agrees on (a whole model's, a group of one's, runs its graphs in every decode, as one process)
        self.graph = bool(self.experts) and isinstance(engine.runner, CompiledBackend) and engine.runner.graph_decode
        self.lockstep = Lockstep(group, engine.model, graph=self.graph)
        # each exchanging layer's calls a pass (Lockstep.exchanges_per_pass, measured in `warm_up`)
        self._fixed_calls: list[int] = [1] * len(self.lockstep.layers)
        self.stats = RankStats()
        # the copies of hot experts, placed every rebalance_every steps with work (None: off)
        self.replication = (Replication(self.experts, o.redundant_experts, o.rebalance_every)
                            if o.redundant_experts else None)
        self._inbox: queue.SimpleQueue[Sequence | _ScoreJob] = queue.SimpleQueue()
        self._futures: dict[Sequence, Future] = {}
        self._scores: list[_ScoreJob] = []
        self._submit_lock = threading.Lock()
        self._wake = threading.Event()  # set by a request or stop(): ends an idle sleep at once
        self._idle_sleep = self.options.idle_sleep_s  # the next idle sleep (doubling while the group stays idle)
        self._stopping = False
        self.failed: BaseException | None = None
        self.thread: threading.Thread | None = None  # the loop's, once `start`ed

    @classmethod
    def load(cls, checkpoint: str, group: EPGroup, options: RankOptions | None = None) -> "EPRank":
        """Load this rank's slice of `checkpoint` (every rank together: load_rank_engine) and make its loop. A group
        of one rank loads the whole model as one process does (RankOptions.whole_alone)."""
        o = options or RankOptions()
        if group.world_size == 1 and o.whole_alone:
            engine = Engine.load(checkpoint, dtype=resolve_dtype(o.dtype, group.device), device=group.device,
                                 verify=o.verify, calibration=o.calibration, compile=o.compile)
        else:
            engine = load_rank_engine(checkpoint, group, dtype=o.dtype, calibration=o.calibration, verify=o.verify,
                                      compile=o.compile, slots=o.slots, replicas=o.redundant_experts > 0)
        rank = cls(engine, group, o)
        if rank.graph:
            rank.warm_up()
        return rank

    def warm_up(self) -> None:
        """Build the compiled decode step's graph of every batch bucket now (every rank together: each graph's
        exchange meets the other ranks'), rather than inside a step where the other ranks would wait on it."""
        runner = self.engine.runner
        with self.engine.lock, torch.inference_mode():
            for layer in self.experts:
                layer.fixed_on = True
            try:
                self._fixed_calls = self.lockstep.exchanges_per_pass()
                runner.warm_up(self.options.slots)
            finally:
                for layer in self.experts:
                    layer.fixed_on = False

    @property
    def experts(self) -> list[ExpertParallelExperts]:
        """The MoE layers' exchanges (none in a group of one that loaded the whole model)."""
        return [layer.experts for layer in self.engine.model.moe_layers
                if isinstance(layer.experts, ExpertParallelExperts)]

    def expert_ids(self) -> list[list[int]]:
        """Per MoE layer, the global ids of the experts this rank computes."""
        every = list(range(self.engine.cfg.n_experts))
        return [layer.experts.local.expert_ids if isinstance(layer.experts, ExpertParallelExperts) else every
                for layer in self.engine.model.moe_layers]

    # ---- requests (any thread) ---------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               on_event: EventCallback | None = None) -> Future:
        """Queue one completion on this rank; a Future of its Completion. A request the model cannot run raises
        EngineError here. `on_event` gets its stream events on the loop's thread; cancelling the Future before it
        is done ends the sequence at the next step."""
        params = params or SamplingParams()
        ids = self.engine.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        check_request(self.engine.cfg, self.engine.tokenizer, ids, params)
        future: Future = Future()
        seq = Sequence(ids, params, on_event=on_event, cancelled=future.cancelled)
        self._put(seq, future)
        return future

    def submit_scores(self, rows: list[list[int]], stride: int | None = None) -> Future:
        """Queue the scoring of token-id rows (Engine.score_ids: rolling windows past the context), run one batch
        per step between the generation steps; a Future of the list of RowScore."""
        future: Future = Future()
        self._put(_ScoreJob(self.engine.score_slices([list(r) for r in rows], stride), future), future)
        return future

    def _put(self, item: Sequence | _ScoreJob, future: Future) -> None:
        with self._submit_lock:
            if self.failed is not None:
                raise ExpertParallelError(f"rank {self.group.rank} failed ({self.failed!r}); its group must restart")
            if self._stopping:
                raise ExpertParallelError(f"rank {self.group.rank} is stopping and takes no more requests")
            if isinstance(item, Sequence):
                self._futures[item] = future
            self._inbox.put(item)
        self._wake.set()

    def stop(self) -> None:
        """Take no more requests; the loop ends when every rank has stopped and finished its work."""
        with self._submit_lock:
            self._stopping = True
        self._wake.set()

    # ---- the loop (one thread) ---------------------------------------------------------------------------------
    def start(self, leave_group: bool = False) -> threading.Thread:
        """`run` on a daemon thread of its own (`self.thread`); leave_group: destroy the process group when it ends."""
        def loop() -> None:
            try:
                self.run()
            finally:
                if leave_group:
                    self.group.leave()

        self.thread = threading.Thread(target=loop, name=f"moeserve-ep-rank-{self.group.rank}", daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> None:
        """Step until every rank has stopped. A failed step fails every request of this rank and raises: the
        other ranks' collectives then time out, and the group is restarted as a unit."""
        while self.step():
            pass

    def step(self) -> bool:
        """One lockstep iteration (module docstring); False once the group has finished."""
        try:
            with self.engine.lock:
                self._admit()
                plan = self.steps.plan()
                job = self._scores[0] if self._scores else None
                calls = len(plan.prefills) + bool(plan.decode) + (job is not None)
                with self._submit_lock:
                    finished = self._stopping and self._inbox.empty() and self.steps.idle and not self._scores
                eager = bool(plan.prefills) or job is not None  # what no compiled step runs
                most, all_finished = self.lockstep.agree(calls, finished, self._tokens(plan, job), eager)
                if self.graph:  # the compiled decode where every rank runs one (or nothing), else eager everywhere
                    self.engine.runner.graph_decode = self.lockstep.fixed_step
                graph_calls, step_calls = self._graph_calls(), self.steps.model_calls
                ended = self.steps.execute(plan)  # no model call when `calls` is 0: only cancelled sequences end
                self.lockstep.calls += self._graph_calls() - graph_calls  # past the forward hook (compiled)
                made = self.steps.model_calls - step_calls  # the C decode step, too, is past the hook
                if job is not None:
                    scored = self.lockstep.calls
                    self._score_slice(job)
                    made += self.lockstep.calls - scored
                fixed = self.lockstep.fixed_step
                self.stats.empty_passes += self.lockstep.pad()
                if fixed:  # every pass of the step, real or empty, made each layer's fixed calls (uncounted there)
                    for layer, n in zip(self.lockstep.layers, self._fixed_calls):
                        layer.stats.calls += n * self.lockstep.allowed
                if self.replication is not None and most:  # between steps, every rank together (`most` is agreed)
                    self.replication.after_step()
            self.stats.model_calls += made
            for seq in ended:
                self._resolve(seq)
        except BaseException as e:
            self._fail(e)
            raise
        self.stats.iterations += 1
        self.stats.last_step_at = time.monotonic()
        if most == 0:
            self.stats.idle_steps += 1
            if all_finished:
                return False
            self._wake.wait(self._idle_sleep)
            self._wake.clear()
            self._idle_sleep = min(2 * self._idle_sleep, self.options.idle_sleep_max_s)
        else:
            self.stats.steps += 1
            self._idle_sleep = self.options.idle_sleep_s
        return True

    def counters(self) -> dict:
        """What this rank has done, for a server's metrics (serve/ep_metrics.py), read from any thread (each number
        exact, together a snapshot within one layer call): its exchanges summed over its MoE layers (`calls`,
        `all_to_all_s`, `all_to_all_buckets` as ExchangeStats's, `rows_sent`, `rows_received`, `rows_computed`),
        `rows_routed` (rows this rank's tokens sent to experts, its own included: a token counts once per expert),
        and now: `queued` (sequences and scoring jobs waiting for a slot or a step) and `running` (sequences
        holding a cache slot: prefilling or decoding). The warm-up counts in the exchange counters."""
        stats = [e.stats for e in self.experts] or [ExchangeStats()]
        sched = self.steps.scheduler
        # a group of one with the whole model: every routed row is computed here, as the engine counts them
        routed = (sum(int(e.routed_E.sum()) for e in self.experts) if self.experts else
                  int(self.engine.expert_load.snapshot().sum()))
        return {"calls": sum(s.calls for s in stats), "all_to_all_s": sum(s.all_to_all_s for s in stats),
                "all_to_all_buckets": [sum(b) for b in zip(*(s.all_to_all_buckets for s in stats))],
                "rows_sent": sum(s.rows_sent for s in stats), "rows_received": sum(s.rows_received for s in stats),
                "rows_computed": sum(s.rows_computed for s in stats) if self.experts else routed,
                "rows_routed": routed,
                "queued": self._inbox.qsize() + len(sched.waiting) + len(self._scores),
                "running": len(sched.prefilling) + len(sched.running)}

    @property
    def has_work(self) -> bool:
        """Sequences or scoring queued or running on this rank (read from any thread: an estimate)."""
        return not (self._inbox.empty() and self.steps.idle and not self._scores)

    def unhealthy(self, stall_s: float) -> str | None:
        """Why this rank cannot serve, or None: its step failed, its loop has ended, or the loop has not finished
        an iteration for `stall_s` although it has work (a collective waiting on a dead or hung peer)."""
        if self.failed is not None:
            return f"rank {self.group.rank}'s last step failed: {self.failed!r}"
        if self.thread is None or not self.thread.is_alive():
            return f"rank {self.group.rank}'s step loop is not running"
        since = self.stats.last_step_at
        if since is not None and self.has_work and time.monotonic() - since > stall_s:
            return (f"rank {self.group.rank}'s step loop has not advanced for {time.monotonic() - since:.1f} s "
                    f"(> {stall_s:g} s) with work queued, after {self.stats.iterations} iterations")
        return None

    def _graph_calls(self) -> int:
        """Calls of the compiled decode step so far (its graphs' counter): none where there is no graph."""
        return self.engine.runner.graph_calls if self.graph else 0

    def _tokens(self, plan: Plan, job: _ScoreJob | None) -> int | None:
        """The most tokens any of this step's model calls passes (a prefill call: its chunks and carried rows; the
        decode: at most its rows), or None where a scoring slice, whose batch its generator sizes, runs."""
        if job is not None or not self.options.packed:
            return None
        return max([sum(p.takes) + len(p.carry) for p in plan.prefills] + [len(plan.decode)])

    def _admit(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _ScoreJob):
                self._scores.append(item)
                continue
            try:
                self.steps.add(item)
            except EngineError as e:  # it does not fit this rank's cache: that request's error, nobody else's
                self._futures.pop(item).set_exception(e)
            else:
                if item.done:  # nothing to compute (max_new_tokens 0, no prompt log-probabilities)
                    self._resolve(item)

    def _score_slice(self, job: _ScoreJob) -> None:
        """One batch of a scoring job (at most one forward pass); its Future once it has none left."""
        try:
            job.slices.send(None)
        except StopIteration as done:
            self._scores.pop(0)
            job.future.set_result(done.value)
        except EngineError as e:  # refused before its first forward (a bad stride, say)
            self._scores.pop(0)
            job.future.set_exception(e)

    def _resolve(self, seq: Sequence) -> None:
        future = self._futures.pop(seq)
        if not future.cancelled():
            future.set_result(seq.completion())

    def _fail(self, e: BaseException) -> None:
        with self._submit_lock:
            self.failed = e
        error = LockstepError(f"rank {self.group.rank}'s step failed: {e!r}")
        for future in [*self._futures.values(), *(j.future for j in self._scores)]:
            if not future.done():
                future.set_exception(error)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            future = item.future if isinstance(item, _ScoreJob) else self._futures.get(item)
            if future is not None and not future.done():
                future.set_exception(error)
        self._futures.clear()
        self._scores.clear()


def run_rank(checkpoint: str, init_method: str, rank: int, world_size: int, options: RankOptions | None = None, *,
             device: str = "cpu", timeout_s: float = 300.0) -> EPRank:
    """What a rank's process does: join the group at `init_method` (join_group's device and timeout), load this
    rank's slice of `checkpoint`, and serve on a thread of its own until stopped. Returns the rank at once, serving:
    `submit` to it, `stop()` it and join `rank.thread`; the group is left when the loop ends."""
    group = join_group(init_method, rank, world_size, device=device, timeout_s=timeout_s)
    try:
        ep = EPRank.load(checkpoint, group, options)
    except BaseException:
        group.leave()
        raise
    ep.start(leave_group=True)
    return ep
