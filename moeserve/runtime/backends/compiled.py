"""The decode step as one compiled graph: torch.compile (inductor) on a CPU, CUDA graphs on a GPU.

A decode step costs a few hundred small kernels; eager PyTorch pays a launch (GPU) or a dispatch
(CPU) for each, which at batch 1 is most of the step. Compiled, the step is one fused program; on
CUDA, mode "reduce-overhead" replays it as a CUDA graph. For that the step must be the same program
every time, so here it is made shape-static:

- the batch is padded up to the next bucket (1, 2, 4, ... up to the cache's slots): one graph per
  bucket. Padding rows write their keys and values into a scratch slot (the cache's last, which no
  sequence owns) and are dropped from the logits and from the expert-load counts;
- every row attends over a span of the cache: the live length (the longest row's position + 1) rounded up to a
  power of two (`spans`), masked by its position. The span is a dynamic dimension: one compile covers every span
  (a symbolic length), and on CUDA one graph is recorded per (bucket, span), so a step reads the keys its rows
  can see, never the whole cache, and a long context costs a short conversation little (docs/benchmarks.md);
- the experts run a path with no host sync and fixed shapes (backends/experts.py: GraphExperts) on plain
  weights (oneDNN-packed weights are opaque to the compiler); quantized experts are indexed per token
  (quant_gpu.IndexedQuantExperts), and a quantized model's linear maps on a GPU run torch's quantized ops;
- the KV cache tensors are buffers of the compiled module, so a CUDA graph writes them in place;
- expert-parallel experts (expert_parallel.py) exchange rows through the fixed-size all-to-all (use_fixed, every
  rank sized for at least the largest bucket): the variable one sizes its buffers on the host, and is refused.

A prompt's chunk runs on a compiled graph too (`CompiledPrefill`), where its experts compile as one grouped_mm call
(bf16, `decode_grouped`: the CUDA default): eager, a chunk of the built-in model is ~390 torch calls, each a kernel
launch on a GPU, and a served GPU's prompts arrive every few steps. The chunk is padded up to a power of two of
tokens (`chunk_sizes`); the padding tokens follow the chunk at the next positions of the same slot, whose keys no
query reads before its own token has written them, and are dropped from the logits and the expert counts. The
chunk's length is a dynamic dimension like the span: one compile, and on CUDA a graph per (size, span).

Same tokens as eager in fp32 (tests/runtime/test_compiled.py); the logits differ by float rounding
(fused reductions), ~1e-6 here.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import statistics
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.errors import MoeServeError
from moeserve.runtime import COMPILE_MODES
from moeserve.runtime.backends.calibration import interleaved_ms
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.eager import EagerBackend
from moeserve.runtime.backends.experts import GraphBiasedExperts, GraphExperts
from moeserve.runtime.expert_parallel import ExpertParallelExperts
from moeserve.runtime.experts import BiasedExperts, Experts
from moeserve.runtime.kv_cache import CacheRows, KVCache, RowsPart, StepRows
from moeserve.runtime.model import ModelOutput, Transformer
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.backends.quant_gpu import indexed_experts
from moeserve.runtime.quant import QuantExperts
from moeserve.runtime.quant_fp8 import Fp8Experts

log = logging.getLogger("moeserve.runtime")


class CompileError(MoeServeError, RuntimeError):
    """The compiled decode step cannot run here (no C++ compiler for inductor, an unsupported device)."""


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot build the decode step on `device`, or None."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "inductor needs a C++ compiler on a CPU (g++, c++ or clang++ on PATH); none was found"
    if device.type == "cuda" and not any(shutil.which(c) for c in ("gcc", "cc", "clang")):
        return "Triton needs a C compiler for its kernel launchers (gcc, cc or clang on PATH); none was found"
    if device.type not in ("cpu", "cuda"):
        return f"no compiled decode step for device type {device.type!r}"
    return None


def model_uncompilable(model: Transformer) -> str | None:
    """Why this model's decode step has no fixed shape, or None. Expert-parallel experts compile once their
    exchange is the fixed-size one (ExpertParallelExperts.use_fixed on every rank): its buffers are sized by a
    constant, not by counts read on the host."""
    if model.cfg.capacity_factor is not None:
        return "capacity_factor drops assignments by count (data-dependent shapes); serve it with --compile off"
    for layer in model.moe_layers:
        e = layer.experts
        if isinstance(e, ExpertParallelExperts) and e.fixed is None:
            return ("its experts exchange rows with other ranks in buffers sized on the host (the variable "
                    "all-to-all; experts_factory: expert parallelism): call use_fixed on every rank's layers to "
                    "compile it, or serve it with --compile off")
        if not isinstance(e, (Experts, BiasedExperts, QuantExperts, ExpertParallelExperts)):
            return ("its experts are an experts_factory's: they run past this process's graph; serve it with "
                    "--compile off")
    return None


def resolve_compile(mode: str, device: torch.device) -> bool:
    """'on': compile or fail naming why; 'off': eager; 'auto': on CUDA (launch-bound without graphs), eager on
    a CPU, where compiling costs seconds per batch bucket at start-up and pays only for small models: the compiled
    step copies each token's experts out of the stack (moe_indexed), which made a 644M Mixtral's decode slower
    than eager (docs/design-notes.md). `--compile on` is for a small model's long-running server."""
    if mode not in COMPILE_MODES:
        raise CompileError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return False
    why = compile_unavailable(device)
    if why is not None and mode == "on":
        raise CompileError(f"--compile on: {why}")
    return why is None


def to_device(values: list[int], device: torch.device) -> Tensor:
    """A step's small index tensor on `device`, queued rather than waited for: torch.tensor(..., device="cuda")
    copies from pageable memory, which waits for the GPU; a copy from pinned memory joins the stream."""
    t = torch.tensor(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def buckets(slots: int) -> list[int]:
    """Batch sizes a graph is built for: powers of two up to `slots`, and `slots` itself."""
    sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    return [*sizes, slots]


LEAST_SPAN = 256  # the shortest key span of a compiled step (spans)


def spans(max_len: int, least: int = LEAST_SPAN) -> list[int]:
    """Key lengths a step attends over: `least`, doubling, up to the cache's `max_len`, and `max_len` itself.
    A row at position p reads the first span > p: at most twice the keys it can see (a span per length would
    record a graph per token), and few enough spans to record every one at warm-up (8 for a 32k context)."""
    sizes = [least << i for i in range(max(max_len // least, 1).bit_length()) if least << i < max_len]
    return [*sizes, max_len]


PREFILL_LEAST, PREFILL_MOST = 16, 512  # a compiled prompt chunk's fewest and most tokens (chunk_sizes)
PREFILL_SPAN_MOST = 4096  # past this many keys a chunk runs eager: its attention, not its launches, is the cost


def chunk_sizes(max_len: int, least: int = PREFILL_LEAST, most: int = PREFILL_MOST) -> list[int]:
    """Token counts a prompt chunk's graph is built for: `least`, doubling, up to min(`most`, `max_len`) and that
    itself. A chunk pads up to the first size that holds it: at most twice its tokens' work, which on a GPU costs
    less than one eager call's launches for the chunks a server sees (a prompt of a few hundred tokens)."""
    top = min(most, max_len)
    return [*[least << i for i in range(max(top // least, 1).bit_length()) if least << i < top], top]


def prefill_uncompilable(model: Transformer) -> str | None:
    """Why a prompt chunk of this model has no compiled graph, or None: its experts must run a path with fixed shapes
    that is cheap for many tokens (grouped_mm, `decode_grouped`; indexing copies an expert's weights per token), and
    it must be a causal language model (a bidirectional row would attend to its padding)."""
    if not model.cfg.causal or model.cfg.task != "lm":
        return "a prompt chunk's padding would be attended to: only causal language models pad"
    for layer in model.moe_layers:
        if not (isinstance(layer.experts, GraphExperts) and layer.experts.w.decode_grouped):
            return "its experts do not compile as one grouped_mm call (decode_grouped: bf16 plain weights)"
    return None


def span_view(views: dict[int, Tensor], cache: KVCache, span: int) -> Tensor:
    """A compiled step's span argument: `span` bytes, its length marked dynamic once (kept in `views`)."""
    if span not in views:
        view = cache.k[0].new_empty(span, dtype=torch.uint8)
        torch._dynamo.mark_dynamic(view, 0)
        views[span] = view
    return views[span]


def real_counts(aux: list[MoEAux], real_N: Tensor, n_experts: int) -> Tensor:
    """[MoE layers, E] int32: each layer's assignments of the real tokens (real_N [N] int32, 1 real, 0 padding;
    N the call's tokens in order), counted in the graph rather than by a few small kernels per layer after it."""
    counts = [(F.one_hot(a.routing.expert_ids if a.routing is not None else a.codes[:, None], n_experts)
               .to(torch.int32).reshape(real_N.shape[0], -1, n_experts) * real_N[:, None, None]).sum((0, 1))
              for a in aux]
    return torch.stack(counts).to(torch.int32)


class _Step(nn.Module):
    """model + the cache's tensors as buffers: the pure function (ids, slots, positions, span) -> logits, expert
    counts."""

    def __init__(self, model: Transformer, cache: KVCache):
        super().__init__()
        self.model, self.cache = model, cache
        self.scratch = cache.slots - 1
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            self.register_buffer(f"k{i}", k, persistent=False)
            self.register_buffer(f"v{i}", v, persistent=False)

    def forward(self, ids_B1: Tensor, slots_B: Tensor, positions_B1: Tensor, span_L: Tensor) -> tuple[Tensor, Tensor]:
        """(logits [B, 1, V], expert counts [MoE layers, E] int32 of the real rows). span_L: any tensor whose
        length is the keys attended over (a dynamic dimension: a size passed as an int would be a constant of the
        graph, compiled again per span). The counts are made here, in the graph, rather than by a few small
        kernels per layer after each replay; padding rows (on the scratch slot) are routed but not counted."""
        # the model's forward without its own hooks: an expert-parallel rank's pass counter (lockstep.py) is Python
        # state that a graph would guard on; the rank counts the graph's calls (CompiledBackend.graph_calls) instead
        out = self.model.forward(ids_B1, cache=CacheRows(self.cache, slots_B, positions_B1, span_L.shape[0]))
        real_B = (slots_B != self.scratch).to(torch.int32)
        return out.logits, real_counts(out.aux, real_B, self.model.cfg.n_experts)


class _Prefill(_Step):
    """model + the cache's tensors as buffers: the pure function (ids [1, P], slot, positions [1, P], span, last)
    -> the logits of token `last` [1, 1, V] and the expert counts of tokens 0..last (the rest are padding)."""

    def forward(self, ids_1P: Tensor, slot_1: Tensor, positions_1P: Tensor, span_L: Tensor,
                last_1: Tensor) -> tuple[Tensor, Tensor]:
        P = ids_1P.shape[1]
        rows = CacheRows(self.cache, slot_1, positions_1P, span_L.shape[0])
        out = self.model.forward(ids_1P, cache=StepRows([RowsPart(rows, slice(0, P))], last_1, [0]))
        real_P = (torch.arange(P, device=ids_1P.device) <= last_1).to(torch.int32)
        return out.logits, real_counts(out.aux, real_P, self.model.cfg.n_experts)


class CompiledDecode:
    """The decode step of `model` over `cache`, compiled once per batch bucket (lazily, on first use of a bucket).

    The cache must have one slot more than the sequences that use it (KVCache.for_model(model, slots + 1)):
    the last is the padding rows' scratch slot. `least_span`: the shortest key span (`spans`).

    `steps[(bucket, span)]` counts the calls of each graph: the tokens a replay decoded are those of its rows."""

    def __init__(self, model: Transformer, cache: KVCache, least_span: int | None = None):
        self.model, self.cache = model, cache
        self.scratch = cache.slots - 1
        self.buckets = buckets(self.scratch)
        self.spans = spans(cache.max_len, least_span or LEAST_SPAN)
        why = model_uncompilable(model)
        if why is not None:
            raise CompileError(f"no compiled decode step for this model: {why}")
        fixed = [layer.experts.fixed.max_tokens for layer in model.moe_layers
                 if isinstance(layer.experts, ExpertParallelExperts)]
        if fixed and min(fixed) < self.buckets[-1]:  # the padded rows are exchanged too
            raise CompileError(f"the largest batch bucket is {self.buckets[-1]} rows; the fixed all-to-all is sized "
                               f"for {min(fixed)} (use_fixed's max_tokens): at least {self.buckets[-1]} on every rank")
        device = model.tok_embeddings.weight.device
        self._span_views: dict[int, Tensor] = {}
        self.steps: Counter[tuple[int, int]] = Counter()
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        # One graph per bucket, each a cache entry of the one code object every compiled step shares: each step
        # makes room for its own (dynamo's default holds 8 per code object, then refuses to compile more), so
        # that several engines in one process (a benchmark's variants, a test module) never run out.
        torch._dynamo.config.cache_size_limit += len(self.buckets)
        self._step = torch.compile(_Step(model, cache), mode=mode, dynamic=False, fullgraph=True)

    def __call__(self, slots: list[int], ids_B: Tensor, positions: list[int]) -> tuple[Tensor, list[MoEAux]]:
        """(logits [B, 1, V], per-layer aux with the real rows' expert counts) for one decode step."""
        B = len(slots)
        size = self.bucket(B)
        need = max(positions) + 1
        span = next((s for s in self.spans if s >= need), None)
        if span is None or min(positions) < 0:
            raise ValueError(f"positions {min(positions)}..{need - 1} do not fit a cache of {self.cache.max_len}")
        pad = size - B
        self.cache.touch([*slots, self.scratch])
        device = ids_B.device
        slots_t = to_device(slots + [self.scratch] * pad, device)
        positions_t = to_device(positions + [0] * pad, device)[:, None]
        ids_t = torch.cat([ids_B, ids_B.new_zeros(pad)])[:, None]
        logits, counts = self._step(ids_t, slots_t, positions_t, self._span(span))
        self.steps[(size, span)] += 1
        if device.type == "cuda":  # a replayed graph's outputs are overwritten by the next replay
            logits, counts = logits.clone(), counts.clone()
        return logits[:B], [MoEAux(c, None) for c in counts.unbind(0)]

    def bucket(self, rows: int) -> int:
        """The batch bucket whose graph runs a step of `rows` rows."""
        size = next((b for b in self.buckets if b >= rows), None)
        if size is None:
            raise ValueError(f"{rows} rows in a decode step; the cache has {self.scratch} slots")
        return size

    def _span(self, span: int) -> Tensor:
        return span_view(self._span_views, self.cache, span)

    def warm_up(self, rows: int | None = None) -> None:
        """Compile each bucket's step (or the one bucket of `rows` rows) and (CUDA) record its graph at every span
        now, as a server does before it says ready; on CUDA the graphs are recorded on their second call. Every row
        is on the scratch slot at position 0: no sequence's keys are touched."""
        device = self.model.tok_embeddings.weight.device
        self.cache.touch([self.scratch])
        for b in self.buckets if rows is None else [self.bucket(rows)]:
            for span in self.spans:
                for _ in range(2 if device.type == "cuda" else 1):
                    self._step(torch.zeros(b, 1, dtype=torch.long, device=device),
                               torch.full((b,), self.scratch, device=device),
                               torch.zeros(b, 1, dtype=torch.long, device=device), self._span(span))


class CompiledPrefill:
    """A prompt chunk of one sequence as a compiled graph over the compiled decode step's cache: padded up to the
    first of `sizes` that holds it, attending over the first of `spans` that holds its keys. `steps[(size, span)]`
    counts each graph's calls. A chunk it cannot take (`fits` is None: longer than the largest size, keys past
    PREFILL_SPAN_MOST, or padding past the cache's end) runs eager."""

    def __init__(self, model: Transformer, cache: KVCache, least_span: int | None = None):
        why = model_uncompilable(model) or prefill_uncompilable(model)
        if why is not None:
            raise CompileError(f"no compiled prompt chunk for this model: {why}")
        self.model, self.cache = model, cache
        self.scratch = cache.slots - 1
        self.sizes = chunk_sizes(cache.max_len)
        self.spans = [s for s in spans(cache.max_len, least_span or LEAST_SPAN) if s <= PREFILL_SPAN_MOST]
        self._span_views: dict[int, Tensor] = {}
        self.steps: Counter[tuple[int, int]] = Counter()
        device = model.tok_embeddings.weight.device
        torch._dynamo.config.cache_size_limit += 1  # one compile: the chunk's length and its span are dynamic
        self._step = torch.compile(_Prefill(model, cache), mode="reduce-overhead" if device.type == "cuda" else
                                   "default", dynamic=False, fullgraph=True)

    def fits(self, n_tokens: int, start: int) -> tuple[int, int] | None:
        """(size, span) of a chunk of `n_tokens` from position `start`, or None where no graph takes it."""
        size = next((p for p in self.sizes if p >= n_tokens), None)
        span = next((s for s in self.spans if s >= start + n_tokens), None)
        if size is None or span is None or start < 0 or start + size > self.cache.max_len:
            return None
        return size, span

    def __call__(self, slot: int, ids_T: Tensor, start: int) -> tuple[Tensor, list[MoEAux]] | None:
        """(logits [1, 1, V] of the chunk's last token, per-layer aux with its tokens' expert counts), or None where
        no graph takes the chunk. Its keys go to slot `slot` from position `start`."""
        fit = self.fits(ids_T.shape[0], start)
        if fit is None or not 0 <= slot < self.scratch:
            return None
        self.cache.touch([slot])
        self.steps[fit] += 1
        return self.replay(slot, ids_T, start, fit)

    def replay(self, slot: int, ids_T: Tensor, start: int,
               fit: tuple[int, int] | None = None) -> tuple[Tensor, list[MoEAux]]:
        """__call__'s graph call, on any slot (the scratch too), of a chunk that `fits` (its (size, span) if known)."""
        T, device = ids_T.shape[0], ids_T.device
        size, span = fit or self.fits(T, start)
        logits, counts = self._run(torch.cat([ids_T, ids_T.new_zeros(size - T)])[None], to_device([slot], device),
                                   torch.arange(start, start + size, device=device)[None], span,
                                   to_device([T - 1], device))
        return logits, [MoEAux(c, None) for c in counts.unbind(0)]

    def _run(self, ids_1P: Tensor, slot_1: Tensor, positions_1P: Tensor, span: int,
             last_1: Tensor) -> tuple[Tensor, Tensor]:
        for t in (ids_1P, positions_1P):  # one compile for every size
            torch._dynamo.mark_dynamic(t, 1)
        logits, counts = self._step(ids_1P, slot_1, positions_1P, span_view(self._span_views, self.cache, span),
                                    last_1)
        if ids_1P.device.type == "cuda":  # a replayed graph's outputs are overwritten by the next replay
            logits, counts = logits.clone(), counts.clone()
        return logits, counts

    def warm_up(self) -> None:
        """Compile the chunk's step and (CUDA) record its graph for every size at every span that holds it, on the
        scratch slot from position 0."""
        device = self.model.tok_embeddings.weight.device
        self.cache.touch([self.scratch])
        scratch = torch.tensor([self.scratch], device=device)
        for size in self.sizes:
            for span in (s for s in self.spans if s >= size):
                for _ in range(2 if device.type == "cuda" else 1):
                    self._run(torch.zeros(1, size, dtype=torch.long, device=device), scratch,
                              torch.arange(size, device=device)[None], span,
                              torch.tensor([size - 1], device=device))


class CompiledBackend(EagerBackend):
    """The torch backend on plain weights whose decode step is one compiled graph per batch bucket (CompiledDecode),
    over a cache kept from one call to the next so that the graphs are built once, and whose prompt chunks run on
    one too where the model's experts compile for many tokens (CompiledPrefill: `graph_prefill`). The prompts of
    several sequences in one call run a graph each only where that many replays take less time than one eager call
    (`rows_on_graphs`, timed at warm-up): eager, the call reads the experts' weights once for all of them, a graph
    each reads them once a prompt, which for a big model's prompts arriving together costs more than the launches
    it saves. If a prompt chunk's graph fails, it says so and runs prompts eagerly for good (`graph_prefill` turns
    False); `fallback`: the same for the decode step's (`graph_decode`), else its failure is raised."""

    name = "compiled"

    def __init__(self, model: Transformer, plan: DispatchPlan, fallback: bool = False):
        if plan.pack_dense or plan.pack_experts or plan.kernel_dense or plan.kernel_experts or plan.kernel_norms:
            plan = dataclasses.replace(plan, pack_dense=False, pack_experts=False, kernel_dense=False,
                                       kernel_experts=False, kernel_norms=False,
                                       reason=f"{plan.reason}; plain weights for the compiled decode step")
        super().__init__(model, plan)
        self.fallback, self.graph_decode = fallback, True
        self.graph_prefill = prefill_uncompilable(model) is None
        self._decode: CompiledDecode | None = None
        self._prefill: CompiledPrefill | None = None
        self.rows_on_graphs = 1  # at most this many prompts of one call run a graph each (warm_up times it)

    def experts(self, plan: DispatchPlan) -> dict:
        return dict(pack=False, grouped_mm=plan.grouped_mm, gather_max=plan.gather_max,
                    decode_grouped=plan.decode_grouped, decode_reduce_max=plan.decode_reduce_max, graph=True)

    def form(self, m: nn.Module, plan: DispatchPlan) -> nn.Module | None:
        """The plan's forms, and quantized and biased (gpt-oss) experts indexed per token whatever the plan (on a CPU,
        too): the reference's dispatch reads its counts on the host, which a traced step cannot."""
        if type(m) in (QuantExperts, Fp8Experts):
            return indexed_experts(m, plan.gather_max)
        if type(m) is BiasedExperts:
            return GraphBiasedExperts.of(m)
        return super().form(m, plan)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        if not self.graph_decode:
            return super().new_cache(slots, max_len)
        if self._decode is None or self._decode.scratch < slots:  # one slot more: the padding rows' scratch
            self._decode = CompiledDecode(self.model, KVCache.for_model(self.model, slots + 1, spare=1))
            self._prefill = CompiledPrefill(self.model, self._decode.cache) if self.graph_prefill else None
        return self._decode.cache

    @property
    def graph_calls(self) -> int:
        """Calls of the compiled decode step's graphs so far (the warm-up's not counted)."""
        return sum(self._decode.steps.values()) if self._decode is not None else 0

    def warm_up(self, slots: int, rows: int | None = None) -> None:
        """Build the compiled decode step's graphs now, for up to `slots` rows (or for `rows` alone), and the prompt
        chunk's."""
        if self.graph_decode:
            self.new_cache(slots, self.cfg.max_seq_len)
            self._guarded(self._decode.warm_up, rows)
            if self._prefill is not None:
                self._guarded(self._prefill.warm_up, prefill=True)
                if self.graph_prefill:
                    self.rows_on_graphs = self._guarded(self._replays_per_eager_call, prefill=True) or 1

    def _replays_per_eager_call(self) -> int:
        """How many replays of the smallest chunk's graph take the time of one eager call of that chunk, each timed
        here on the scratch slot (the median of 3; a replay mostly reads the weights, an eager call also launches
        each of its operators)."""
        cache, scratch = self._decode.cache, self._decode.scratch
        ids = torch.zeros(PREFILL_LEAST, dtype=torch.long, device=self.device)

        def waited(fn):  # the call, and the device's work it queued
            return lambda: (fn(), torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None)

        ms = interleaved_ms({"graph": waited(lambda: self._prefill.replay(scratch, ids, 0)),
                             "eager": waited(lambda: super(CompiledBackend, self).prefill(cache, scratch, ids, 0))},
                            0.0, min_rounds=3, max_rounds=3)
        return max(1, int(statistics.median(ms["eager"]) / statistics.median(ms["graph"])))

    def _chunk_graph(self, cache: KVCache) -> CompiledPrefill | None:
        """The compiled prompt chunk over `cache`, where there is one and its graphs have not failed."""
        ok = self.graph_prefill and self._prefill is not None and self._decode is not None
        return self._prefill if ok and cache is self._decode.cache else None

    def prefill(self, cache: KVCache, slot: int, ids_S: Tensor, start: int, all_logits: bool = False) -> ModelOutput:
        chunk = None if all_logits else self._chunk_graph(cache)
        out = self._guarded(chunk, slot, ids_S, start, prefill=True) if chunk is not None else None
        if out is not None:
            return ModelOutput(*out, graph=True)
        return super().prefill(cache, slot, ids_S, start, all_logits)

    def step_rows(self, cache: KVCache, slots: list[int], ids: list[list[int]], starts: list[int]) -> ModelOutput:
        """Prompt chunks of several sequences (a compiled runner's decode rows never ride along): a graph each where
        there are at most `rows_on_graphs` of them and a graph takes each, else one eager call."""
        chunk = self._chunk_graph(cache)
        if (chunk is None or not self.graph_decode or len(ids) > self.rows_on_graphs
                or any(chunk.fits(len(t), a) is None for t, a in zip(ids, starts))):
            return super().step_rows(cache, slots, ids, starts)
        outs = [self.prefill(cache, s, to_device(t, self.device), a) for s, t, a in zip(slots, ids, starts)]
        aux = [MoEAux(torch.stack([o.aux[i].counts for o in outs]).sum(0), None) for i in range(len(outs[0].aux))]
        return ModelOutput(torch.cat([o.logits for o in outs]), aux, graph=all(o.graph for o in outs))

    def decode(self, cache: KVCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        if self.graph_decode and self._decode is not None and cache is self._decode.cache:
            out = self._guarded(self._decode, slots, ids_B, positions)
            if out is not None:
                return ModelOutput(*out, graph=True)
        return super().decode(cache, slots, ids_B, positions)

    def _guarded(self, fn, *args, prefill: bool = False):
        """fn(*args); if it fails, log why, run that call eagerly for good and return None: a prompt chunk's graph
        always (`--compile on` asks for the decode step's), the decode step's where the compiled step was only asked
        for where it may help ('auto')."""
        try:
            return fn(*args)
        except Exception as e:
            if not (self.fallback or prefill):
                raise
            what = "prompt chunk" if prefill else "decode step"
            log.warning("moeserve: the compiled %s failed (%s: %s); running eager", what, type(e).__name__, e)
            if prefill:
                self.graph_prefill = False
            else:
                self.graph_decode = False
            return None
