"""Batch offline scoring (docs/design.md, "Batch offline scoring"): a file of texts in, one JSON line per
record out, in input order, keyed by the record's id.

Per chunk of `chunk_size` records, in input order:
  read (each line parsed; a bad one becomes an error record, the run goes on)
  -> encode (Engine.encode: not a string, empty or not valid Unicode are error records too)
  -> batch (sorted by token length, up to batch_size rows and batch_tokens padded tokens: by default a size
     chosen from the run's measured tokens/s, batch_size.py)
  -> Engine.score_ids -> the chunk's lines written in input order, fsynced -> progress committed.

A text longer than the model's context is scored in rolling windows `stride` tokens apart
(runtime/windows.py); its line says how many (`windows`).

Chunk boundaries depend only on record counts, and the progress file records the batch size once the run
has chosen it, so a resumed run forms the batches an uninterrupted one would (a fixed --batch-tokens: exactly
the same, and byte-identical output). Next to OUTPUT while a run is under way:
  OUTPUT.partial        the lines so far; renamed to OUTPUT once every record is written
  OUTPUT.progress.json  what is committed (records_done, bytes_written, where the input resumes) and
                        what it was computed from (input sha256, checkpoint, settings); replaced
                        atomically after each chunk, so a kill at any point loses only the chunk in
                        flight, whose half-written lines past bytes_written --resume cuts off.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from tqdm import tqdm

from moeserve.batch_size import BatchSizer
from moeserve.files import atomic_write, fsync_path
from moeserve.runtime.engine import Engine, EngineError, Score, load_engine
from moeserve.runtime.windows import batch_end, check_stride, default_stride

FORMATS = ("auto", "jsonl", "text")
JSONL_SUFFIXES = (".jsonl", ".json")
PROGRESS_VERSION = 1
_BOM = b"\xef\xbb\xbf"
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


@dataclass
class ScoreConfig:
    input: Path
    output: Path
    format: str = "auto"  # jsonl, text (one record per non-blank line), or auto: .jsonl/.json are JSONL
    text_field: str = "text"  # JSONL: the field holding the text
    id_field: str = "id"  # JSONL: the field holding the id; without it, the 1-based line number
    dtype: str = "float32"  # float32: scores that reproduce across machines; auto: bf16 where it is fast
    device: str = "auto"
    backend: str = "auto"  # torch for a checkpoint directory, onnx for an exported .onnx file (auto: by the path)
    quantize: str | None = None  # int8 or int4: the weights quantized as they load (runtime/quant.py)
    batch_size: int = 64  # rows per forward: more amortises per-call overhead, costs activation memory
    batch_tokens: int | None = None  # tokens per forward, padding included; None: chosen by measured tokens/s
    stride: int | None = None  # rolling windows over texts past the context: None = half the context
    chunk_size: int = 256  # records per commit: smaller loses less to a crash, fsyncs more often
    resume: bool = False  # continue OUTPUT.partial from its progress file
    overwrite: bool = False  # start again even if OUTPUT or OUTPUT.partial exists
    progress: bool = True  # tqdm bar on stderr (tqdm also hides it when stderr is not a terminal)

    def __post_init__(self) -> None:
        self.input, self.output = Path(self.input), Path(self.output)
        if self.format not in FORMATS:
            raise ValueError(f"format = {self.format!r}: expected one of {', '.join(FORMATS)}")
        for name in ("batch_size", "batch_tokens", "chunk_size"):
            v = getattr(self, name)
            if name == "batch_tokens" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected an integer >= 1")
        if self.stride is not None and (isinstance(self.stride, bool) or not isinstance(self.stride, int)
                                        or self.stride < 1):
            raise ValueError(f"stride = {self.stride!r}: expected an integer >= 1")
        for name in ("text_field", "id_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected a non-empty field name")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite both set: --resume continues a run, --overwrite starts again")

    @property
    def batching(self) -> "Batching":
        return Batching(self.resolved_format, self.text_field, self.id_field, self.batch_size, self.batch_tokens,
                        self.stride)

    @property
    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        return "jsonl" if self.input.suffix.lower() in JSONL_SUFFIXES else "text"

    @property
    def partial(self) -> Path:
        return self.output.with_name(self.output.name + ".partial")

    @property
    def progress_file(self) -> Path:
        return self.output.with_name(self.output.name + ".progress.json")


@dataclass(frozen=True)
class Batching:
    """What scoring a chunk needs of the config: the same in this process and on a Ray worker."""

    format: str  # resolved: jsonl or text
    text_field: str
    id_field: str
    batch_size: int
    batch_tokens: int | None  # None: chosen by measured throughput (batch_size.py)
    stride: int | None

    def sizer(self, settled: int | None = None) -> BatchSizer:
        """The batch sizes of one engine's run: fixed, or searched (from `settled` when a run chose one)."""
        return BatchSizer.fixed(self.batch_tokens) if self.batch_tokens is not None else BatchSizer(settled=settled)


@dataclass(frozen=True)
class ModelFacts:
    """What a run checks and records of the model it scores with (a Ray run asks a worker for them)."""

    name: str  # the checkpoint, as the progress file records it
    path: Path | None
    dtype: str
    device: str  # cpu or cuda
    task: str
    has_tokenizer: bool
    context: int
    quantization: dict | None = None  # the weights' format (runtime/quant.py), None: float

    @classmethod
    def of(cls, engine: Engine) -> "ModelFacts":
        return cls(str(engine.path) if engine.path is not None else engine.name, engine.path,
                   str(engine.dtype).removeprefix("torch."), engine.device.type, engine.cfg.task,
                   engine.tokenizer is not None, engine.cfg.max_seq_len, engine.cfg.quantization)

    def check(self, stride: int | None) -> None:
        if self.task != "lm":
            raise ValueError(f"{self.name} is a '{self.task}' model; scoring needs a language model")
        if not self.has_tokenizer:
            raise ValueError(f"{self.name} has no tokenizer (no tokenizer.json); cannot score text")
        if stride is not None:
            check_stride(stride, self.context)


@dataclass
class ScoreSummary:
    output: Path
    records: int  # records in the input
    scored: int  # output lines with a score
    errors: int  # output lines with an error
    resumed_at: int = 0  # records already done when this run started
    already_complete: bool = False  # --resume found OUTPUT finished; nothing was computed


@dataclass
class Record:
    line: int  # 1-based line number in the input
    id: Any  # the record's id field, else its line number
    text: Any  # what to score; checked by Engine.encode
    error: str | None  # set when the line itself is bad (not UTF-8, not JSON, not an object, no text)
    end: int  # byte offset just past the line: where a resumed run continues reading


# ---- input -----------------------------------------------------------------------------------
@dataclass
class InputInfo:
    sha256: str
    size: int
    records: int  # non-blank lines


def scan_input(path: Path) -> InputInfo:
    """One pass over the input: its sha256 (a resume must read the same bytes) and its record count
    (the progress bar's total)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: input file does not exist")
    if not path.is_file():
        raise ValueError(f"{path}: input is not a regular file")
    h, size, records = hashlib.sha256(), 0, 0
    try:
        with open(path, "rb") as f:
            for i, raw in enumerate(f):
                h.update(raw)
                size += len(raw)
                records += bool((raw[3:] if i == 0 and raw.startswith(_BOM) else raw).strip())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the input ({e.strerror or e})") from e
    return InputInfo(h.hexdigest(), size, records)


def _parse(body: bytes, line: int, end: int, fmt: str, text_field: str, id_field: str) -> Record:
    try:
        s = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return Record(line, line, None, f"line {line}: not valid UTF-8 ({e.reason} at byte {e.start})", end)
    if fmt == "text":
        return Record(line, line, s, None, end)
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        return Record(line, line, None, f"line {line}: invalid JSON ({e.msg} at column {e.colno})", end)
    if not isinstance(obj, dict):
        return Record(line, line, None, f"line {line}: expected a JSON object, got {_JSON_TYPES[type(obj)]}", end)
    rid = obj.get(id_field, line)
    if text_field not in obj:
        return Record(line, rid, None, f"line {line}: no {text_field!r} field", end)
    return Record(line, rid, obj[text_field], None, end)  # what Engine.encode refuses is an error line too


def _lines(path: Path, start: int = 0, line: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset just past it, its bytes without the line ending) of each non-blank line of
    `path` from byte offset `start` (just past line `line`); a UTF-8 byte-order mark on line 1 is not text."""
    with open(path, "rb") as f:
        f.seek(start)
        end = start
        for raw in f:
            line += 1
            end += len(raw)
            body = raw[:-1] if raw.endswith(b"\n") else raw
            body = body[:-1] if body.endswith(b"\r") else body
            if line == 1 and body.startswith(_BOM):
                body = body[3:]
            if body.strip():
                yield line, end, body


def read_records(path: Path, fmt: str, text_field: str = "text", id_field: str = "id", *,
                 start: int = 0, line: int = 0) -> Iterator[Record]:
    """The records of `path` from byte offset `start` (just past line `line`); blank lines are not records."""
    for n, end, body in _lines(path, start, line):
        yield _parse(body, n, end, fmt, text_field, id_field)


@dataclass(frozen=True)
class ChunkSpan:
    """Where a chunk of records lies in the input: what a worker needs to read it on its own."""

    start: int  # byte offset of its first line
    line: int  # line number just before it
    records: int
    end: int  # byte offset just past its last record
    last_line: int  # line number of its last record


def chunk_spans(path: Path, chunk_size: int, start: int = 0, line: int = 0) -> Iterator[ChunkSpan]:
    """The input from `start` cut into chunks of `chunk_size` records, as `score_file` cuts it, without
    parsing a line."""
    n, first, before = 0, start, line
    for ln, end, _ in _lines(path, start, line):
        n += 1
        if n == chunk_size:
            yield ChunkSpan(first, before, n, end, ln)
            n, first, before = 0, end, ln
    if n:
        yield ChunkSpan(first, before, n, end, ln)


# ---- batching and scoring ----------------------------------------------------------------------
def plan_batches(lengths: Sequence[int], batch_size: int, cap: Callable[[], int]) -> Iterator[list[int]]:
    """Indices into `lengths`, shortest first, cut into batches of at most `batch_size` rows and `cap()` tokens
    once padded to the batch's longest row (a row longer than that goes alone). `cap` is asked as each batch
    is cut, so a sizer can change it between batches."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    widths = [lengths[i] for i in order]
    start = 0
    while start < len(order):
        end = min(batch_end(widths, start, cap()), start + batch_size)
        yield order[start:end]
        start = end


def score_chunk(engine: Engine, chunk: list[Record], b: Batching, sizer: BatchSizer | None = None) -> list[dict]:
    """One output object per record, in the chunk's order. Batches are cut shortest row first at the cap
    `sizer` gives for each, and their times go back to it (default: a fixed sizer from `b`)."""
    sizer = sizer if sizer is not None else b.sizer()
    out: list[dict | None] = [None] * len(chunk)
    rows: list[list[int]] = []
    where: list[int] = []  # rows[k] is chunk[where[k]]
    for j, r in enumerate(chunk):
        if r.error is not None:
            out[j] = {"id": r.id, "error": r.error}
            continue
        what = f"line {r.line}" if b.format == "text" else f"line {r.line}: field {b.text_field!r}"
        try:
            rows.append(engine.encode(r.text, what, any_length=True))
        except EngineError as e:
            out[j] = {"id": r.id, "error": str(e)}
            continue
        where.append(j)
    C = engine.cfg.max_seq_len  # a longer row runs as windows of C tokens, which score_ids batches itself
    for batch in plan_batches([min(len(row), C) for row in rows], b.batch_size, lambda: sizer.tokens):
        t0 = time.perf_counter()
        scores = engine.score_ids([rows[k] for k in batch], b.stride, max_batch_tokens=sizer.tokens)
        sizer.record(sum(len(rows[k]) for k in batch), time.perf_counter() - t0)
        for k, row in zip(batch, scores):
            r = chunk[where[k]]
            out[where[k]] = {"id": r.id, **Score.of(row, r.text).as_dict()}
    return out  # type: ignore[return-value]


def score_span(engine: Engine, path: Path, span: ChunkSpan, b: Batching,
               sizer: BatchSizer | None = None) -> tuple[bytes, int]:
    """(the output lines, how many are errors) of the chunk `span` of the input at `path`."""
    chunk = list(islice(read_records(path, b.format, b.text_field, b.id_field, start=span.start, line=span.line),
                        span.records))
    if len(chunk) != span.records or chunk[-1].end != span.end:
        raise ValueError(f"{path}: changed while it was being scored (records {span.line + 1}.. are not where "
                         f"they were)")
    results = score_chunk(engine, chunk, b, sizer)
    return b"".join(json.dumps(r).encode("ascii") + b"\n" for r in results), sum("error" in r for r in results)


# ---- progress file -----------------------------------------------------------------------------
def _checkpoint_fingerprint(path: Path | None) -> str | None:
    """sha256 over the checkpoint's config and manifest (which holds every weight file's sha256)."""
    if path is None:
        return None
    h = hashlib.sha256()
    if path.is_file():  # an ONNX export: the file is the model
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    for name in ("config.json", "moeserve.json", "model.safetensors.index.json"):
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    return h.hexdigest()


def _identity(cfg: ScoreConfig, info: InputInfo, model: ModelFacts) -> dict:
    """Everything a resume must match, with the paths for the messages."""
    return {
        "version": PROGRESS_VERSION,
        "input": str(cfg.input.absolute()), "input_sha256": info.sha256, "input_size": info.size,
        "records_total": info.records,
        "checkpoint": model.name,
        "checkpoint_sha256": _checkpoint_fingerprint(model.path),
        "settings": {"format": cfg.resolved_format, "text_field": cfg.text_field, "id_field": cfg.id_field,
                     "dtype": model.dtype, "device": model.device, "quantization": model.quantization,
                     "chunk_size": cfg.chunk_size, "batch_size": cfg.batch_size, "batch_tokens": cfg.batch_tokens,
                     "stride": cfg.stride or default_stride(model.context)},
    }


def _differences(old: dict, new: dict) -> list[str]:
    diffs = []
    if old.get("version") != new["version"]:
        return [f"progress file version {old.get('version')!r}, this moeserve writes {new['version']}"]
    if old.get("input_sha256") != new["input_sha256"]:
        diffs.append(f"input: {new['input']} (sha256 {new['input_sha256'][:12]}...) is not the file the run "
                     f"read ({old.get('input')}, sha256 {str(old.get('input_sha256'))[:12]}...)")
    if old.get("checkpoint_sha256") != new["checkpoint_sha256"]:
        diffs.append(f"checkpoint: {new['checkpoint']} is not the checkpoint the run used ({old.get('checkpoint')})")
    for k, v in new["settings"].items():
        if old.get("settings", {}).get(k) != v:
            diffs.append(f"{k}: {old.get('settings', {}).get(k)!r} in the run, {v!r} now")
    return diffs


# ---- the run ---------------------------------------------------------------------------------
def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _check_paths(cfg: ScoreConfig, info: InputInfo) -> ScoreSummary | None:
    """Refuse to clobber; a summary if --resume finds the output already complete."""
    if not cfg.output.parent.is_dir():
        raise FileNotFoundError(f"{cfg.output.parent}: output directory does not exist")
    if cfg.output.is_dir():
        raise ValueError(f"{cfg.output}: output is a directory; expected a file path")
    if cfg.output.resolve() == cfg.input.resolve():
        raise ValueError(f"{cfg.output}: output is the input file")
    interrupted = cfg.partial.is_file() and cfg.progress_file.is_file()
    if cfg.resume and cfg.output.exists() and not interrupted:  # (an interrupted --overwrite leaves both)
        n = _count_lines(cfg.output)
        if n != info.records:
            raise ValueError(f"{cfg.output}: exists with {n} lines but {cfg.input} has {info.records} records; "
                             f"it is not this input's output (--overwrite to score again)")
        cfg.progress_file.unlink(missing_ok=True)  # a crash between the final rename and this cleanup
        return ScoreSummary(cfg.output, info.records, 0, 0, info.records, already_complete=True)
    if not (cfg.resume or cfg.overwrite):
        for p in (cfg.output, cfg.partial):
            if p.exists():
                raise FileExistsError(f"{p}: already exists; pass --resume to continue an interrupted run or "
                                      f"--overwrite to start again")
    return None


class Scorer(Protocol):
    """Scores chunks somewhere else (scoring_ray.py), and says with what model."""

    model: ModelFacts

    def score_spans(self, spans: Iterable[ChunkSpan]) -> Iterator[tuple[ChunkSpan, bytes, int]]:
        """(span, its output lines, how many are errors) per span, in the order given."""


def score_file(checkpoint: str | os.PathLike | None, cfg: ScoreConfig, *, engine: Engine | None = None,
               scorer: Callable[[], Scorer] | None = None,
               log: Callable[[str], None] = lambda msg: None) -> ScoreSummary:
    """Score every record of cfg.input into cfg.output (see the module docstring). `engine`, when given,
    is used instead of loading `checkpoint`; `scorer`, when given, is made once the paths are checked and
    scores the chunks instead of this process (scoring_ray.py)."""
    info = scan_input(cfg.input)
    if (done := _check_paths(cfg, info)) is not None:
        return done
    if scorer is not None:
        remote = scorer()
        model, score_spans = remote.model, remote.score_spans
    else:
        if engine is None:
            engine = load_engine(checkpoint, cfg.backend, dtype=cfg.dtype, device=cfg.device, quantize=cfg.quantize)
        model = ModelFacts.of(engine)

        def score_spans(spans: Iterable[ChunkSpan]) -> Iterator[tuple[ChunkSpan, bytes, int]]:
            b = cfg.batching
            sizer = b.sizer(settled=state["batch_tokens_chosen"] or None)
            for span in spans:
                data = score_span(engine, cfg.input, span, b, sizer)
                if sizer.settled is not None and not state["batch_tokens_chosen"]:
                    state["batch_tokens_chosen"] = sizer.settled  # committed with this chunk
                    if cfg.batch_tokens is None:
                        log(f"batches of up to {sizer.settled} tokens (measured tokens/s by size: "
                            + ", ".join(f"{k}: {v:.0f}" for k, v in sizer.rates.items()) + ")")
                yield (span, *data)
    model.check(cfg.stride)

    identity = _identity(cfg, info, model)
    state = {"records_done": 0, "bytes_written": 0, "input_offset": 0, "input_line": 0, "scored": 0, "errors": 0,
             "batch_tokens_chosen": 0}  # 0 until the run has chosen its batch size (batch_size.py)
    resuming = cfg.resume and cfg.progress_file.exists()
    if resuming:
        try:
            old = json.loads(cfg.progress_file.read_text(encoding="utf-8"))
            state = {k: int(old.get(k, 0) if k == "batch_tokens_chosen" else old[k]) for k in state}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{cfg.progress_file}: unreadable progress file ({e}); --overwrite to start again") from e
        if diffs := _differences(old, identity):
            raise ValueError(f"cannot resume from {cfg.progress_file}: " + "; ".join(diffs) +
                             ". Rerun with the run's settings, or --overwrite to start again")
        if not cfg.partial.is_file() or cfg.partial.stat().st_size < state["bytes_written"]:
            raise ValueError(f"{cfg.partial}: missing or shorter than the {state['bytes_written']} bytes "
                             f"{cfg.progress_file.name} says were written; --overwrite to start again")
        log(f"resuming at record {state['records_done'] + 1} of {info.records}")
    elif cfg.resume:
        log(f"no {cfg.progress_file.name} to resume from; starting from the first record")

    def commit() -> None:
        atomic_write(cfg.progress_file, json.dumps({**identity, **state}, indent=1) + "\n")

    if not resuming:
        commit()  # before the first line: a resume after a kill anywhere from here finds the settings
    bar = tqdm(total=info.records, initial=state["records_done"], unit="rec", file=sys.stderr,
               disable=None if cfg.progress else True, desc="score")
    resumed_at = state["records_done"]
    with open(cfg.partial, "r+b" if resuming else "wb") as f, bar:
        if resuming:
            f.truncate(state["bytes_written"])  # drops the half-written chunk a kill left
            os.fsync(f.fileno())
            f.seek(state["bytes_written"])
        spans = chunk_spans(cfg.input, cfg.chunk_size, state["input_offset"], state["input_line"])
        for span, data, n_err in score_spans(spans):  # in input order
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            state["records_done"] += span.records
            state["bytes_written"] += len(data)
            state["input_offset"], state["input_line"] = span.end, span.last_line
            state["scored"] += span.records - n_err
            state["errors"] += n_err
            commit()
            bar.update(span.records)
    os.replace(cfg.partial, cfg.output)
    fsync_path(cfg.output.parent)
    cfg.progress_file.unlink()
    fsync_path(cfg.output.parent)
    return ScoreSummary(cfg.output, info.records, state["scored"], state["errors"], resumed_at)
