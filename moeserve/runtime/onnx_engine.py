"""The Engine's surface (forward, score, classify, generate, route, expert load) over an ONNX Runtime
session of a graph that `moeserve export onnx` wrote, so that serve, score and bench run an exported
model as they run a checkpoint (`--backend onnx`, or any path ending in .onnx).

The graph carries its config and tokenizer in its metadata, so the .onnx file alone is enough. It is
the forward graph (no KV cache), so generation recomputes the whole prefix at each step: left
padding shifts a row's positions by a constant, which RoPE attention does not see, so each row gets
what it would alone. Correct, O(n^2) in the generated length: the path for scoring and
classification at ONNX Runtime's speed, and for checking an export end to end.
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


class OnnxEngine(Engine):
    """An exported model behind the Engine's calls; one call at a time, like Engine."""

    def __init__(self, session, cfg: MoEConfig, tokenizer: Tokenizer | None, *, name: str, path: Path, mode: str):
        self.session, self.mode = session, mode
        self.model = None  # no torch model: every model call goes through the session
        self.cfg, self.tokenizer = cfg, tokenizer
        self.name, self.path = name, path
        names = [o.name for o in session.get_outputs()]
        self._experts = sorted((n for n in names if n.startswith("expert_ids.")), key=lambda n: int(n.split(".")[1]))
        self.expert_load = ExpertLoad(len(self._experts), cfg.n_experts)
        self._lock = threading.RLock()
        self._history: Tensor | None = None  # generation: the ids so far, [B, columns]

    @classmethod
    def load(cls, path, dtype: str = "float32", device: str = "auto", *, threads: int | None = None,
             **_) -> "OnnxEngine":
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
        """The graph on ids / mask [B, S]; expert load counted for real tokens of columns >= count_from."""
        feed = {"input_ids": ids.cpu().numpy().astype(np.int64), "attention_mask": mask.cpu().numpy().astype(np.int64)}
        outs = dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, feed)))
        real = mask.bool()[:, count_from:].numpy()
        aux = []
        for name in self._experts:
            ids_TK = torch.from_numpy(outs[name][:, count_from:][real])
            counts = torch.bincount(ids_TK.reshape(-1), minlength=self.cfg.n_experts)
            discrete = self.cfg.router == "vq" and self.cfg.vq_mode == "discrete"
            aux.append(MoEAux(counts, None if discrete else Routing(ids_TK, torch.ones_like(ids_TK, dtype=torch.float32)),
                              codes=ids_TK[:, 0] if discrete else None))
        self.expert_load.add([a.counts for a in aux])
        return ModelOutput(torch.from_numpy(outs["logits"]), aux)

    def _run(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> ModelOutput:
        if kwargs:
            raise EngineError(f"the ONNX forward graph takes input ids and a right-padding mask, not {sorted(kwargs)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self._session_run(input_ids, attention_mask)

    # ---- generation by recomputation (see the module docstring) ------------------------------------
    def _prefill(self, ids: Tensor, mask: Tensor, pos: Tensor, length: int) -> Tensor:
        self._history = ids.cpu()
        return self._session_run(self._history, mask[:, : ids.shape[1]]).logits[:, -1]

    def _decode(self, step_ids: Tensor, col: int, mask: Tensor, position_ids: Tensor) -> Tensor:
        self._history = torch.cat([self._history, step_ids.cpu()], dim=1)
        return self._session_run(self._history, mask[:, : col + 1], count_from=col).logits[:, -1]

    def _end_decode(self) -> None:
        self._history = None


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
