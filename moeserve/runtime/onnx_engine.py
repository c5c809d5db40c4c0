"""The Engine's surface (forward, score, classify, generate, route, expert load) over an ONNX Runtime
session of a graph that `moeserve export onnx` wrote, so that serve, score and bench run an exported
model as they run a checkpoint (`--backend onnx`, or any path ending in .onnx).

The graph carries its config and tokenizer in its metadata, so the .onnx file alone is enough.
Generation runs the prompt, then one token per step: with a KV-cache export (`--kv-cache`) each step
feeds the previous step's keys and values back; with a plain forward graph each step recomputes the
whole prefix (correct, O(n^2) in the generated length). Either way prompts are left-padded and positions
are column indices: that shifts a row's positions by a constant, which RoPE attention does not see, so
each row gets what it would alone.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.engine import Engine, EngineError, ExpertLoad
from moeserve.runtime.model import ModelOutput
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.routing import Routing
from moeserve.tokenizer import HFTokenizer, Tokenizer, load_tokenizer


def onnx_providers(device: str) -> list[str]:
    """ONNX Runtime execution providers for 'auto' (CUDA when onnxruntime-gpu sees a GPU), 'cpu', 'cuda'."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    device = str(device)
    if device == "auto":
        device = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in available:
            raise EngineError(f"device {device!r}: this onnxruntime has no CUDA provider (has {', '.join(available)});"
                              f" pip install onnxruntime-gpu on a machine with a CUDA GPU")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device != "cpu":
        raise EngineError(f"device {device!r}: expected auto, cpu or cuda")
    return ["CPUExecutionProvider"]


def session_feed(session, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray] | None = None) -> dict:
    """Inputs for a moeserve graph: ids and mask, and for a KV-cache graph the past keys and values
    (empty, P = 0, when `past` is None)."""
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for i in session.get_inputs():
        if i.name.startswith("past_"):
            _, heads, _, head_dim = i.shape
            empty = np.zeros((ids.shape[0], heads, 0, head_dim), np.float32)
            feed[i.name] = past[i.name] if past is not None else empty
    return feed


def presents_as_past(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A KV-cache graph's present_* outputs, named as the past_* inputs of the next call."""
    return {"past_" + k.removeprefix("present_"): v for k, v in outputs.items() if k.startswith("present_")}


class OnnxEngine(Engine):
    """An exported model behind the Engine's calls; one call at a time, like Engine."""

    def __init__(self, session, cfg: MoEConfig, tokenizer: Tokenizer | None, *, name: str, path: Path, mode: str):
        self.session, self.mode = session, mode
        self.model = None  # no torch model: every model call goes through the session
        self.cfg, self.tokenizer = cfg, tokenizer
        self.name, self.path = name, path
        self._outputs = [o.name for o in session.get_outputs()]
        self._experts = sorted((n for n in self._outputs if n.startswith("expert_ids.")),
                               key=lambda n: int(n.split(".")[1]))
        self.expert_load = ExpertLoad(len(self._experts), cfg.n_experts)
        self._lock = threading.RLock()
        self.kv_cache = any(i.name.startswith("past_") for i in session.get_inputs())
        self._history: Tensor | None = None  # generation without a cache: the ids so far, [B, columns]
        self._past: dict[str, np.ndarray] | None = None  # generation with one: the keys and values so far
        self._decoding = False  # between _prefill and _end_decode of a KV-cache graph

    @classmethod
    def load(cls, path, dtype: str = "float32", device: str = "auto", *, threads: int | None = None) -> "OnnxEngine":
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise EngineError("an .onnx model needs onnxruntime: pip install 'moeserve[export]'") from e
        path = Path(path)
        if not path.is_file():
            raise EngineError(f"{path}: no such ONNX file")
        if str(dtype) not in ("float32", "fp32", "auto", "torch.float32"):
            raise EngineError(f"dtype {dtype!r}: an exported ONNX graph runs in the float32 it was exported in")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            session = ort.InferenceSession(str(path), options, providers=onnx_providers(device))
        except EngineError:
            raise
        except Exception as e:  # onnxruntime raises its own types for a corrupt or foreign file
            raise EngineError(f"{path}: onnxruntime cannot load it: {e}") from e
        meta = session.get_modelmeta().custom_metadata_map
        if "moeserve.config" not in meta:
            raise EngineError(f"{path} was not written by moeserve export onnx (no moeserve.config metadata)")
        cfg = MoEConfig.from_json(meta["moeserve.config"])
        return cls(session, cfg, _tokenizer(cfg, meta), name=path.stem, path=path, mode=meta.get("moeserve.mode", "?"))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where results come back; the session may run on a GPU

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    # ---- the model call ----------------------------------------------------------------------------
    def _session_run(self, ids: Tensor, mask: Tensor, count_from: int = 0) -> ModelOutput:
        """The graph on ids [B, S] and mask [B, S] (or [B, P + S] with a cache); expert load counted for the
        real tokens among ids' columns >= count_from. A decode call keeps the present keys and values."""
        feed = session_feed(self.session, ids.cpu().numpy(), mask.cpu().numpy(), self._past)
        outs = dict(zip(self._outputs, self.session.run(None, feed)))
        if self._past is not None or self._decoding:
            self._past = presents_as_past(outs)
        real = mask.bool()[:, mask.shape[1] - ids.shape[1]:][:, count_from:].numpy()
        aux = []
        for name in self._experts:
            ids_TK = torch.from_numpy(outs[name][:, count_from:][real])
            counts = torch.bincount(ids_TK.reshape(-1), minlength=self.cfg.n_experts)
            discrete = self.cfg.router == "vq" and self.cfg.vq_mode == "discrete"
            routing = None if discrete else Routing(ids_TK, torch.ones_like(ids_TK, dtype=torch.float32))
            aux.append(MoEAux(counts, routing, codes=ids_TK[:, 0] if discrete else None))
        self.expert_load.add([a.counts for a in aux])
        return ModelOutput(torch.from_numpy(outs["logits"]), aux)

    def _run(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> ModelOutput:
        if kwargs:
            raise EngineError(f"the ONNX forward graph takes input ids and a right-padding mask, not {sorted(kwargs)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self._session_run(input_ids, attention_mask)

    # ---- generation: the KV-cache graph, or recomputation (see the module docstring) ----------------
    def _prefill(self, ids: Tensor, mask: Tensor, pos: Tensor, length: int) -> Tensor:
        self._decoding = self.kv_cache
        self._history = ids.cpu()
        return self._session_run(self._history, mask[:, : ids.shape[1]]).logits[:, -1]

    def _decode(self, step_ids: Tensor, col: int, mask: Tensor, position_ids: Tensor) -> Tensor:
        if self.kv_cache:
            return self._session_run(step_ids, mask[:, : col + 1]).logits[:, -1]
        self._history = torch.cat([self._history, step_ids.cpu()], dim=1)
        return self._session_run(self._history, mask[:, : col + 1], count_from=col).logits[:, -1]

    def _end_decode(self) -> None:
        self._history, self._past, self._decoding = None, None, False


def _tokenizer(cfg: MoEConfig, meta: dict[str, str]) -> Tokenizer | None:
    """The tokenizer the export carried: the byte tokenizer by kind, a tokenizer.json from the metadata."""
    if cfg.tokenizer == "none":
        return None
    if cfg.tokenizer == "hf":
        if "moeserve.tokenizer_json" not in meta:
            raise EngineError("the export's config names an 'hf' tokenizer but the graph carries no tokenizer.json")
        with tempfile.TemporaryDirectory() as d:  # tokenizers reads it whole; the file need not outlive this
            p = Path(d) / "tokenizer.json"
            p.write_text(meta["moeserve.tokenizer_json"], encoding="utf-8")
            return HFTokenizer(p, bos_id=cfg.extra.get("bos_token_id"), eos_id=cfg.extra.get("eos_token_id"))
    return load_tokenizer(cfg.tokenizer)
