"""The ONNX Runtime backend (the calls of base.ModelRunner) over a session of a graph that `moeserve export onnx` wrote:
the Engine holds it as it holds the torch model, so serve, score and bench run an exported model as they
run a checkpoint (`--backend onnx`, or any path ending in .onnx).

The graph carries its config and tokenizer in its metadata, so the .onnx file alone is enough.
Generation runs each prompt, then one token per step for every running sequence in one session call: with a
KV-cache export (`--kv-cache`) the step feeds back the batch's keys and values, which never leave the session's
device (IO binding: ONNX Runtime reads and writes torch tensors in place); with a plain forward graph each step
recomputes every sequence's prefix (correct, O(n^2) in the generated length)."""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.backends.experts import expert_counts
from moeserve.runtime.model import ModelOutput
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.routing import Routing
from moeserve.runtime.sampling import EngineError
from moeserve.tokenizer import HFTokenizer, Tokenizer, load_tokenizer


def onnx_providers(device: str) -> tuple[list, torch.device, torch.cuda.Stream | None]:
    """ONNX Runtime execution providers for 'auto' (CUDA when onnxruntime-gpu sees a GPU), 'cpu', 'cuda[:N]', the
    torch device the inputs and outputs are bound on, and on CUDA the stream both run on (torch's default stream
    cannot be handed over: ONNX Runtime reads its handle, 0, as none given)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    device = str(device)
    if device == "auto":
        device = "cuda" if "CUDAExecutionProvider" in available and torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in available:
            raise EngineError(f"device {device!r}: this onnxruntime has no CUDA provider (has {', '.join(available)});"
                              f" pip install onnxruntime-gpu on a machine with a CUDA GPU")
        if not torch.cuda.is_available():
            raise EngineError(f"device {device!r}: the ONNX runner binds its inputs, outputs and KV cache to torch "
                              f"tensors on the GPU, and this torch ({torch.__version__}) sees no CUDA device")
        where = torch.device(device)
        where = torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)
        stream = torch.cuda.Stream(where)
        options = {"device_id": where.index, "user_compute_stream": str(stream.cuda_stream)}
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"], where, stream
    if device != "cpu":
        raise EngineError(f"device {device!r}: expected auto, cpu or cuda")
    return ["CPUExecutionProvider"], torch.device("cpu"), None


def session_feed(session, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray] | None = None,
                 positions: np.ndarray | None = None) -> dict:
    """Numpy inputs for a moeserve graph: ids and mask, and for a KV-cache graph the past keys and values (empty,
    P = 0, when `past` is None) and each row's positions (P..P+S-1 in every row when not given)."""
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for i in session.get_inputs():
        if i.name.startswith("past_"):
            _, heads, _, head_dim = i.shape
            empty = np.zeros((ids.shape[0], heads, 0, head_dim), np.float32)
            feed[i.name] = past[i.name] if past is not None else empty
        elif i.name == "position_ids":
            if positions is None:
                first = mask.shape[1] - ids.shape[1]
                positions = np.broadcast_to(np.arange(first, mask.shape[1]), ids.shape)
            feed[i.name] = positions.astype(np.int64)
    return feed


def presents_as_past(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A KV-cache graph's present_* outputs, named as the past_* inputs of the next call."""
    return {"past_" + k.removeprefix("present_"): v for k, v in outputs.items() if k.startswith("present_")}


@dataclass
class Rows:
    """The decoding sequences' keys and values as one batch, in the session's device memory, so that a decode step
    is one session call whose present outputs are the next step's past inputs as they are (never through the host).
    Row b is slot `slots[b]`; `real` is the mask as the host wrote it (it is never read back from the device): a
    row's keys are its prompt's, then padding up to the longest row's, then one a step."""

    slots: list[int]
    past: list[Tensor]  # per past_* input, [B, G, P, Dh]
    mask: Tensor  # [B, P] int64, on the device
    real: np.ndarray  # [B, P] bool, the same on the host

    def take(self, b: int) -> list[Tensor]:
        """Row b's real keys and values, [1, G, n, Dh] each, contiguous."""
        cols = np.flatnonzero(self.real[b])
        if len(cols) and cols[-1] - cols[0] + 1 == len(cols):  # no padding inside: a slice
            return [p[b:b + 1, :, cols[0]:cols[-1] + 1].contiguous() for p in self.past]
        index = torch.as_tensor(cols, device=self.mask.device)
        return [p[b:b + 1].index_select(2, index) for p in self.past]


@dataclass
class OnnxCache:
    """A KV-cache graph's slots: each alone ([1, G, n, Dh] per past input) from its prefill until a decode step
    takes it into `rows`, the decoding batch. A plain graph's slots: each one's token ids so far."""

    alone: dict[int, list[Tensor]] = field(default_factory=dict)
    rows: Rows | None = None
    history: dict[int, Tensor] = field(default_factory=dict)


class OnnxBackend:
    """The runner calls (base.ModelRunner) over an ONNX Runtime session, every input and output bound to torch
    tensors on the session's device (IO binding): a KV-cache graph's keys and values stay there between calls, and
    a decode step is one session call for all its sequences, each row at its own positions (`position_ids`, and
    key positions counted along the mask). Prompts run one sequence a call; a plain graph (no cache) recomputes
    each sequence's prefix every step, its rows right-padded into one call."""

    name = "onnx"
    can_step_rows = can_copy_prefix = graph_decode = False

    def __init__(self, session, cfg: MoEConfig, mode: str, device: torch.device = torch.device("cpu"),
                 stream: torch.cuda.Stream | None = None):
        """device: where the session's inputs and outputs are bound; stream: on CUDA, the one ONNX Runtime was
        given as its compute stream (load_onnx_backend makes both)."""
        self.session, self.cfg, self.mode, self._device = session, cfg, mode, torch.device(device)
        inputs = [i.name for i in session.get_inputs()]
        self._outputs = [o.name for o in session.get_outputs()]
        self._experts = sorted((n for n in self._outputs if n.startswith("expert_ids.")),
                               key=lambda n: int(n.split(".")[1]))
        self._past = [i for i in session.get_inputs() if i.name.startswith("past_")]
        self.kv_cache = bool(self._past)
        if self.kv_cache and "position_ids" not in inputs:
            raise EngineError("this KV-cache graph takes no position_ids (an export older than moeserve-onnx/2, "
                              "which batches no decode step): export it again with moeserve export onnx --kv-cache")
        self.session_calls = 0  # runs of the session: a decode step is one, whatever its batch
        self._stream, self._run_options = stream, None
        if stream is not None:  # ONNX Runtime would otherwise synchronize its stream with the host after each run
            import onnxruntime as ort

            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    @property
    def device(self) -> torch.device:
        """Where the session's inputs and outputs live: the caller's tensors come and go there."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def _run(self, ids: Tensor, mask: Tensor, positions: Tensor | None = None, past: list[Tensor] | None = None
             ) -> dict[str, Tensor]:
        """One session call on device tensors, bound by pointer; its outputs as torch tensors over the memory ONNX
        Runtime wrote them to (DLPack, no copy). A KV-cache graph's past is empty (P = 0) when not given."""
        feed = {"input_ids": ids, "attention_mask": mask}
        if self.kv_cache:
            B = ids.shape[0]
            feed["position_ids"] = positions
            for n, i in enumerate(self._past):
                feed[i.name] = (past[n] if past is not None
                                else torch.empty(B, i.shape[1], 0, i.shape[3], device=self._device))
        binding, kind, index = self.session.io_binding(), self._device.type, self._device.index or 0
        feed = {name: t.to(self._device, torch.int64 if name in INT_INPUTS else torch.float32).contiguous()
                for name, t in feed.items()}
        for name, t in feed.items():
            binding.bind_input(name, kind, index, np.int64 if name in INT_INPUTS else np.float32, list(t.shape),
                               t.data_ptr())
        for name in self._outputs:
            binding.bind_output(name, kind, index)
        with on_stream(self._stream):
            self.session.run_with_iobinding(binding, self._run_options)
        self.session_calls += 1
        return {name: torch.from_dlpack(v) for name, v in zip(self._outputs, binding.get_outputs())}

    def _output(self, outs: dict[str, Tensor], real: Tensor | None = None, logits: Tensor | None = None
                ) -> ModelOutput:
        """The logits (the graph's, unless given) and each MoE layer's aux over the tokens where `real` [B, S]
        is true (every token when None: no boolean index, so no sync on a GPU)."""
        aux = []
        discrete = self.cfg.router == "vq" and self.cfg.vq_mode == "discrete"
        for name in self._experts:
            ids_BSK = outs[name]
            ids_TK = ids_BSK.reshape(-1, ids_BSK.shape[-1]) if real is None else ids_BSK[real]
            counts = expert_counts(ids_TK.reshape(-1), self.cfg.n_experts)
            routing = None if discrete else Routing(ids_TK, torch.ones_like(ids_TK, dtype=torch.float32))
            aux.append(MoEAux(counts, routing, codes=ids_TK[:, 0] if discrete else None))
        return ModelOutput(outs["logits"] if logits is None else logits, aux)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput:
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        return self._output(self._run(ids, mask, positions), mask.to(self._device).bool())

    def target_logprobs(self, ids: Tensor, attention_mask: Tensor | None, targets: Tensor) -> ModelOutput:
        """forward's log p(targets) [B, T] (the graph returns every logit, so they are computed whole)."""
        out = self.forward(ids, attention_mask)
        logp = torch.log_softmax(out.logits[:, :targets.shape[1]].float(), dim=-1).gather(
            -1, targets.to(self._device)[..., None])
        return ModelOutput(logp[..., 0], out.aux)

    def new_cache(self, slots: int, max_len: int) -> OnnxCache:
        return OnnxCache()

    def warm_up(self, slots: int, rows: int | None = None) -> None:
        """Nothing to build ahead: the session was built at load."""

    def step_rows(self, cache: OnnxCache, slots: list[int], ids: list[list[int]], starts: list[int]) -> ModelOutput:
        raise NotImplementedError("the ONNX runner runs prompts one sequence a call (can_step_rows is False)")

    def copy_prefix(self, cache: OnnxCache, src: int, dst: int, length: int) -> None:
        raise NotImplementedError("an ONNX Runtime runner keeps no shared cache rows (can_copy_prefix is False)")

    def prefill(self, cache: OnnxCache, slot: int, ids_S: Tensor, start: int, all_logits: bool = False
                ) -> ModelOutput:
        """Logits of every token of ids_S at least (the graph computes them all: all_logits changes nothing)."""
        ids = ids_S.to(self._device)[None]
        if not self.kv_cache:
            history = torch.cat([cache.history[slot], ids], dim=1) if start > 0 else ids
            cache.history[slot] = history
            real = torch.arange(history.shape[1], device=self._device)[None] >= start
            outs = self._run(history, torch.ones_like(history))
            return self._output(outs, real, outs["logits"][:, start:])
        if cache.rows is not None and slot in cache.rows.slots:  # out of the decoding batch, the rest left there
            self._regroup(cache, [s for s in cache.rows.slots if s != slot])
        past = cache.alone.pop(slot, None)
        if start == 0:
            past = None
        elif past is None or past[0].shape[2] != start:
            raise EngineError(f"slot {slot}: a prompt continued at position {start}, but its cache holds "
                              f"{0 if past is None else past[0].shape[2]} positions")
        total = start + ids.shape[1]
        positions = torch.arange(start, total, device=self._device)[None]
        outs = self._run(ids, torch.ones(1, total, dtype=torch.long, device=self._device), positions, past)
        cache.alone[slot] = self._presents(outs)
        return self._output(outs)

    def decode(self, cache: OnnxCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        """One token for each slot, in one session call. The batch keeps its own row order (a sequence that joins
        is appended), so only a change in the set of slots moves the cache; rows are put in the caller's order on
        the way in and out (ids and positions, logits and expert choices: [B] and [B, V], not the cache)."""
        ids = ids_B.to(self._device)[:, None]
        if not self.kv_cache:
            return self._decode_plain(cache, slots, ids)
        if cache.rows is None or set(cache.rows.slots) != set(slots):
            self._regroup(cache, slots)
        rows = cache.rows
        order = [slots.index(s) for s in rows.slots]  # batch row k is the caller's row order[k]
        reordered = order != list(range(len(slots)))
        positions_B = torch.tensor([positions[b] for b in order], device=self._device)[:, None]
        if reordered:
            ids = ids[torch.tensor(order, device=self._device)]
        mask = torch.cat([rows.mask, torch.ones(len(slots), 1, dtype=torch.long, device=self._device)], dim=1)
        outs = self._run(ids, mask, positions_B, rows.past)
        real = np.concatenate([rows.real, np.ones((len(slots), 1), bool)], axis=1)
        cache.rows = Rows(rows.slots, self._presents(outs), mask, real)
        if reordered:
            back = torch.tensor([rows.slots.index(s) for s in slots], device=self._device)
            outs = {name: outs[name][back] for name in ("logits", *self._experts)}
        return self._output(outs)

    def _presents(self, outs: dict[str, Tensor]) -> list[Tensor]:
        """The present_* outputs in the order of the past_* inputs they become."""
        return [outs["present_" + i.name.removeprefix("past_")] for i in self._past]

    def _regroup(self, cache: OnnxCache, slots: list[int]) -> None:
        """Make the set `slots` the decoding batch: the rows that stay keep their order and columns (one
        index_select), the rows that join are appended, padded to the batch's length (or it to theirs, padding
        being allowed anywhere), and a row the step does not decode goes back to being alone, for when it decodes
        again. Padding left behind by rows that went is dropped only once it is over half the batch's length
        (`_compact`), so its cost is spread over many steps."""
        old = cache.rows
        cache.rows = None
        stay = [] if old is None else [b for b, slot in enumerate(old.slots) if slot in slots]
        if old is not None:
            for b, slot in enumerate(old.slots):
                if slot not in slots:
                    cache.alone[slot] = old.take(b)
        if not slots:
            return
        joining = [s for s in slots if old is None or s not in old.slots]
        if missing := [s for s in joining if s not in cache.alone]:
            raise EngineError(f"slots {missing} decode before their prompts ran")
        parts = [cache.alone.pop(s) for s in joining]
        lengths = [part[0].shape[2] for part in parts]
        S, old_len = len(stay), old.real.shape[1] if stay else 0
        P = max([*lengths, old_len])
        front = P - old_len  # the rows that stay are padded at the front when a joining row is longer
        real = np.zeros((S + len(parts), P), bool)
        if stay:
            real[:S, front:] = old.real[stay]
        for j, n in enumerate(lengths):
            real[S + j, :n] = True
        kept = torch.as_tensor(stay, device=self._device)
        past = []
        for n, i in enumerate(self._past):
            batch = torch.empty(S + len(parts), i.shape[1], P, i.shape[3], device=self._device)
            if S and not front:
                torch.index_select(old.past[n], 0, kept, out=batch[:S])  # one copy, into place
            elif S:
                batch[:S, :, :front] = 0
                batch[:S, :, front:] = old.past[n][kept]
            batch[S:] = 0
            for j, part in enumerate(parts):
                batch[S + j, :, :lengths[j]] = part[n][0]
            past.append(batch)
        order = [old.slots[b] for b in stay] + joining
        cache.rows = Rows(order, past, torch.from_numpy(real.astype(np.int64)).to(self._device), real)
        longest = int(real.sum(1).max())
        if P > 2 * longest:
            self._compact(cache.rows, longest)

    def _compact(self, rows: Rows, P: int) -> None:
        """Drop the padding columns: each row's real keys first (the columns the host knows), padded to the longest
        by repeating its first (finite values the mask hides), by one gather per past input."""
        cols = [np.flatnonzero(r) for r in rows.real]
        index = np.stack([np.pad(c, (0, P - len(c)), mode="edge") for c in cols])
        at = torch.as_tensor(index, device=self._device)[:, None, :, None]
        rows.past = [p.gather(2, at.expand(-1, p.shape[1], -1, p.shape[3])) for p in rows.past]
        rows.real = np.arange(P)[None] < np.array([len(c) for c in cols])[:, None]
        rows.mask = torch.from_numpy(rows.real.astype(np.int64)).to(self._device)

    def _decode_plain(self, cache: OnnxCache, slots: list[int], ids: Tensor) -> ModelOutput:
        """A plain graph's step: each slot's prefix and new token, right-padded into one call; the logits and
        expert choices of each row's last token."""
        histories = [torch.cat([cache.history[s], ids[b:b + 1]], dim=1) for b, s in enumerate(slots)]
        for s, h in zip(slots, histories):
            cache.history[s] = h
        lengths = torch.tensor([h.shape[1] for h in histories], device=self._device)
        batch = torch.nn.utils.rnn.pad_sequence([h[0] for h in histories], batch_first=True)
        mask = (torch.arange(batch.shape[1], device=self._device)[None] < lengths[:, None]).long()
        outs = self._run(batch, mask)
        last = (lengths - 1)[:, None]
        rows = torch.arange(len(slots), device=self._device)[:, None]
        return self._output({**outs, **{n: outs[n][rows, last] for n in self._experts}},
                            logits=outs["logits"][rows, last])


INT_INPUTS = ("input_ids", "attention_mask", "position_ids")


@contextlib.contextmanager
def on_stream(stream):
    """Run the session on the backend's own CUDA stream (handed to ONNX Runtime as its compute stream, so its
    kernels queue after the inputs torch wrote there), and have the caller's stream wait for it: no host sync."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


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
    providers, where, stream = onnx_providers(device)
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except EngineError:
        raise
    except Exception as e:  # onnxruntime raises its own types for a corrupt or foreign file
        raise EngineError(f"{path}: onnxruntime cannot load it: {e}") from e
    meta = session.get_modelmeta().custom_metadata_map
    if "moeserve.config" not in meta:
        raise EngineError(f"{path} was not written by moeserve export onnx (no moeserve.config metadata)")
    cfg = MoEConfig.from_json(meta["moeserve.config"])
    runner = OnnxBackend(session, cfg, meta.get("moeserve.mode", "?"), where, stream)
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
