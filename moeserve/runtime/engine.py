"""The engine: one loaded model behind the text-level calls the CLI, the server, the exporter and the benchmarks
make: encode, generate (complete), score, classify, route.

The Engine holds an Executor (executor.py: the backend that runs the model, its lock, its expert-load counter)
and a tokenizer, and does what is the same whatever runs the model: text, padding, the arithmetic of scores.
Generation runs on the step engine (steps.py), over a slot KV cache: `complete` is a static batch of it, and a
server keeps one running and lets requests join it (continuous batching). Scoring and classification run whole
right-padded batches; padding is masked out of attention and never routed to an expert (so it neither changes
nor is counted in the expert load).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, NamedTuple

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime import BACKENDS, COMPILE_MODES
from moeserve.runtime.backends import ModelRunner
from moeserve.runtime.backends.calibration import resolve_mode
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.device import cpu_has_fast_bf16, dtype_unsupported
from moeserve.runtime.executor import Executor, ExpertLoad
from moeserve.runtime.loading import load_model, verifying
from moeserve.runtime.model import ExpertsFactory, Transformer
from moeserve.runtime.output import StreamEvent
from moeserve.runtime.quant import QuantSpec, quantize_model_
from moeserve.runtime.quant_fp8 import check_fp8, quantize_model_fp8_
from moeserve.runtime.sampling import EngineError, SamplingParams
from moeserve.runtime.scores import bits_per_byte
from moeserve.runtime.steps import Completion, Sequence, StepEngine, check_request
from moeserve.runtime.validate import check_text
from moeserve.runtime.windows import batch_end, check_stride, default_stride, rolling_windows
from moeserve.tokenizer import Tokenizer, load_checkpoint_tokenizer

__all__ = ["Completion", "Engine", "EngineError", "ExpertLoad", "RowScore", "SamplingParams", "Score", "load_engine"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {str(device)!r} asked for, but torch sees no CUDA GPU")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': bf16 on GPUs and on CPUs with native bf16 GEMMs (AMX / AVX512-BF16), else fp32. Any dtype
    torch runs here is accepted, fast or not (bf16 on an AVX2-only CPU runs, slowly); one it cannot run
    is an EngineError naming it, not a traceback from the first forward pass."""
    if dtype == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
        return torch.bfloat16 if fast else torch.float32
    if not isinstance(dtype, torch.dtype) and dtype not in DTYPES:
        raise EngineError(f"dtype {dtype!r}: expected 'auto' or one of {', '.join(sorted(DTYPES))}")
    dt = DTYPES.get(dtype, dtype)
    why = dtype_unsupported(str(device), dt)
    if why is not None:
        raise EngineError(f"dtype {str(dt).removeprefix('torch.')} does not run on this {device.type} with torch "
                          f"{torch.__version__} ({why}); use float32")
    return dt


class RowScore(NamedTuple):
    """What `Engine.score_ids` gives per row of token ids."""

    logprob: float  # sum of log p(token | tokens before it in its window)
    n_tokens: int  # tokens scored: all but the first
    windows: int  # forward windows it took: 1 within the context, more for a longer row (windows.py)


@dataclass
class Score:
    logprob: float  # natural log-probability of the text's tokens, each given those before it
    n_tokens: int  # tokens scored (the <bos> that conditions the first is not one of them)
    bits_per_byte: float  # -logprob / ln 2 / UTF-8 bytes of the text
    windows: int = 1  # context windows a text longer than the context was scored in

    @classmethod
    def of(cls, row: RowScore, text: str) -> "Score":
        return cls(row.logprob, row.n_tokens, bits_per_byte(row.logprob, text), row.windows)

    def as_dict(self) -> dict:
        return {"logprob": self.logprob, "n_tokens": self.n_tokens, "bits_per_byte": self.bits_per_byte,
                "windows": self.windows}


# on_event(row, event): a row's stream events (output.StreamEvent: text as it becomes final, the tokens that
# brought it, their log-probability records where asked for, and the finish reason on the last).
RowEventCallback = Callable[[int, StreamEvent], None]
# cancel(row) -> True: stop generating for that row now.
CancelCheck = Callable[[int], bool]


class Engine:
    """A model's executor and its tokenizer: one call into the model at a time (the executor's lock guards the
    backend and its caches). `plan`, `calibration` and `compile` choose and lay out the backend (Executor)."""

    def __init__(self, model: Transformer | ModelRunner, tokenizer: Tokenizer | None = None, *, name: str = "model",
                 path: Path | None = None, plan: DispatchPlan | None = None, calibration: str | None = None,
                 compile: str = "off"):
        self.executor = Executor(model, plan, calibration, compile)
        self.cfg: MoEConfig = self.executor.cfg
        self.tokenizer = tokenizer
        self.name, self.path = name, path

    # the executor's, read here (and the runner replaceable, as tests slow it down)
    @property
    def runner(self) -> ModelRunner:
        return self.executor.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self.executor.runner = runner

    @property
    def model(self) -> Transformer | None:
        return self.executor.model

    @property
    def plan(self) -> DispatchPlan | None:
        return self.executor.plan

    @property
    def expert_load(self) -> ExpertLoad:
        return self.executor.expert_load

    @property
    def lock(self) -> threading.RLock:
        return self.executor.lock

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.dtype

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
             *, verify: bool = True, plan: DispatchPlan | None = None, calibration: str | None = None,
             compile: str = "off", experts_factory: ExpertsFactory | None = None,
             quantize: str | QuantSpec | None = None) -> "Engine":
        """A moeserve checkpoint or a Hugging Face directory (Mixtral, Qwen-MoE, OLMoE), in `dtype` on `device`; with
        `experts_factory`, without its experts, which the factory's modules compute (loading.load_model).
        `quantize` ('int8', 'int4' or a QuantSpec): its weights quantized as they load (runtime/quant.py); 'fp8' on a
        GPU that has fp8 arithmetic (runtime/quant_fp8.py; elsewhere Fp8Unavailable, before any weight is read)."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        resolve_mode(calibration)  # bad modes are named before the weights are read
        if compile not in COMPILE_MODES:
            raise EngineError(f"compile mode {compile!r}: expected one of {', '.join(COMPILE_MODES)}")
        fp8 = quantize == "fp8"
        if fp8:
            check_fp8(dev)
        spec = None if fp8 else QuantSpec.parse(quantize) if isinstance(quantize, str) else quantize
        with verifying(path, verify):
            model, ckpt = load_model(path, device=dev, dtype=dt, verify=False, experts_factory=experts_factory)
            if fp8:
                quantize_model_fp8_(model)
            elif spec is not None:
                quantize_model_(model, spec)
            tokenizer = load_checkpoint_tokenizer(ckpt.path, ckpt.config)
            return cls(model, tokenizer, name=Path(path).name or str(path), path=ckpt.path, plan=plan,
                       calibration=calibration, compile=compile)

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer | None = None, dtype: str | torch.dtype = "float32",
                   device: str | torch.device = "cpu", **kwargs) -> "Engine":
        dev = resolve_device(device)
        return cls(model.to(device=dev, dtype=resolve_dtype(dtype, dev)), tokenizer, **kwargs)

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id if self.tokenizer is not None else self.cfg.extra.get("eos_token_id")

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """LongTensor [B, T] -> logits [B, T, V] (float32; [B, C] for classifiers)."""
        return self.executor.run(input_ids, attention_mask).logits.float()

    # ---- text helpers ------------------------------------------------------------------------
    def text_tokenizer(self) -> Tokenizer:
        """The tokenizer, or an EngineError saying there is none."""
        if self.tokenizer is None:
            raise EngineError(f"{self.name} has no tokenizer (no tokenizer.json); pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str, what: str = "text", *, any_length: bool = False) -> list[int]:
        """<bos> + the text's ids; longer than the context is an error unless `any_length` (scoring)."""
        check_text(text, what)
        ids = self.text_tokenizer().encode(text, bos=True)
        if len(ids) > self.cfg.max_seq_len and not any_length:
            raise EngineError(f"{what} is {len(ids)} tokens; the model's context is {self.cfg.max_seq_len}")
        return ids

    def _right_pad(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(ids [B, S], attention_mask [B, S]) with each row's tokens first and zeros after."""
        S = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), 1
        return ids.to(self.device), mask.to(self.device)

    # ---- generation --------------------------------------------------------------------------
    def step_engine(self, slots: int, max_len: int | None = None, prefill_chunk: int = 512,
                    share_prefill: bool = True) -> StepEngine:
        """A step engine over this model with a cache of `slots` sequences of `max_len` positions (default: the
        model's context), its expert load counted here. The caller steps it on one thread (the server's model
        thread) and holds `lock` around each step if others use the engine."""
        if self.cfg.task != "lm":
            raise EngineError(f"{self.name} is a {self.cfg.task} model; generation needs a language model")
        return self.executor.step_engine(self.tokenizer, self.eos_id, slots, max_len, prefill_chunk, share_prefill)

    def generate(self, prompts: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: list[str] | None = None) -> list[str]:
        """Continue each prompt; returns the continuations only, one per prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, list(stop or []))
        return [c.text for c in self.complete(prompts, params)]

    def complete(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_event: RowEventCallback | None = None, cancel: CancelCheck | None = None) -> list[Completion]:
        """The full answer per prompt (text, tokens, why it ended), as one static batch: every prompt starts
        together, each ends on its own, each with its own sampling params (one for all, or one each). Prompts are
        texts, or token ids already encoded (then a model without a tokenizer answers with tokens and no text).
        `cancel(row)`, asked before each step, ends a row early (reason "cancelled"): a server drops a request
        whose client left or whose deadline passed without holding up the rest."""
        if not prompts:
            return []
        rows = [self.encode(p, f"prompt {i}") if isinstance(p, str) else list(p) for i, p in enumerate(prompts)]
        params = [params] * len(rows) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(rows):
            raise EngineError(f"{len(rows)} prompts but {len(params)} sampling params")
        seqs = [Sequence(row, p, on_event=(lambda e, b=b: on_event(b, e)) if on_event else None,
                         cancelled=(lambda b=b: cancel(b)) if cancel else None)
                for b, (row, p) in enumerate(zip(rows, params))]
        for i, s in enumerate(seqs):  # every row is checked before any runs
            check_request(self.cfg, self.tokenizer, s.prompt, s.params, f"prompt {i}")
        longest = max(len(s.prompt) + min(s.params.max_new_tokens, self.cfg.max_seq_len - len(s.prompt)) for s in seqs)
        with self.lock:
            return [s.completion() for s in self.step_engine(len(seqs), max_len=longest).run(seqs)]

    # ---- scoring ---------------------------------------------------------------------------
    def score_ids(self, rows: list[list[int]], stride: int | None = None,
                  max_batch_tokens: int = 16384) -> list[RowScore]:
        """Per row, the sum of log p(token | tokens before) over every token but the first, which only
        conditions. A row longer than the context is scored in rolling windows `stride` tokens apart
        (windows.py; default half the context). Rows and windows run in order, in consecutive batches of at
        most `max_batch_tokens` padded tokens (a row or window wider than that alone)."""
        slices = self.score_slices(rows, stride, max_batch_tokens)
        while True:
            try:
                next(slices)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def score_slices(self, rows: list[list[int]], stride: int | None = None,
                     max_batch_tokens: int = 16384) -> Generator[int, int | None, list[RowScore]]:
        """`score_ids` one model call at a time: yields the padded tokens of each batch it has run, and returns
        the scores. What is sent in at a yield is the next batch's token budget (None: `max_batch_tokens`). A
        server runs a long scoring request a batch per turn, small ones between decode steps, and stops it
        between two batches once its deadline passes (serve/batcher.py)."""
        if not rows:
            return []
        C = self.cfg.max_seq_len
        if stride is not None:
            try:
                check_stride(stride, C)
            except ValueError as e:
                raise EngineError(str(e)) from None
        stride = default_stride(C) if stride is None else stride
        windows = [(i, row[a:b], k) for i, row in enumerate(rows) for a, b, k in rolling_windows(len(row), C, stride)]
        sums, counts = [0.0] * len(rows), [0] * len(rows)
        widths, start, budget = [len(ids) for _, ids, _ in windows], 0, max_batch_tokens
        while start < len(windows):
            stop = batch_end(widths, start, budget)
            group, start = windows[start:stop], stop
            logp, _ = self._token_logp([ids for _, ids, _ in group])
            # window w scores positions [len - 1 - scored, len - 1) of its log-probabilities
            end = torch.tensor([len(ids) - 1 for _, ids, _ in group], device=logp.device)[:, None]
            first = end - torch.tensor([k for *_, k in group], device=logp.device)[:, None]
            pos = torch.arange(logp.shape[1], device=logp.device)
            for (i, _, _), lp in zip(group, (logp * ((pos >= first) & (pos < end))).sum(-1).tolist()):
                sums[i] += lp
                counts[i] += 1
            budget = (yield len(group) * max(len(ids) for _, ids, _ in group)) or max_batch_tokens
        return [RowScore(s, len(r) - 1, w) for s, r, w in zip(sums, rows, counts)]

    @torch.inference_mode()
    def token_logprobs_ids(self, rows: list[list[int]]) -> list[list[float]]:
        """Per row, log p(token | tokens before) of each token after the first: the terms `score_ids` sums."""
        if not rows:
            return []
        logp, _ = self._token_logp(rows)
        return [lp[:len(r) - 1] for lp, r in zip(logp.tolist(), rows)]

    def _token_logp(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(log p of tokens 1.. of each right-padded row [B, S-1], float32; the mask of real tokens)."""
        if self.cfg.task != "lm":
            raise EngineError(f"{self.name} is a {self.cfg.task} model; scoring needs a language model")
        ids, mask = self._right_pad(rows)  # causal attention never reaches the padding
        return self.executor.token_logprobs(ids, mask), mask[:, 1:]

    def score(self, texts: list[str], stride: int | None = None) -> list[Score]:
        """Per text: log-probability, tokens scored, bits per UTF-8 byte, windows (any length: see score_ids)."""
        rows = [self.encode(t, f"text {i}", any_length=True) for i, t in enumerate(texts)]
        return [Score.of(row, t) for row, t in zip(self.score_ids(rows, stride), texts)]

    # ---- classification and routes -------------------------------------------------------------
    def classify(self, inputs: list[str] | list[list[int]]) -> list[list[float]]:
        """Class probabilities per text (or per row of token ids already encoded), for classification checkpoints."""
        if self.cfg.task != "classify":
            raise EngineError(f"{self.name} is a language model; classify needs a classification checkpoint")
        if not inputs:
            return []
        ids, mask = self._right_pad([self.encode(t, f"text {i}") if isinstance(t, str) else list(t)
                                     for i, t in enumerate(inputs)])
        return self.executor.run(ids, attention_mask=mask).logits.float().softmax(-1).tolist()

    def route(self, text: str) -> list[list[list[int]]]:
        """Per MoE layer, per token (including <bos>), the experts it was sent to."""
        out = self.executor.run(torch.tensor([self.encode(text)]))
        routes = []
        for a in out.aux:
            routes.append(a.routing.expert_ids.tolist() if a.routing is not None else a.codes[:, None].tolist())
        return routes


def load_engine(path: str | os.PathLike, backend: str = "auto", dtype: str | torch.dtype = "auto",
                device: str | torch.device = "auto", *, threads: int | None = None, verify: bool = True,
                calibration: str | None = None, compile: str = "off", quantize: str | None = None) -> Engine:
    """A checkpoint directory on torch, or a graph from `moeserve export onnx` on ONNX Runtime
    (runtime/backends/onnx.py); backend 'auto' goes by the path: a .onnx file is an export. `calibration`
    is the torch Engine's (an ONNX Runtime session chooses its own kernels); `quantize` ('int8', 'int4') too."""
    if backend not in BACKENDS:
        raise EngineError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    is_onnx = Path(path).suffix == ".onnx"
    if backend == "onnx" or (backend == "auto" and is_onnx):
        from moeserve.runtime.backends.onnx import load_onnx_backend  # onnxruntime is an optional dependency

        if compile == "on":
            raise EngineError("--compile on: an ONNX Runtime session is compiled by onnxruntime itself; use auto or off")
        if quantize is not None:
            raise EngineError(f"--quantize {quantize}: an ONNX export runs as it was exported; quantize the checkpoint")
        runner, tokenizer = load_onnx_backend(path, dtype=str(dtype), device=str(device), threads=threads)
        return Engine(runner, tokenizer, name=Path(path).stem, path=Path(path))
    if is_onnx:
        raise EngineError(f"{path} is an ONNX export; run it with --backend onnx (or auto)")
    return Engine.load(path, dtype=dtype, device=device, verify=verify, calibration=calibration, compile=compile,
                       quantize=quantize)
