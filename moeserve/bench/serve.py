"""`moeserve bench serve`: load on any OpenAI-compatible endpoint, timed token by token.

Each request streams (`stream: true`, `stream_options.include_usage`), so the arrival of every text
chunk is timed: time to first token (TTFT: send to the first chunk with text), inter-token latency
(ITL: the gaps between text chunks), end-to-end latency (send to the last byte). Levels:

- closed loop at a concurrency C: C users, each sending its next request when the last one ends;
- open loop at a rate R: requests sent at Poisson arrival times whatever the answers do (inter-arrival
  gaps drawn from an exponential distribution and scaled so that N requests span (N - 1) / R seconds:
  the schedule keeps the asked rate exactly, and the measured rate says whether client and server kept up);
  `inf` sends them all at once.

Each level runs for --duration seconds or --requests requests, whichever ends first (an open level sends
min(R x duration, requests); at R = inf, --requests or 64). Per level: requests, errors by status (429, 503, 504, other; an error event
inside a stream counts by its code), TTFT / ITL / end-to-end percentiles, output tokens/s, requests/s,
and goodput: the share of requests with TTFT <= --slo-ttft and mean ITL <= --slo-itl.

Prompts come from --prompts (JSONL with a "prompt" or "text" field, or text: a prompt per non-blank line),
or are cut from the built-in corpus (the Python standard library's source) to --input-len tokens, as the
server's tokenizer counts them: one calibration request measures its characters per token. A cut prompt is
not sent twice within 4096 requests, so that a server's prompt cache answers none of them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeserve.bench.client import Part, client_processes, clients, run_parts
from moeserve.bench.plots import PlotUnavailable
from moeserve.bench.report import BenchError, check_plot, finish
from moeserve.bench.serve_report import compare, markdown
from moeserve.bench.stats import percentile
from moeserve.runtime.device import machine

SCHEMA = "moeserve.bench.serve/1"
BURST = 64  # requests of a --rate inf level without --requests
SCHEMA_FILE = Path(__file__).with_name("serve_schema.json")
STREAM_ERROR_STATUS = {"queue_full": 429, "not_ready": 503, "shutting_down": 503, "deadline_exceeded": 504}


class ServerGone(Exception):
    """The endpoint stopped answering mid-run: what was measured is kept, exit 1."""


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str
    model: str | None = None  # default: the first model of GET /v1/models
    api_key: str | None = None
    endpoint: str = "completions"  # or "chat"
    concurrency: tuple[int, ...] = (1, 4, 16)
    rates: tuple[float, ...] = ()
    duration_s: float = 20.0
    requests: int | None = None  # per level, at most
    prompts: Path | None = None
    input_len: tuple[int, int] = (128, 128)  # tokens, low..high (uniform)
    output_len: tuple[int, int] = (64, 64)
    ignore_eos: str = "auto"  # auto: where the server says it is moeserve (which takes the field)
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    timeout_s: float = 300.0
    seed: int = 0
    # processes the load generator runs in, each with its share of a level's users or arrivals: one streams ~10k
    # tokens/s at most (~100 us of CPU a token through httpx), less than a fast server sends
    client_procs: int = 1


@dataclass
class Record:
    """One request as the client saw it."""

    start: float  # seconds since the level began
    status: str  # "200", "429", ..., "connection", "timeout", "stream:<code>"
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk, seconds since start
    output_tokens: int = 0
    prompt_tokens: int = 0
    retried: bool = False  # its kept-alive connection was closed before any byte of an answer: sent again once

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def mean_itl_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.ok and self.output_tokens > 1 else None


# ---- the endpoint ------------------------------------------------------------------------------------
def headers(cfg: ServeBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def probe(cfg: ServeBenchConfig) -> dict:
    """GET /v1/models: the server's answer, or a BenchError saying why there is none to use."""
    import httpx

    url = cfg.url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(url, headers=headers(cfg), timeout=10)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code in (401, 403):
        raise BenchError(f"{url} answered {r.status_code}: it wants an API key{' (this one was refused)' if cfg.api_key else ''}"
                         "; pass --api-key")
    try:
        data = r.json()["data"]
        ids = [m["id"] for m in data]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url} answered {r.status_code} without an OpenAI model list: not an OpenAI-compatible "
                         "endpoint (give the server's base URL, without /v1)") from None
    if cfg.model is not None and cfg.model not in ids:
        raise BenchError(f"--model {cfg.model!r}: the server serves {', '.join(map(repr, ids)) or 'no model'}")
    if not ids:
        raise BenchError(f"{url} lists no model")
    return r.json()


def request_body(cfg: ServeBenchConfig, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if cfg.endpoint == "chat" else {"prompt": prompt})
    return {**body, "ignore_eos": True} if ignore_eos else body


def chunk_text(event: dict, chat: bool) -> str:
    choices = event.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or "" if chat else choices[0].get("text") or ""


async def send(client, cfg: ServeBenchConfig, body: dict, t0: float) -> Record:
    """One streamed request; its record (times in seconds since t0). A request whose connection closed before
    any byte of an answer came is sent once more, on a new connection: a server may close a kept-alive connection
    as the client reuses it (llama-server does), and that race is the client's to handle, as HTTP clients retry
    a request that never reached the server; it is counted in `retries`, not as the server's error. Any other
    failure, or a second one, counts."""
    import httpx

    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    rec = Record(start - t0, "200")
    answered = False  # the status line arrived
    try:
        while True:
            try:
                async with client.stream("POST", path, json=body) as r:
                    answered = True
                    if r.status_code != 200:
                        await r.aread()
                        rec.status = str(r.status_code)
                        return rec
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            code = (event["error"] or {}).get("code")
                            rec.status = str(STREAM_ERROR_STATUS.get(code, f"stream:{code}"))
                            return rec
                        if chunk_text(event, cfg.endpoint == "chat"):
                            rec.chunk_times.append(time.perf_counter() - start)
                        if event.get("usage"):
                            rec.output_tokens = event["usage"].get("completion_tokens") or 0
                            rec.prompt_tokens = event["usage"].get("prompt_tokens") or 0
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                if answered or rec.retried:
                    raise
                rec.retried = True
    except httpx.TimeoutException:
        rec.status = "timeout"
        return rec
    except (httpx.HTTPError, ValueError) as e:
        rec.status = "connection" if isinstance(e, httpx.TransportError) else f"other:{type(e).__name__}"
        return rec
    rec.e2e_s = time.perf_counter() - start
    rec.ttft_s = rec.chunk_times[0] if rec.chunk_times else None
    rec.output_tokens = rec.output_tokens or len(rec.chunk_times)  # a server without usage in streams
    return rec


# ---- prompts -----------------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"--prompts {path}: cannot read ({e})") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
                prompts.append(record["prompt"] if "prompt" in record else record["text"])
            except (ValueError, KeyError, TypeError):
                raise BenchError(f"--prompts {path}:{n}: expected a JSON object with a \"prompt\" or \"text\" "
                                 "string") from None
        else:
            prompts.append(line)
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BenchError(f"--prompts {path}: no prompts (or an empty one)")
    return prompts


def corpus_text(chars: int) -> str:
    """At least `chars` characters of the built-in corpus (the standard library's source)."""
    from moeserve.training.data import default_corpus_files

    parts, total = [], 0
    for path in default_corpus_files():
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= chars:
            break
    return "".join(parts)


def chars_per_token(cfg: ServeBenchConfig, model: str, sample: str) -> float:
    """The server's tokenizer on this text: characters per prompt token, from one request's usage. A sample
    the server refuses as too long (400, 413 or 422: longer than a context it did not announce) is cut to a
    quarter and sent again, down to 16 characters; any other refusal is reported with the server's message."""
    import httpx

    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    while True:
        body = {**request_body(cfg, model, sample, 1, False), "stream": False}
        del body["stream_options"]
        try:
            r = httpx.post(cfg.url.rstrip("/") + path, json=body, headers=headers(cfg), timeout=60)
        except httpx.HTTPError as e:
            raise BenchError(f"POST {path} failed ({type(e).__name__}: {e}): cannot size prompts in tokens") from None
        if r.status_code in (400, 413, 422) and len(sample) >= 64:
            sample = sample[: len(sample) // 4]
            continue
        if r.status_code != 200:
            raise BenchError(f"POST {path} answered {r.status_code} ({_server_message(r)}) to a {len(sample)}-character "
                             "prompt: cannot size prompts in tokens; give --prompts")
        try:
            tokens = r.json()["usage"]["prompt_tokens"]
        except (ValueError, KeyError, TypeError) as e:
            raise BenchError(f"POST {path} did not answer with usage.prompt_tokens ({type(e).__name__}): cannot size "
                             "prompts in tokens; give --prompts") from None
        return max(len(sample) / max(tokens, 1), 0.25)


def _server_message(r) -> str:
    """An OpenAI-style error's message, else the start of the body."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200].strip() or "no body"


def workload(cfg: ServeBenchConfig, model: str, n: int, context: int | None) -> list[tuple[str, int]]:
    """(prompt, max_tokens) for n requests: deterministic for a seed. `context`: the model's, where the
    server says it (moeserve and vLLM do, as max_model_len)."""
    if context is not None and cfg.prompts is None and cfg.input_len[1] + cfg.output_len[1] > context:
        raise BenchError(f"--input-len {cfg.input_len[1]} + --output-len {cfg.output_len[1]} tokens do not fit the "
                         f"model's context of {context}")
    rng = random.Random(cfg.seed)
    out_lens = [rng.randint(*cfg.output_len) for _ in range(n)]
    if cfg.prompts is not None:
        prompts = read_prompts(cfg.prompts)
        return [(prompts[i % len(prompts)], out_lens[i]) for i in range(n)]
    in_lens = [rng.randint(*cfg.input_len) for _ in range(n)]
    text = corpus_text(200_000)
    cpt = chars_per_token(cfg, model, text[:min(2000, (context or 4096) // 2)])
    starts = [rng.randrange(0, len(text) - 20_000) for _ in range(n)]
    return [(text[s:s + max(1, int(k * cpt))], m) for s, k, m in zip(starts, in_lens, out_lens)]


# ---- load levels -------------------------------------------------------------------------------------
def arrival_times(rate: float, n: int, seed: int) -> list[float]:
    """n Poisson arrival times at `rate`, the first at 0, the n - 1 gaps scaled to add up to (n - 1) / rate
    seconds: the rate of the schedule is exactly the asked one (all 0 for an infinite rate)."""
    if math.isinf(rate) or n < 2:
        return [0.0] * n
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(n - 1)]
    scale = ((n - 1) / rate) / sum(gaps)
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + g * scale)
    return times


async def closed_level(cfg: ServeBenchConfig, model: str, work: list[tuple[str, int]], users: int,
                       ignore_eos: bool, part: Part = Part()) -> tuple[list[Record], float]:
    """`users` closed-loop users (this part's share of them) until the duration or --requests ends the level; the
    clients are made before its clock starts."""
    records: list[Record] = []
    limit = part.share(cfg.requests) if cfg.requests else math.inf  # else the duration ends it
    sent = 0

    async def user(client) -> None:
        nonlocal sent
        while time.perf_counter() < end and sent < limit:
            prompt, max_tokens = work[(part.k + part.n * sent) % len(work)]  # the prompts round-robin
            sent += 1
            records.append(await send(client, cfg, request_body(cfg, model, prompt, max_tokens, ignore_eos), t0))

    async with clients(cfg.url, part.share(users), headers=headers(cfg), timeout_s=cfg.timeout_s) as pool:
        t0 = await part.start()
        end = t0 + cfg.duration_s
        await asyncio.gather(*(user(c) for c in pool))
    return records, time.perf_counter() - t0


async def open_level(cfg: ServeBenchConfig, model: str, work: list[tuple[str, int]], rate: float,
                     ignore_eos: bool, part: Part = Part()) -> tuple[list[Record], float]:
    """The level's Poisson arrivals (this part's share of them), each sent at its time whatever the answers do."""
    times = arrival_times(rate, level_requests(cfg, rate), cfg.seed)
    mine = range(part.k, len(times), part.n)
    async with clients(cfg.url, min(len(mine), 64), headers=headers(cfg), timeout_s=cfg.timeout_s,
                       connections=None) as pool:
        t0 = await part.start()

        async def at(j: int, i: int) -> Record:
            await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
            prompt, max_tokens = work[i % len(work)]
            return await send(pool[j % len(pool)], cfg, request_body(cfg, model, prompt, max_tokens, ignore_eos), t0)

        records = list(await asyncio.gather(*(at(j, i) for j, i in enumerate(mine))))
    return records, time.perf_counter() - t0


def run_level(cfg: ServeBenchConfig, model: str, work: list[tuple[str, int]], kind: str, value: float,
              ignore_eos: bool, pool=None) -> tuple[list[Record], float]:
    """One level's records and wall time: in this process, or split over `pool`'s processes (cfg.client_procs, at
    most one a user or request), which begin together and whose records are merged."""
    level, arg = (closed_level, int(value)) if kind == "concurrency" else (open_level, value)
    n = min(cfg.client_procs, int(value) if kind == "concurrency" else level_requests(cfg, value))
    if pool is None or n < 2:
        return asyncio.run(level(cfg, model, work, arg, ignore_eos))
    parts = run_parts(pool, n, level, cfg, model, work, arg, ignore_eos)
    return sorted((r for records, _ in parts for r in records), key=lambda r: r.start), max(w for _, w in parts)


def distinct_prompts(cfg: ServeBenchConfig) -> int:
    """As many prompts as the largest level sends, at most 4096 (a closed level without --requests: 4096). A prompt
    sent again is answered from the prompt cache of a server that keeps one (llama-server does by default): with 4
    per client, as before, llama-server served 8 clients of the 644M Mixtral 1.5x faster than on fresh prompts,
    most of its prompts evaluating 1 token."""
    sends = [level_requests(cfg, r) for r in cfg.rates] + [cfg.requests or 4096 for _ in cfg.concurrency]
    return min(max(sends + [cfg.requests or 1]), 4096)


def level_requests(cfg: ServeBenchConfig, rate: float) -> int:
    """Requests an open level sends: rate x duration, at most --requests; --requests (or BURST) for inf."""
    if math.isinf(rate):
        return cfg.requests or BURST
    return max(1, min(cfg.requests or math.inf, int(rate * cfg.duration_s)))


def summarize(kind: str, value: float, records: list[Record], wall_s: float, cfg: ServeBenchConfig) -> dict:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.status if r.status in ("429", "503", "504") else "other"
            errors[key] = errors.get(key, 0) + 1

    def dist(xs: list[float]) -> dict:
        ms = [x * 1e3 for x in xs]
        return {"p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99),
                "max": max(ms, default=None), "mean": sum(ms) / len(ms) if ms else None}

    def good(r: Record) -> bool:
        return (cfg.slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1e3 <= cfg.slo_ttft_ms)) and \
               (cfg.slo_itl_ms is None or r.mean_itl_s is None or r.mean_itl_s * 1e3 <= cfg.slo_itl_ms)

    sends = sorted(r.start for r in records)
    achieved = (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0] else None
    tokens = sum(r.output_tokens for r in ok)
    goodput = [r for r in ok if good(r)]
    return {"kind": kind, "value": value if not math.isinf(value) else "inf", "requests": len(records),
            "ok": len(ok), "errors": errors, "retries": sum(r.retried for r in records),
            "other_statuses": sorted({r.status for r in records
                                                                       if not r.ok and r.status not in errors}),
            "wall_s": round(wall_s, 3), "requests_per_s": len(ok) / wall_s, "output_tokens_per_s": tokens / wall_s,
            "achieved_rate": achieved, "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
            "output_tokens_mean": tokens / len(ok) if ok else None,
            "ttft_ms": dist([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_ms": dist([x for r in ok for x in r.itls]), "e2e_ms": dist([r.e2e_s for r in ok]),
            "goodput": len(goodput) / len(records) if records else None,
            "goodput_requests_per_s": len(goodput) / wall_s}


def uses_ignore_eos(cfg: ServeBenchConfig, models: dict) -> bool:
    if cfg.ignore_eos != "auto":
        return cfg.ignore_eos == "on"
    return any(m.get("owned_by") in ("moeserve", "vllm") for m in models.get("data", []))


def bench_serve(cfg: ServeBenchConfig, log=lambda msg: None, report: dict | None = None) -> dict:
    """Run every level; `report` (filled as levels end) is what a caller keeps if the server goes away."""
    report = report if report is not None else {}
    models = probe(cfg)
    model = cfg.model or models["data"][0]["id"]
    ignore_eos = uses_ignore_eos(cfg, models)
    report.update({"schema": SCHEMA, "config": {**asdict(cfg), "prompts": str(cfg.prompts) if cfg.prompts else None,
                                                "rates": [r if not math.isinf(r) else "inf" for r in cfg.rates]},
                   "machine": machine(), "libraries": libraries(), "server": {"url": cfg.url, "models": models},
                   "model": model, "ignore_eos": ignore_eos, "levels": [], "complete": False, "error": None})
    card = next(m for m in models["data"] if m["id"] == model)
    context = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) else None
    work = workload(cfg, model, distinct_prompts(cfg), context)
    levels = [("concurrency", float(c)) for c in cfg.concurrency] + [("rate", r) for r in cfg.rates]
    with client_processes(cfg.client_procs, (__name__,)) as pool:
        for kind, value in levels:
            log(f"{kind} {value:g}: up to {cfg.duration_s:g} s" + (f" or {cfg.requests} requests" if cfg.requests
                                                                   else ""))
            records, wall = run_level(cfg, model, work, kind, value, ignore_eos, pool)
            report["levels"].append(summarize(kind, value, records, wall, cfg))
            if records and all(r.status in ("connection", "timeout") for r in records):
                raise ServerGone(f"{kind} {value:g}: every request failed ({records[0].status}); the server stopped "
                                 "answering")
    report["complete"] = True
    return report


def libraries() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("moeserve", "torch", "httpx", "fastapi", "uvicorn", "transformers", "onnxruntime"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def config_from_args(args) -> ServeBenchConfig:
    def span(values: list[int], name: str) -> tuple[int, int]:
        if len(values) not in (1, 2) or min(values) < 1 or values[0] > values[-1]:
            raise BenchError(f"--{name} {' '.join(map(str, values))}: expected N or LOW HIGH, integers >= 1")
        return values[0], values[-1]

    if any(c < 1 for c in args.concurrency) or any(not r > 0 for r in args.rate):
        raise BenchError("--concurrency levels must be >= 1 and --rate levels > 0 (inf: all at once)")
    if not args.duration > 0 or (args.requests is not None and args.requests < 1):
        raise BenchError("--duration must be > 0 and --requests >= 1")
    if args.client_procs < 1:
        raise BenchError(f"--client-procs {args.client_procs}: expected an integer >= 1")
    concurrency, rates = tuple(args.concurrency), tuple(args.rate)
    duration, requests = args.duration, args.requests
    if args.quick:  # seconds, for CI and a first look
        concurrency, rates = concurrency[:1] or (1,), rates[:1]
        duration, requests = min(duration, 3.0), min(requests or 8, 8)
    if not concurrency and not rates:
        raise BenchError("no load levels: give --concurrency and/or --rate")
    return ServeBenchConfig(url=args.url, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
                            concurrency=concurrency, rates=rates, duration_s=duration, requests=requests,
                            prompts=args.prompts, input_len=span(args.input_len, "input-len"),
                            output_len=span(args.output_len, "output-len"), ignore_eos=args.ignore_eos,
                            slo_ttft_ms=args.slo_ttft, slo_itl_ms=args.slo_itl, timeout_s=args.timeout,
                            seed=args.seed, client_procs=args.client_procs)


def main(args) -> int:
    def err(msg: str) -> None:
        print(f"moeserve bench serve: {msg}", file=sys.stderr)

    if args.compare:
        try:
            a, b = (json.loads(Path(p).read_text()) for p in args.compare)
            print(compare(a, b))
        except (OSError, ValueError, KeyError, TypeError) as e:
            err(f"--compare: {type(e).__name__}: {e}")
            return 2
        return 0
    if not args.url:
        err("--url is required (the server's base URL, e.g. http://127.0.0.1:8000), or --compare A.json B.json")
        return 2
    log = (lambda msg: None) if args.quiet else (lambda msg: err(msg))
    report: dict = {}
    code = 0
    try:
        cfg = config_from_args(args)
        check_plot(args)
        bench_serve(cfg, log, report)
    except (BenchError, PlotUnavailable) as e:
        err(str(e))
        return 2
    except (ServerGone, KeyboardInterrupt) as e:
        report["error"] = str(e) or type(e).__name__
        err(f"stopped: {report['error']}; the levels measured so far are kept")
        code = 1
    print(markdown(report))
    finish(report, args, "serve", plot=bool(report["levels"]))
    return code
