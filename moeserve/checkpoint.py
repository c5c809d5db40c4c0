"""Save, load, verify and describe a moeserve checkpoint directory (docs/design.md, "Checkpoint directory").

- safetensors only, never pickle: a checkpoint from anywhere must not be able to run code on load.
- every weight and training-state file is sha256-hashed in moeserve.json, so a flipped byte or a
  half-copied file is caught at load time, naming the file, not later as garbage generations.
- saving is atomic (temporary sibling, fsync, rename): a crash or a full disk during a periodic save
  never leaves a half-written checkpoint where a complete one used to be.
- a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE directory (what `save_pretrained` writes; the
  families of hf_families.py) loads as it is:
  its config.json is mapped onto MoEConfig and its tensors onto the Transformer's names; anything
  that would change the math and that the Transformer does not implement is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .cache import remembered_sha256, sha256_file
from .config import FORMAT, MANIFEST_FILE, ConfigError, MoEConfig, describe_quantization
from .errors import MoeServeError
from .files import fsync_path
from .hf_families import FAMILIES, HFError, by_format, family

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TRAIN_STATE_FILE = "train_state.safetensors"
TRAIN_META_FILE = "train_state.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_EXPERT_RE = re.compile(r"^layers\.\d+\.ffn\.experts\.(w[123](_qweight)?|b[123])$")  # b: biases (gpt-oss)
QUANT_STATE = ("qweight", "scale")  # the name endings of a quantized weight and its scales (runtime/quant.py)
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(MoeServeError):
    """Any failure to save, load or verify a checkpoint; the message names the file at fault."""


@dataclass
class LoadedCheckpoint:
    """What load_checkpoint returns: everything the engine, trainer and CLI need from a directory."""

    path: Path
    config: MoEConfig
    state_dict: dict[str, torch.Tensor]
    manifest: dict  # moeserve.json contents; {"format": "hf-<model_type>"} for a Hugging Face directory
    train_state: dict[str, torch.Tensor] | None
    train_meta: dict | None


def _rename(src: Path, dst: Path) -> None:
    """One indirection over os.replace, so tests can simulate a crash between the two renames."""
    os.replace(src, dst)


def _dumps(data: Any, what: str) -> str:
    try:
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what}: not JSON-serialisable ({e})") from e


def _read_json(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e


def _plain_name(file: Path, name: Any, where: str) -> str:
    """File names read from JSON must stay inside the checkpoint: no '../../somewhere'."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise CheckpointError(f"{file}: {where} names {name!r}; expected a plain file name in the checkpoint")
    return name


def _check_dir(path: Path) -> None:
    if not path.exists():
        left = sorted(path.parent.glob(f".{path.name}.old-*")) + sorted(path.parent.glob(f".{path.name}.tmp-*"))
        hint = "; an interrupted save left: " + ", ".join(map(str, left)) if left else ""
        raise CheckpointError(f"{path}: checkpoint directory does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint directory, found a file")
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not any(path.glob("*.safetensors")):  # pickles run code on load: never touch them
        raise CheckpointError(f"refusing to load pickle file {pickles[0]}: moeserve loads safetensors only")


def _foreign_format(config_dict: dict) -> str | None:
    """None for a moeserve config.json, else the foreign family, or an error if it cannot be imported.
    A Hugging Face config names itself in `model_type`: the one place to accept a family."""
    if (model_type := config_dict.get("model_type")) is None:
        return None
    if (fam := family(model_type)) is not None:
        return fam.name
    raise CheckpointError(f"{CONFIG_FILE}: Hugging Face model_type {model_type!r} is not supported; expected one of "
                          f"{', '.join(map(repr, sorted(FAMILIES)))} or a moeserve config (\"format\": {FORMAT!r})")


def _read_config(path: Path) -> tuple[MoEConfig, str | None]:
    """(config, foreign format or None for a moeserve checkpoint)."""
    file = path / CONFIG_FILE
    raw = _read_json(file)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    if (foreign := _foreign_format(raw)) is not None:
        try:
            return by_format(foreign).config(raw, file, (path / TOKENIZER_FILE).is_file()), foreign
        except HFError as e:
            raise CheckpointError(str(e)) from e
    try:
        return MoEConfig.from_dict(raw), None
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from e


def _foreign_state(path: Path, foreign: str, config: MoEConfig, device: str, shapes_only: bool = False,
                   dtype: torch.dtype | None = None, experts: bool = True) -> dict[str, Any]:
    """A foreign directory's tensors under the Transformer's names; shapes_only: meta tensors (headers only);
    experts=False: all but the experts (which are then neither stacked nor copied)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for name, names in _weight_map(path).items():
        for k, t in _load_tensors(path / name, names, device, shapes_only).items():
            tensors[k] = torch.empty(t, device="meta") if shapes_only else t
            origin[k] = path / name
    where = path / (INDEX_FILE if (path / INDEX_FILE).exists() else WEIGHTS_FILE)
    try:
        return by_format(foreign).tensors(tensors, config, origin, where, dtype, experts)
    except HFError as e:
        raise CheckpointError(str(e)) from e


def _weight_map(path: Path) -> dict[str, list[str]]:
    """{weight file: [tensor names the index maps to it]}; [] (all its tensors) for model.safetensors."""
    index = path / INDEX_FILE
    if not index.exists():
        if not (path / WEIGHTS_FILE).is_file():
            raise CheckpointError(f"{path / WEIGHTS_FILE}: missing (and no {INDEX_FILE} for a sharded checkpoint)")
        return {WEIGHTS_FILE: []}
    data = _read_json(index)
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{index}: field 'weight_map' missing or empty; expected {{tensor name: shard file}}")
    files: dict[str, list[str]] = {}
    for tensor, shard in wmap.items():
        files.setdefault(_plain_name(index, shard, f"weight_map[{tensor!r}]"), []).append(tensor)
    for shard in files:
        if not (path / shard).is_file():
            raise CheckpointError(f"{index}: names shard file {shard!r}, which does not exist in {path}")
    return files


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST_FILE
    data = _read_json(file)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else data
        raise CheckpointError(f"{file}: field 'format' = {got!r}: expected a JSON object with {FORMAT!r}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{file}: field 'files' = {files!r}: expected {{file name: sha256 hex}}")
    for name, digest in files.items():
        _plain_name(file, name, "field 'files'")
        if not isinstance(digest, str) or not _SHA_RE.match(digest):
            raise CheckpointError(f"{file}: field 'files'[{name!r}] = {digest!r}: expected 64 lowercase hex digits")
    return data


def _verify(path: Path, manifest: dict, remembered: bool = True) -> dict[str, str]:
    """Every weight, index and training-state file present must be listed, and every listed hash match.
    `remembered`: a file unchanged since this machine last hashed it is not read again (cache.py)."""
    listed: dict[str, str] = manifest["files"]
    extra = (INDEX_FILE, TRAIN_STATE_FILE, TRAIN_META_FILE)
    for name in [*_weight_map(path), *(n for n in extra if (path / n).exists())]:
        if name not in listed:
            raise CheckpointError(f"{path / name}: not listed in {MANIFEST_FILE} 'files'; added after saving?")
    actual: dict[str, str] = {}
    for name, expected in listed.items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing (listed in {MANIFEST_FILE})")
        actual[name] = (remembered_sha256 if remembered else sha256_file)(path / name)
        if actual[name] != expected:
            raise CheckpointError(f"{path / name}: sha256 mismatch: expected {expected[:16]}..., got "
                                  f"{actual[name][:16]}...; the file was tampered with or corrupted after saving")
    return actual


def _load_tensors(file: Path, names: list[str], device: str, shapes_only: bool = False,
                  keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """`names` (all when []) from one safetensors file, those `keep` accepts where given; shapes_only reads
    only the header (describe)."""
    try:
        with safe_open(str(file), framework="pt", device=device) as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise CheckpointError(f"{file}: tensor {name!r} missing (the index maps it to this file)")
            wanted = [k for k in names or f.keys() if keep is None or keep(k)]
            if shapes_only:
                return {k: tuple(f.get_slice(k).get_shape()) for k in wanted}
            return {k: f.get_tensor(k) for k in wanted}
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a valid safetensors file, truncated or corrupt ({e})") from e


def is_quant_state(name: str) -> bool:
    """A quantized weight or its scales: stored as they are computed with, whatever dtype the model loads in."""
    return name.endswith(QUANT_STATE)


def _as_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Floating-point weights in `dtype`; integer and bool state (a VQ layer's `initialized`) and quantized weights'
    scales as stored."""
    return t if dtype is None or not t.is_floating_point() or is_quant_state(name) else t.to(dtype)


def _write_tensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """CPU contiguous copies sharing no storage (safetensors refuses shared ones), one file at a time."""
    owned = {k: t.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, t in tensors.items()}
    save_file(owned, str(file), metadata={"format": "pt"})  # "pt": what transformers expects


def _tied(tensors: dict[str, torch.Tensor], what: str) -> dict[str, str]:
    """Validate names and values; {alias: first name} for entries that are the very same tensor view."""
    seen: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{what}: tensor name {name!r}: expected a non-empty string")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise CheckpointError(f"{what}[{name!r}]: expected a dense torch.Tensor, got {type(t).__name__}")
        if t.numel():
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if (first := seen.setdefault(key, name)) != name:
                tied[name] = first
    return tied


def _shard(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy, in the state dict's order; a tensor larger than max_bytes gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append(name)
        size += n
    return shards


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the old checkpoint aside, the new one in, then delete the old: never no complete one."""
    old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}" if out.exists() else None
    if old is not None:
        _rename(out, old)
    try:
        _rename(tmp, out)
    except BaseException:
        if old is not None:
            _rename(old, out)  # put the previous checkpoint back before reporting the failure
        raise
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    out_dir: str | os.PathLike, config: MoEConfig, state_dict: dict[str, torch.Tensor], *,
    recipe: dict | None = None, metrics: dict | None = None, train_state: dict[str, torch.Tensor] | None = None,
    train_meta: dict | None = None, max_shard_bytes: int | None = None,
) -> Path:
    """Write a complete checkpoint to `out_dir` atomically, replacing a checkpoint already there.

    All goes to a temporary sibling (same filesystem: atomic renames), fsynced, then swapped in; a crash
    between the two renames leaves the old one complete as the hidden `.NAME.old-*` sibling. Tensors
    sharing storage are each saved under their own name, listed in moeserve.json 'tied' {alias: name}.
    """
    out = Path(out_dir).absolute()
    if not isinstance(config, MoEConfig):
        raise CheckpointError(f"config: expected a MoEConfig, got {type(config).__name__}")
    if not state_dict:
        raise CheckpointError(f"{out / WEIGHTS_FILE}: state_dict is empty; nothing to save")
    if max_shard_bytes is not None and (type(max_shard_bytes) is not int or max_shard_bytes <= 0):
        raise CheckpointError(f"max_shard_bytes = {max_shard_bytes!r}: expected a positive integer or None")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_FILE).exists())):
        raise CheckpointError(f"{out}: refusing to overwrite something that is not a checkpoint (no {MANIFEST_FILE})")
    tied, _ = _tied(state_dict, "state_dict"), _tied(train_state or {}, "train_state")
    # Serialise the JSON parts first: a bad metric value must fail before gigabytes are written.
    recipe_json = json.loads(_dumps(recipe or {}, "recipe"))
    metrics_json = json.loads(_dumps(metrics or {}, "metrics"))
    meta_text = _dumps(train_meta, "train_meta") if train_meta is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shards = _shard(state_dict, max_shard_bytes) if max_shard_bytes else [list(state_dict)]
        n = len(shards)
        weight_map = {k: WEIGHTS_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
                      for i, names in enumerate(shards, 1) for k in names}
        written = list(dict.fromkeys(weight_map.values()))
        for file, names in zip(written, shards):
            _write_tensors(tmp / file, {k: state_dict[k] for k in names})
        if n > 1:
            total = sum(t.numel() * t.element_size() for t in state_dict.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(_dumps(index, INDEX_FILE), encoding="utf-8")
            written.append(INDEX_FILE)
        if train_state is not None:
            _write_tensors(tmp / TRAIN_STATE_FILE, train_state)
            written.append(TRAIN_STATE_FILE)
        if meta_text is not None:
            (tmp / TRAIN_META_FILE).write_text(meta_text, encoding="utf-8")
            written.append(TRAIN_META_FILE)
        files = {name: sha256_file(tmp / name) for name in written}
        manifest = {"format": FORMAT, "files": files, "recipe": recipe_json, "metrics": metrics_json, "tied": tied}
        (tmp / MANIFEST_FILE).write_text(_dumps(manifest, MANIFEST_FILE), encoding="utf-8")
        (tmp / CONFIG_FILE).write_text(config.to_json() + "\n", encoding="utf-8")
        for name in [*written, MANIFEST_FILE, CONFIG_FILE, "."]:
            fsync_path(tmp / name)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_checkpoint(
    path: str | os.PathLike, *, device: str = "cpu", verify: bool = True, load_train_state: bool = False,
    dtype: torch.dtype | None = None, keep: Callable[[str], bool] | None = None
) -> LoadedCheckpoint:
    """Load a checkpoint directory, verifying every sha256 first (`verify=False` skips only hashing).

    The weights stay memory-mapped where they can: a tensor on the CPU in its stored dtype is a view
    of the file (copy-on-write, so nothing written to it reaches the file), read from the page cache
    when touched; `dtype` converts floating-point tensors as they are read (None: as stored), so
    serving in bf16 never holds an fp32 copy of the model.

    Training state, when asked for and present, is loaded on the CPU: RNG state must live there, and
    optimizer.load_state_dict moves moments to their parameters' device itself. Absent: None.
    A Hugging Face directory (hf_families.FAMILIES) has no hashes to verify and no training state; its tensors come
    back under the Transformer's names, and its manifest is {"format": "hf-<model_type>"} ("hf-mixtral", ...).
    `keep(name)`: load only the tensors it accepts (the dense part of an expert-parallel rank, whose
    own experts come from `load_expert_slice`). A Hugging Face directory's experts, each stacked from many of its
    tensors, are all in or all out, as `keep` says of the first.
    """
    path = Path(path)
    _check_dir(path)
    config, foreign = _read_config(path)
    if foreign is not None:
        experts = keep is None or keep(f"layers.{config.moe_layer_ids[0]}.ffn.experts.w1")
        state = _foreign_state(path, foreign, config, device, dtype=dtype, experts=experts)
        state = {k: t for k, t in state.items() if keep is None or keep(k)}
        return LoadedCheckpoint(path, config, state, {"format": foreign}, None, None)
    files = _weight_map(path)
    manifest = _read_manifest(path)
    if verify:
        _verify(path, manifest)
    state = {k: _as_dtype(k, t, dtype) for name, names in files.items()
             for k, t in _load_tensors(path / name, names, device, keep=keep).items()}
    ts_file, meta_file = path / TRAIN_STATE_FILE, path / TRAIN_META_FILE
    train_state = _load_tensors(ts_file, [], "cpu") if load_train_state and ts_file.exists() else None
    train_meta = _read_json(meta_file) if load_train_state and meta_file.exists() else None
    return LoadedCheckpoint(path, config, state, manifest, train_state, train_meta)


def read_config(path: str | os.PathLike) -> MoEConfig:
    """A checkpoint directory's config (moeserve's or a Hugging Face one), without touching the weights."""
    path = Path(path)
    _check_dir(path)
    return _read_config(path)[0]


def is_expert_weight(name: str) -> bool:
    """A stacked [E, ...] expert tensor of an MoE layer (what an expert-parallel rank holds a slice of)."""
    return ".ffn.experts." in name


def load_expert_slice(path: str | os.PathLike, start: int, stop: int, *, dtype: torch.dtype | None = None
                      ) -> tuple[MoEConfig, dict[str, torch.Tensor]]:
    """(config, the expert tensors of every MoE layer, rows [start, stop) of their expert axis only), read
    with safetensors' slices: an expert-parallel rank never reads, maps or holds another rank's experts. The
    hashes are not checked here (that reads every byte); the load of the rest (Engine.load) checks them."""
    path = Path(path)
    _check_dir(path)
    config, foreign = _read_config(path)
    if not 0 <= start < stop <= config.n_experts:
        raise CheckpointError(f"experts [{start}, {stop}): expected a range within the model's {config.n_experts}")
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as files:
        slices: dict[str, Any] = {}  # tensor name -> its file, opened once
        for name, names in _weight_map(path).items():
            try:
                f = files.enter_context(safe_open(str(path / name), framework="pt", device="cpu"))
            except SafetensorError as e:
                raise CheckpointError(f"{path / name}: not a valid safetensors file, truncated or corrupt ({e})") from e
            slices.update({k: f for k in names or f.keys()})
        if foreign is not None:  # a Mixtral: per-expert or fused tensors, under its own names
            try:
                return config, by_format(foreign).expert_slice(lambda k: slices[k].get_slice(k), slices, config,
                                                               start, stop, path, dtype)
            except HFError as e:
                raise CheckpointError(str(e)) from e
        for k, f in slices.items():
            if is_expert_weight(k):
                out[k] = _as_dtype(k, f.get_slice(k)[start:stop], dtype)
    return config, out


def is_hashed(path: str | os.PathLike) -> bool:
    """Whether moeserve.json hashes this directory's files: a moeserve checkpoint, not a Hugging Face one."""
    path = Path(path)
    _check_dir(path)
    return _read_config(path)[1] is None


def verify_checkpoint(path: str | os.PathLike, remembered: bool = True) -> dict[str, str]:
    """Check every hash listed in moeserve.json (and that no weight file is unlisted); {file: sha256}.
    remembered=False reads every file, whatever this machine remembers of it."""
    path = Path(path)
    _check_dir(path)
    if (foreign := _read_config(path)[1]) is not None:
        raise CheckpointError(f"{path}: a Hugging Face directory ({foreign}) has no {MANIFEST_FILE}: no hashes to verify")
    return _verify(path, _read_manifest(path), remembered)


def parameter_counts(config: MoEConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """{"total", "active_per_token", "experts"} from tensor shapes alone (no tensor data needed).

    Stacked expert tensors `layers.{i}.ffn.experts.w1|w2|w3` (and biases b1|b2|b3) count at experts_per_token / E
    per token;
    everything else is dense. A tied LM head (`output.weight` absent, or present with tie_embeddings
    and the embedding's shape, as a module's state_dict lists it) is counted once. A quantized weight
    counts its weights, not its scales: int8 one a byte; int4 and int6, whose scales are per group of a known
    size, as many as their scales' shape says (so no width rule of runtime/quant.py is repeated here).
    """
    total = experts = active_experts = 0
    emb = shapes.get("tok_embeddings.weight")
    q = config.quantization or {}
    for name, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        if name == "output.weight" and config.tie_embeddings and emb is not None and shape == tuple(emb):
            continue
        if name.endswith("scale") and config.quantization is not None:
            continue
        n = math.prod(shape)
        # a packed weight (int4, int6) has a scale per group beside it, and so its width; int8's is one per row
        scale = shapes.get(name.removesuffix("qweight") + "scale") if name.endswith("qweight") else None
        if scale is not None and len(scale) == len(shape):
            n = math.prod(shape[:-1]) * int(scale[-1]) * q["group"]
        total += n
        if _EXPERT_RE.match(name):
            if not shape or shape[0] != config.n_experts:
                raise CheckpointError(f"tensor {name!r} has shape {shape}: expected leading dim "
                                      f"n_experts={config.n_experts}")
            experts += n
            active_experts += n // config.n_experts * config.experts_per_token
    return {"total": total, "active_per_token": total - experts + active_experts, "experts": experts}


def describe(path: str | os.PathLike) -> str:
    """What `moeserve inspect CKPT` prints; reads headers, never tensor data. A hash mismatch is shown,
    not raised: inspecting a damaged checkpoint is exactly when one wants to see the rest of it."""
    path = Path(path)
    _check_dir(path)
    config, foreign = _read_config(path)
    if foreign is not None:
        shapes = {k: tuple(t.shape) for k, t in _foreign_state(path, foreign, config, "cpu", shapes_only=True).items()}
        return _describe_foreign(path, foreign, config, shapes)
    manifest = _read_manifest(path)
    shapes = {k: shape for name, names in _weight_map(path).items()
              for k, shape in _load_tensors(path / name, names, "cpu", shapes_only=True).items()}
    lines = [f"checkpoint: {path.absolute()}", f"format: {manifest['format']}", *_describe_model(config, shapes)]
    for name, digest in manifest["files"].items():
        size = f"{(path / name).stat().st_size:,} bytes" if (path / name).exists() else "MISSING"
        lines.append(f"  {name}  {size}  sha256 {digest[:16]}")
    try:
        lines.append(f"hashes: verified ({len(_verify(path, manifest, remembered=False))} files)")
    except CheckpointError as e:
        lines.append(f"hashes: FAILED: {e}")
    if manifest.get("tied"):
        lines.append("tied: " + ", ".join(f"{a} = {b}" for a, b in manifest["tied"].items()))
    for key in ("recipe", "metrics"):
        lines.append(f"{key}:")
        lines += ["  " + line for line in json.dumps(manifest.get(key) or {}, indent=2, sort_keys=True).splitlines()]
    present = [n for n in (TRAIN_STATE_FILE, TRAIN_META_FILE) if (path / n).exists()]
    lines.append("train_state: " + (f"present ({', '.join(present)})" if present else "absent"))
    return "\n".join(lines) + "\n"


def _describe_model(config: MoEConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    counts = parameter_counts(config, shapes)
    lines = ["config:", *(f"  {key} = {json.dumps(value)}" for key, value in config.to_dict().items())]
    if config.quantization is not None:
        lines.append(f"weights: {describe_quantization(config.quantization)}")
    return [*lines, f"parameters: ({len(shapes)} tensors)", *(
        f"  {key.replace('_', ' ')}: {n / 1e6:.2f}M ({n:,})" for key, n in counts.items()), "files:"]


def _describe_foreign(path: Path, foreign: str, config: MoEConfig, shapes: dict[str, tuple[int, ...]]) -> str:
    lines = [f"checkpoint: {path.absolute()}", f"format: {foreign} (Hugging Face directory, loaded as it is)",
             *_describe_model(config, shapes)]
    names = [*_weight_map(path), *(n for n in (INDEX_FILE, TOKENIZER_FILE) if (path / n).is_file())]
    lines += [f"  {name}  {(path / name).stat().st_size:,} bytes" for name in names]
    lines.append(f"hashes: none (no {MANIFEST_FILE} in a Hugging Face directory)")
    return "\n".join(lines) + "\n"

