"""The ONNX Runtime backend (the calls of base.ModelRunner) over a session of a graph that `moeserve export onnx` wrote:
the Engine holds it as it holds the torch model, so serve, score and bench run an exported model as they
run a checkpoint (`--backend onnx`, or any path ending in .onnx).

The graph carries its config and tokenizer in its metadata, so the .onnx file alone is enough.
Generation runs the prompt, then one token per step: with a KV-cache export (`--kv-cache`) each step
feeds the slot's previous keys and values back; with a plain forward graph each step recomputes the
whole prefix (correct, O(n^2) in the generated length). Each sequence runs alone (batch 1), so its
positions are its own and no padding is needed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.model import ModelOutput
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.routing import Routing
from moeserve.runtime.sampling import EngineError
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


class OnnxBackend:
    """The runner calls (base.ModelRunner) over an ONNX Runtime session. A slot's cache is its past
    keys and values (a KV-cache graph) or its token ids so far (a plain graph, which recomputes the
    prefix each step); a decode step runs each slot on its own, since the graph takes one past length
    per call."""

    name = "onnx"
    can_step_rows = can_copy_prefix = graph_decode = False

    def __init__(self, session, cfg: MoEConfig, mode: str):
        self.session, self.cfg, self.mode = session, cfg, mode
        self._outputs = [o.name for o in session.get_outputs()]
        self._experts = sorted((n for n in self._outputs if n.startswith("expert_ids.")),
                               key=lambda n: int(n.split(".")[1]))
        self.kv_cache = any(i.name.startswith("past_") for i in session.get_inputs())

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where results come back; the session may run on a GPU

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def _session_run(self, ids: Tensor, mask: Tensor, past: dict[str, np.ndarray] | None = None,
                     count_from: int = 0) -> tuple[ModelOutput, dict[str, np.ndarray]]:
        """The graph on ids [B, S] and mask [B, S] (or [B, P + S] with a past); the aux of the real tokens among
        ids' columns >= count_from, and the present keys and values (empty for a graph without a cache)."""
        feed = session_feed(self.session, ids.cpu().numpy(), mask.cpu().numpy(), past)
        outs = dict(zip(self._outputs, self.session.run(None, feed)))
        real = mask.bool()[:, mask.shape[1] - ids.shape[1]:][:, count_from:].numpy()
        aux = []
        for name in self._experts:
            ids_TK = torch.from_numpy(outs[name][:, count_from:][real])
            counts = torch.bincount(ids_TK.reshape(-1), minlength=self.cfg.n_experts)
            discrete = self.cfg.router == "vq" and self.cfg.vq_mode == "discrete"
            routing = None if discrete else Routing(ids_TK, torch.ones_like(ids_TK, dtype=torch.float32))
            aux.append(MoEAux(counts, routing, codes=ids_TK[:, 0] if discrete else None))
        return ModelOutput(torch.from_numpy(outs["logits"]), aux), presents_as_past(outs)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput:
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        return self._session_run(ids, mask)[0]

    def target_logprobs(self, ids: Tensor, attention_mask: Tensor | None, targets: Tensor) -> ModelOutput:
        """forward's log p(targets) [B, T] (the graph returns every logit, so they are computed whole)."""
        out = self.forward(ids, attention_mask)
        logp = torch.log_softmax(out.logits[:, :targets.shape[1]].float(), dim=-1).gather(-1, targets[..., None])
        return ModelOutput(logp[..., 0], out.aux)

    def new_cache(self, slots: int, max_len: int) -> dict[int, object]:
        return {}

    def warm_up(self, slots: int) -> None:
        """Nothing to build ahead: the session was built at load."""

    def step_rows(self, cache: dict, slots: list[int], ids: list[list[int]], starts: list[int]) -> ModelOutput:
        raise NotImplementedError("an ONNX Runtime session runs each sequence alone (can_step_rows is False)")

    def copy_prefix(self, cache: dict, src: int, dst: int, length: int) -> None:
        raise NotImplementedError("an ONNX Runtime runner keeps no shared cache rows (can_copy_prefix is False)")

    def prefill(self, cache: dict, slot: int, ids_S: Tensor, start: int, all_logits: bool = False) -> ModelOutput:
        """Logits of every token of ids_S at least (the graph computes them all: all_logits changes nothing)."""
        ids = ids_S.cpu()[None]
        if self.kv_cache:
            past = cache.get(slot) if start > 0 else None
            out, cache[slot] = self._session_run(ids, torch.ones(1, start + ids.shape[1], dtype=torch.long), past)
            return out
        history = torch.cat([cache[slot], ids], dim=1) if start > 0 else ids
        cache[slot] = history
        return self._session_run(history, torch.ones_like(history), count_from=start)[0]

    def decode(self, cache: dict, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        outs = [self.prefill(cache, slot, ids_B[b:b + 1], positions[b]) for b, slot in enumerate(slots)]
        logits = torch.cat([o.logits[:, -1:] for o in outs])
        aux = []
        for layer in zip(*(o.aux for o in outs)):
            counts = torch.stack([a.counts for a in layer]).sum(0)
            routing = None if layer[0].routing is None else Routing(
                torch.cat([a.routing.expert_ids for a in layer]), torch.cat([a.routing.gates for a in layer]))
            codes = None if layer[0].codes is None else torch.cat([a.codes for a in layer])
            aux.append(MoEAux(counts, routing, codes=codes))
        return ModelOutput(logits, aux)


def load_onnx_backend(path, dtype: str = "float32", device: str = "auto", *, threads: int | None = None
                     ) -> tuple[OnnxBackend, Tokenizer | None]:
    """A runner over an ONNX Runtime session of a graph that `moeserve export onnx` wrote, and the
    tokenizer the export carried (engine.load_engine puts them in an Engine)."""
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
    runner = OnnxBackend(session, cfg, meta.get("moeserve.mode", "?"))
    return runner, _tokenizer(cfg, meta)


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
