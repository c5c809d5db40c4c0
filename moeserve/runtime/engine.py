"""The inference engine: one loaded model behind the calls the CLI, the server, the exporter and the
benchmarks make: forward, generate, score, classify, route, with expert-load accounting.

Batches of unequal prompts are left-padded: a row's padding is masked out of attention, is never
routed to an expert (so it neither changes nor is counted in the expert load), and RoPE positions
start at 0 at each row's first real token. Each row therefore computes what it would alone, up to the
rounding of batched GEMMs; each row samples from its own seeded generator, so sampling is
reproducible per request whatever it is batched with.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime import BACKENDS
from moeserve.runtime.calibration import DispatchPlan, ExpertShape, plan_for, resolve_mode
from moeserve.runtime.device import cpu_has_fast_bf16, dtype_unsupported
from moeserve.runtime.model import ModelOutput, Transformer
from moeserve.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class EngineError(ValueError):  # a ValueError, so the CLI reports it as a user error
    """A request the model cannot serve as asked (too long, empty, wrong task, no tokenizer)."""


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


class ExpertLoad:
    """Tokens routed to each (MoE layer, expert) since the last reset: one [L, E] int64 counter that
    every forward adds its per-layer bincounts to. Thread-safe, so a metrics endpoint can read it
    while a worker thread runs the model."""

    def __init__(self, n_layers: int, n_experts: int):
        self._counts = torch.zeros(n_layers, n_experts, dtype=torch.int64)
        self._lock = threading.Lock()

    def add(self, per_layer: Sequence[Tensor | None]) -> None:
        if not per_layer or any(c is None for c in per_layer):
            return
        counts = torch.stack(list(per_layer)).cpu()
        with self._lock:
            self._counts += counts

    def snapshot(self) -> Tensor:
        with self._lock:
            return self._counts.clone()

    def reset(self) -> Tensor:
        """Return the counts so far and start again from zero."""
        with self._lock:
            out, self._counts = self._counts, torch.zeros_like(self._counts)
        return out


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None = fresh entropy
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these
    ignore_eos: bool = False

    def validate(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise EngineError(f"max_new_tokens = {self.max_new_tokens!r}: expected an integer >= 0")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise EngineError(f"temperature = {self.temperature!r}: expected a finite number >= 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise EngineError(f"top_k = {self.top_k!r}: expected an integer >= 1 or None")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise EngineError(f"top_p = {self.top_p!r}: expected a number in (0, 1] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineError(f"stop = {self.stop!r}: expected non-empty strings")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or a stop string), "length", or "cancelled"
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Score:
    logprob: float  # natural log-probability of the text's tokens, each given those before it
    n_tokens: int  # tokens scored (the <bos> that conditions the first is not one of them)
    bits_per_byte: float  # -logprob / ln 2 / UTF-8 bytes of the text

    @classmethod
    def of(cls, logprob: float, n_tokens: int, text: str) -> "Score":
        return cls(logprob, n_tokens, -logprob / math.log(2) / len(text.encode("utf-8")))

    def as_dict(self) -> dict:
        return {"logprob": self.logprob, "n_tokens": self.n_tokens, "bits_per_byte": self.bits_per_byte}


# on_token(row, token_id): called as each new token of each row is chosen (for streaming).
TokenCallback = Callable[[int, int], None]
# cancel(row) -> True: stop generating for that row now.
CancelCheck = Callable[[int], bool]


# Below this temperature sampling is the argmax in all but name, and logits / temperature would overflow
# float32 to inf (NaN probabilities): such temperatures are served greedily.
MIN_TEMPERATURE = 1e-6


def _filter_logits(logits_V: Tensor, p: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p (the smallest set of tokens whose mass reaches p; never empty)."""
    scaled = logits_V.float() / p.temperature
    if p.top_k is not None and p.top_k < scaled.numel():
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1:
        sorted_V, idx = scaled.sort(descending=True)
        cum = sorted_V.softmax(-1).cumsum(-1)
        drop = cum - sorted_V.softmax(-1) >= p.top_p  # mass before this token already reaches p
        drop[0] = False  # the likeliest token stays, even for a top_p that float32 rounds to 0
        scaled = scaled.scatter(0, idx, sorted_V.masked_fill(drop, float("-inf")))
    return scaled


class Engine:
    """A model, its tokenizer, and the expert-load counter; one call at a time (a lock guards the
    model, whose KV cache is per call).

    The model is laid out by a DispatchPlan (calibration.py): `plan` if given, else the one measured
    for this model's shapes on this machine (cached after the first time; `calibration` 'off' takes the
    unmeasured defaults, 'redo' measures again; None: $MOESERVE_CALIBRATION, else 'auto')."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *, name: str = "model",
                 path: Path | None = None, plan: DispatchPlan | None = None, calibration: str | None = None):
        self.model = model.eval()
        self.cfg: MoEConfig = model.cfg
        self.tokenizer = tokenizer
        self.name, self.path = name, path
        self.expert_load = ExpertLoad(len(model.moe_layers), self.cfg.n_experts)
        self._lock = threading.RLock()
        if plan is None:
            shape = ExpertShape.of(self.cfg) if model.moe_layers else None
            plan = plan_for(shape, self.device, self.dtype, calibration)
        self.plan = model.prepare_inference(plan)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
             *, verify: bool = True, plan: DispatchPlan | None = None, calibration: str | None = None) -> "Engine":
        """A moeserve checkpoint or a Hugging Face Mixtral directory, in `dtype` on `device`."""
        from moeserve.checkpoint import load_model
        from moeserve.tokenizer import load_checkpoint_tokenizer

        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        resolve_mode(calibration)  # a bad mode is named before the weights are read
        model, ckpt = load_model(path, verify=verify)
        model = model.to(device=dev, dtype=dt)
        tokenizer = load_checkpoint_tokenizer(ckpt.path, ckpt.config)
        return cls(model, tokenizer, name=Path(path).name or str(path), path=ckpt.path, plan=plan,
                   calibration=calibration)

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer | None = None, dtype: str | torch.dtype = "float32",
                   device: str | torch.device = "cpu", **kwargs) -> "Engine":
        dev = resolve_device(device)
        return cls(model.to(device=dev, dtype=resolve_dtype(dtype, dev)), tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.tok_embeddings.weight.dtype

    # ---- forward ---------------------------------------------------------------------------
    def _run(self, input_ids: Tensor, **kwargs) -> ModelOutput:
        out = self.model(input_ids, **kwargs)
        self.expert_load.add([a.counts for a in out.aux])
        return out

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """LongTensor [B, T] -> logits [B, T, V] (float32; [B, C] for classifiers)."""
        with self._lock:
            ids = input_ids.to(self.device)
            mask = None if attention_mask is None else attention_mask.to(self.device)
            return self._run(ids, attention_mask=mask).logits.float()

    # ---- text helpers ------------------------------------------------------------------------
    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise EngineError(f"{self.name} has no tokenizer (no tokenizer.json); pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str, what: str = "text") -> list[int]:
        if not isinstance(text, str):
            raise EngineError(f"{what} must be a string, got {type(text).__name__}")
        if not text:
            raise EngineError(f"{what} is empty")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise EngineError(f"{what} is not valid Unicode ({e.reason} at character {e.start})") from e
        ids = self._tok().encode(text, bos=True)
        if len(ids) > self.cfg.max_seq_len:
            raise EngineError(f"{what} is {len(ids)} tokens; the model's context is {self.cfg.max_seq_len}")
        return ids

    def _left_pad(self, rows: list[list[int]], width: int) -> tuple[Tensor, Tensor, Tensor]:
        """(ids [B, S], attention_mask [B, width], position_ids [B, S]); S = longest row, real tokens
        at the right of the first S columns, mask 1 on them and on every column past S."""
        S = max(len(r) for r in rows)
        pad = self.tokenizer.pad_id if self.tokenizer is not None else 0
        ids = torch.full((len(rows), S), pad, dtype=torch.long)
        mask = torch.ones(len(rows), width, dtype=torch.long)
        pos = torch.zeros(len(rows), S, dtype=torch.long)
        for b, r in enumerate(rows):
            n = len(r)
            ids[b, S - n:] = torch.tensor(r)
            mask[b, : S - n] = 0
            pos[b, S - n:] = torch.arange(n)
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def _right_pad(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(ids [B, S], attention_mask [B, S]) with each row's tokens first and zeros after."""
        S = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), 1
        return ids.to(self.device), mask.to(self.device)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: list[str] | None = None) -> list[str]:
        """Continue each prompt; returns the continuations only, one per prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, list(stop or []))
        return [c.text for c in self.complete(prompts, [params] * len(prompts))]

    def complete(self, prompts: list[str], params: list[SamplingParams],
                 on_token: TokenCallback | None = None) -> list[Completion]:
        """The full answer per prompt (text, tokens, why it ended), each with its own sampling params."""
        rows = [self.encode(p, f"prompt {i}") for i, p in enumerate(prompts)]
        return self.complete_ids(rows, params, on_token)

    def complete_ids(self, rows: list[list[int]], params: list[SamplingParams], on_token: TokenCallback | None = None,
                     cancel: CancelCheck | None = None) -> list[Completion]:
        """`complete` for prompts already encoded (the server encodes and checks them per request)."""
        tok = self._tok()
        out_ids, reasons = self.generate_ids(rows, params, on_token, stop_decode=tok.decode, cancel=cancel)
        completions = []
        for ids, why, p, row in zip(out_ids, reasons, params, rows):
            text = tok.decode(ids)
            for s in p.stop:
                if s in text:
                    text, why = text[: text.index(s)], "stop"
            completions.append(Completion(text, ids, why, len(row)))
        return completions

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     on_token: TokenCallback | None = None,
                     stop_decode: Callable[[list[int]], str] | None = None,
                     cancel: CancelCheck | None = None) -> tuple[list[list[int]], list[str]]:
        """Token-level generation for a batch: (new token ids per prompt, finish reason per prompt).
        `stop_decode` turns ids into text to look for stop strings (needed only if any are given).
        `cancel(row)`, asked before each step, ends a row early (reason "cancelled"): a server drops a
        request whose client left or whose deadline passed without holding up the rest of its batch."""
        if not prompts:
            return [], []
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for i, (row, p) in enumerate(zip(prompts, params)):
            p.validate()
            if not row:
                raise EngineError(f"prompt {i} has no tokens")
            if len(row) >= self.cfg.max_seq_len and p.max_new_tokens > 0:
                raise EngineError(f"prompt {i} is {len(row)} tokens; the model's context is {self.cfg.max_seq_len}")
            if any((not isinstance(t, int)) or t < 0 or t >= self.cfg.vocab_size for t in row):
                raise EngineError(f"prompt {i} has a token id outside [0, {self.cfg.vocab_size})")
        budgets = [min(p.max_new_tokens, self.cfg.max_seq_len - len(r)) for r, p in zip(prompts, params)]
        eos = self.tokenizer.eos_id if self.tokenizer is not None else self.cfg.extra.get("eos_token_id")
        gens = [torch.Generator().manual_seed(p.seed if p.seed is not None else secrets.randbits(63)) for p in params]
        B = len(prompts)
        S = max(len(r) for r in prompts)
        steps = max(budgets)
        out: list[list[int]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        done = [b == 0 for b in budgets]
        if steps == 0:
            return out, reasons
        with self._lock:
            ids, mask, pos = self._left_pad(prompts, S + steps)
            lengths = torch.tensor([len(r) for r in prompts], device=self.device)
            try:
                logits = self._prefill(ids, mask, pos, S + steps)
                for i in range(steps):
                    if cancel is not None:
                        for b in range(B):
                            if not done[b] and cancel(b):
                                done[b], reasons[b] = True, "cancelled"
                    next_ids = [self._choose(logits[b], params[b], gens[b]) if not done[b] else 0 for b in range(B)]
                    for b in range(B):
                        if done[b]:
                            continue
                        t = next_ids[b]
                        if t == eos and not params[b].ignore_eos:
                            done[b], reasons[b] = True, "stop"
                            continue
                        out[b].append(t)
                        if on_token is not None:
                            on_token(b, t)
                        if len(out[b]) >= budgets[b]:
                            done[b] = True
                        elif params[b].stop and stop_decode is not None:
                            text = stop_decode(out[b])
                            if any(s in text for s in params[b].stop):
                                done[b], reasons[b] = True, "stop"
                    if all(done) or i + 1 == steps:
                        break
                    col = S + i
                    for b in range(B):  # a finished row's next token is padding: not attended, not routed
                        if done[b]:
                            mask[b, col] = 0
                    step_ids = torch.tensor(next_ids, device=self.device)[:, None]
                    logits = self._decode(step_ids, col, mask, (lengths + i)[:, None])
            finally:
                self._end_decode()
        return out, reasons

    # The model calls of generation; an engine over another backend (onnx_engine.py) supplies its own.
    def _prefill(self, ids: Tensor, mask: Tensor, pos: Tensor, length: int) -> Tensor:
        """Left-padded prompts ids [B, S] in, next-token logits [B, V] out; room for `length` positions."""
        self.model.setup_cache(ids.shape[0], length)
        S = ids.shape[1]
        return self._run(ids, input_pos=torch.arange(S, device=self.device), attention_mask=mask,
                         position_ids=pos).logits[:, -1]

    def _decode(self, step_ids: Tensor, col: int, mask: Tensor, position_ids: Tensor) -> Tensor:
        """One new token per row, ids [B, 1] written at column `col`; next-token logits [B, V]."""
        return self._run(step_ids, input_pos=torch.tensor([col], device=self.device), attention_mask=mask,
                         position_ids=position_ids).logits[:, -1]

    def _end_decode(self) -> None:
        self.model.clear_cache()

    @staticmethod
    def _choose(logits_V: Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        if p.temperature < MIN_TEMPERATURE:
            return int(logits_V.argmax())
        probs = _filter_logits(logits_V, p).softmax(-1).cpu()
        return int(torch.multinomial(probs, 1, generator=gen))

    # ---- scoring ---------------------------------------------------------------------------
    @torch.inference_mode()
    def score_ids(self, rows: list[list[int]]) -> list[tuple[float, int]]:
        """(sum of log p(token | tokens before), tokens scored) per row; the first token only conditions."""
        if not rows:
            return []
        if self.cfg.task != "lm":
            raise EngineError(f"{self.name} is a {self.cfg.task} model; scoring needs a language model")
        ids, mask = self._right_pad(rows)  # causal attention never reaches the padding
        with self._lock:
            logits = self._run(ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        logp = (logp * mask[:, 1:]).sum(-1)
        return [(float(lp), len(r) - 1) for lp, r in zip(logp.tolist(), rows)]

    def score(self, texts: list[str]) -> list[Score]:
        """Per text: log-probability, tokens scored, bits per UTF-8 byte."""
        rows = [self.encode(t, f"text {i}") for i, t in enumerate(texts)]
        return [Score.of(lp, n, t) for (lp, n), t in zip(self.score_ids(rows), texts)]

    # ---- classification and routes -------------------------------------------------------------
    @torch.inference_mode()
    def classify(self, texts: list[str]) -> list[list[float]]:
        """Class probabilities per text, for classification checkpoints."""
        if self.cfg.task != "classify":
            raise EngineError(f"{self.name} is a language model; classify needs a classification checkpoint")
        return self.classify_ids([self.encode(t, f"text {i}") for i, t in enumerate(texts)])

    @torch.inference_mode()
    def classify_ids(self, rows: list[list[int]]) -> list[list[float]]:
        if self.cfg.task != "classify":
            raise EngineError(f"{self.name} is a language model; classify needs a classification checkpoint")
        if not rows:
            return []
        ids, mask = self._right_pad(rows)
        with self._lock:
            logits = self._run(ids, attention_mask=mask).logits
        return logits.float().softmax(-1).tolist()

    @torch.inference_mode()
    def route(self, text: str) -> list[list[list[int]]]:
        """Per MoE layer, per token (including <bos>), the experts it was sent to."""
        ids = torch.tensor([self.encode(text)], device=self.device)
        with self._lock:
            out = self._run(ids)
        routes = []
        for a in out.aux:
            routes.append(a.routing.expert_ids.tolist() if a.routing is not None else a.codes[:, None].tolist())
        return routes


def load_engine(path: str | os.PathLike, backend: str = "auto", dtype: str | torch.dtype = "auto",
                device: str | torch.device = "auto", *, threads: int | None = None,
                calibration: str | None = None) -> Engine:
    """A checkpoint directory on torch, or a graph from `moeserve export onnx` on ONNX Runtime
    (runtime/onnx_engine.py); backend 'auto' goes by the path: a .onnx file is an export. `calibration`
    is the torch Engine's (an ONNX Runtime session chooses its own kernels)."""
    if backend not in BACKENDS:
        raise EngineError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    is_onnx = Path(path).suffix == ".onnx"
    if backend == "onnx" or (backend == "auto" and is_onnx):
        from moeserve.runtime.onnx_engine import OnnxEngine

        return OnnxEngine.load(path, dtype=str(dtype), device=str(device), threads=threads)
    if is_onnx:
        raise EngineError(f"{path} is an ONNX export; run it with --backend onnx (or auto)")
    return Engine.load(path, dtype=dtype, device=device, calibration=calibration)
