"""`moeserve bench http`: the HTTP server (`moeserve serve`) under load, each number against a baseline
measured in the same run, on the same checkpoint, dtype and requests.

1. Throughput: continuous batching, run-to-completion batches (`--scheduler batch`) and batch size 1. A
   server subprocess (the real command line) serves a closed loop of C concurrent clients, each sending
   completions back to back (prompts from a fixed list of short code-like prompts, temperature 0.8, a
   seed per request, so every run sends the same requests); after a warm-up that is not counted, the
   completions that end within the timed window are counted. The servers run one after the other, never
   together. The mean batch size (rows per step, for the continuous server) comes from the server's own
   `/metrics`, read at the start and at the end of the window.
   Mixed: the same loop with half the clients asking for --max-tokens and half for --long-tokens, on the
   continuous and the batch server: where a short request waits behind long ones, and where it does not.
2. HTTP overhead. One client sends the same greedy request R times, one at a time; each is paired with
   the same completion made by a direct `Engine.complete` call in this process (same checkpoint, dtype
   and torch thread count). The two alternate (never overlap, order swapped every round), so drift in
   the machine's speed hits both alike; the overhead is the median of the per-round differences. Against
   a server with `--batch-wait-ms 0` (HTTP, validation, queue and thread hand-off), and one with the
   default wait, which a lone request sits out in full.
3. Overload. A server with a small queue (`--max-queue 8 --max-batch-size 4`) gets K requests at once,
   over K connections opened beforehand: it must answer the excess 429 at once, each with Retry-After
   (a raw-socket client here, so that the client's own work is not most of what is measured).
4. Choices and log-probabilities, on one continuous server, in alternating rounds: a request for n = 4
   choices of a long prompt against four concurrent requests for one choice each (same prompt, the
   seeds the n choices use), as choices per second, with the tokens the experts saw per round (from the
   server's expert-load counter: a prefill computed once or four times); and a greedy request with
   logprobs 5 against the same request without, as generated tokens per second.

The client (httpx on asyncio, one AsyncClient and connection per simulated user) runs in this process and
shares the machine with the server: its cost is part of what is measured, alike for both sides of each
comparison.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from moeserve.bench.client import Outcome, async_client, clients, completion_body, post_completion, read_response
from moeserve.bench.http_report import markdown
from moeserve.bench.report import check_plot, finish
from moeserve.bench.server_process import ServerLog, running_server, sigterm_as_exit
from moeserve.bench.stats import percentile, ratio
from moeserve.runtime.device import machine

PROMPTS: tuple[str, ...] = (
    "def ", "import os\n", "class Node:\n", "for i in range(", "return self.", "if __name__ == ",
    "    def __init__(self", "try:\n    ", "with open(", "from typing import ", "raise ValueError(",
    "while True:\n", "lambda x: ", "print(f\"", "async def ", "self.assert",
)
OVERHEAD_PROMPT = "def main("
Log = Callable[[str], None]


@dataclass(frozen=True)
class HttpBenchConfig:
    checkpoint: Path
    dtype: str = "auto"
    clients: int = 32
    duration_s: float = 10.0
    warmup_s: float = 2.0
    max_tokens: int = 16
    long_tokens: int = 200  # the mixed workload's long requests (the default model's context is 256)
    batch_size: int = 32  # --max-batch-size of the batch server, --kv-slots of the continuous one
    requests: int = 50  # R, overhead rounds
    overload: int = 256  # K, requests fired at once
    overload_queue: int = 8
    overload_batch_size: int = 4
    overload_tokens: int = 32
    choice_rounds: int = 20
    parts: tuple[str, ...] = ("throughput", "mixed", "overhead", "overload", "choices")


# ---- statistics -------------------------------------------------------------------------------------
def _ms(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def metric_sums(text: str, family: str, labels: dict[str, str] | None = None) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram in exposition text, for the series with these labels."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if any(s.labels.get(k) != v for k, v in (labels or {}).items()):
                continue
            if s.name == f"{family}_sum":
                total += s.value
            elif s.name == f"{family}_count":
                count += s.value
    return total, count


def counter_total(text: str, family: str) -> float:
    """The sum of a Prometheus counter's series in exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == family
               for s in fam.samples if s.name == f"{family}_total")


# ---- 1. throughput -------------------------------------------------------------------------------------
def request_seed(client: int, n: int) -> int:
    return client * 1_000_003 + n


async def client_loop(client, i: int, lengths: tuple[int, ...], stop_at: float, out: list[Outcome]) -> None:
    n = 0
    asked = lengths[i % len(lengths)]
    while time.perf_counter() < stop_at:
        body = completion_body(PROMPTS[(i + n) % len(PROMPTS)], asked, 0.8, request_seed(i, n))
        outcome = await post_completion(client, body)
        outcome.asked = asked
        out.append(outcome)
        n += 1


async def closed_loop(url: str, cfg: HttpBenchConfig, lengths: tuple[int, ...]
                      ) -> tuple[list[Outcome], float, float, str, str]:
    """C clients for warm-up + duration, client i asking lengths[i % len(lengths)] tokens; returns every
    outcome, the window, and /metrics at its two ends."""
    async with clients(url, cfg.clients) as users, async_client(url, 1) as scraper:
        t0 = time.perf_counter()
        window = (t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.duration_s)
        outcomes: list[Outcome] = []
        loops = [asyncio.create_task(client_loop(c, i, lengths, window[1], outcomes)) for i, c in enumerate(users)]
        try:
            await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
            before = (await scraper.get("/metrics")).text
            await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
            after = (await scraper.get("/metrics")).text
            await asyncio.gather(*loops)
        finally:  # on an error or Ctrl-C, the clients stop before their connections close
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
    return outcomes, window[0], window[1], before, after


def throughput_row(name: str, flags: list[str], outcomes: list[Outcome], window: tuple[float, float],
                   metrics: tuple[str, str]) -> dict:
    """Counts the requests that ended within the window; batch statistics are the window's too."""
    done = [o for o in outcomes if window[0] <= o.end <= window[1]]
    ok = [o for o in done if o.status == 200]
    seconds = window[1] - window[0]
    lat = [o.latency_ms for o in ok]
    (s0, c0), (s1, c1) = (metric_sums(m, "moeserve_batch_size", {"kind": "complete"}) for m in metrics)
    (d0, _), (d1, _) = (metric_sums(m, "moeserve_batch_duration_seconds", {"kind": "complete"}) for m in metrics)
    batches = c1 - c0
    errors = [o for o in done if o.status != 200]
    by_length = {}
    for asked in sorted({o.asked for o in ok}):
        mine = [o.latency_ms for o in ok if o.asked == asked]
        by_length[str(asked)] = {"requests": len(mine), "p50_ms": _ms(percentile(mine, 50)),
                                 "p90_ms": _ms(percentile(mine, 90))}
    return {"config": name, "flags": " ".join(flags), "window_s": round(seconds, 2), "requests": len(ok),
            "errors": len(errors), "error_kinds": sorted({o.error or "" for o in errors}),
            "rps": round(len(ok) / seconds, 2), "tokens_per_s": round(sum(o.tokens for o in ok) / seconds, 1),
            "mean_tokens": round(statistics.mean(o.tokens for o in ok), 2) if ok else None,
            "p50_ms": _ms(percentile(lat, 50)), "p90_ms": _ms(percentile(lat, 90)), "p99_ms": _ms(percentile(lat, 99)),
            "max_ms": _ms(max(lat, default=None)), "by_max_tokens": by_length, "batches": int(batches),
            "mean_batch_size": round((s1 - s0) / batches, 2) if batches else None,
            "mean_batch_ms": round((d1 - d0) / batches * 1e3, 2) if batches else None}


def servers(cfg: HttpBenchConfig) -> dict[str, list[str]]:
    """The server configurations compared, by name: their `moeserve serve` flags."""
    n = str(cfg.batch_size)
    return {"continuous": ["--scheduler", "continuous", "--kv-slots", n],
            "batch": ["--scheduler", "batch", "--max-batch-size", n],
            "batch size 1": ["--scheduler", "batch", "--max-batch-size", "1"]}


def run_loops(cfg: HttpBenchConfig, names: list[str], lengths: tuple[int, ...], log: Log, part: str) -> list[dict]:
    rows = []
    for name in names:
        flags = servers(cfg)[name]
        log(f"{part}: {name} ({' '.join(flags)}), {cfg.clients} clients asking {'/'.join(map(str, lengths))} "
            f"tokens, {cfg.warmup_s:g} s warm-up + {cfg.duration_s:g} s")
        server = ServerLog()
        with running_server(cfg.checkpoint, cfg.dtype, flags, server) as url:
            outcomes, t0, t1, before, after = asyncio.run(closed_loop(url, cfg, lengths))
        rows.append({**throughput_row(name, flags, outcomes, (t0, t1), (before, after)), "server": server.summary()})
    return rows


def bench_throughput(cfg: HttpBenchConfig, log: Log) -> dict:
    rows = run_loops(cfg, ["continuous", "batch", "batch size 1"], (cfg.max_tokens,), log, "throughput")
    rps = {r["config"]: r["rps"] for r in rows}
    return {"rows": rows, "speedup": ratio(rps["batch"], rps["batch size 1"]),
            "continuous_vs_batch": ratio(rps["continuous"], rps["batch"])}


def bench_mixed(cfg: HttpBenchConfig, log: Log) -> dict:
    rows = run_loops(cfg, ["continuous", "batch"], (cfg.max_tokens, cfg.long_tokens), log, "mixed")
    cont, batch = rows
    short = str(cfg.max_tokens)
    p50 = [r["by_max_tokens"].get(short, {}).get("p50_ms") for r in rows]
    return {"rows": rows, "rps_ratio": ratio(cont["rps"], batch["rps"]), "short_p50_ratio": ratio(p50[0], p50[1])}


# ---- 2. HTTP overhead -----------------------------------------------------------------------------------
def timed_direct(engine, prompt: str, max_tokens: int) -> tuple[float, str]:
    from moeserve.runtime.engine import SamplingParams

    t0 = time.perf_counter()
    text = engine.complete([prompt], [SamplingParams(max_new_tokens=max_tokens, temperature=0.0)])[0].text
    return (time.perf_counter() - t0) * 1e3, text


def timed_http(client, max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=completion_body(OVERHEAD_PROMPT, max_tokens, 0.0, None))
    ms = (time.perf_counter() - t0) * 1e3
    r.raise_for_status()
    return ms, r.json()["choices"][0]["text"]


def paired_rounds(url: str, engine, cfg: HttpBenchConfig, pause_s: float = 0.02, warmup: int = 3) -> dict:
    """R rounds of one HTTP and one direct call, order swapped each round, a short pause between calls
    (so neither process's idle threads are still spinning when the other's call starts)."""
    import httpx

    http_ms, direct_ms, same = [], [], True
    with httpx.Client(base_url=url, timeout=60) as client:
        calls = (lambda: timed_http(client, cfg.max_tokens), lambda: timed_direct(engine, OVERHEAD_PROMPT,
                                                                                   cfg.max_tokens))
        for n in range(warmup + cfg.requests):
            order = calls if n % 2 == 0 else calls[::-1]
            results = []
            for call in order:
                time.sleep(pause_s)
                results.append(call())
            (h, h_text), (d, d_text) = results if n % 2 == 0 else results[::-1]
            if n >= warmup:
                http_ms.append(h)
                direct_ms.append(d)
                same = same and h_text == d_text
    diffs = [h - d for h, d in zip(http_ms, direct_ms)]
    return {"requests": len(http_ms), "p50_http_ms": _ms(percentile(http_ms, 50)),
            "p50_direct_ms": _ms(percentile(direct_ms, 50)), "p50_overhead_ms": _ms(percentile(diffs, 50)),
            "p90_overhead_ms": _ms(percentile(diffs, 90)), "max_http_ms": _ms(max(http_ms, default=None)),
            "same_text": same}


def bench_overhead(cfg: HttpBenchConfig, engine, log: Log) -> list[dict]:
    rows = []
    for wait_ms in (0.0, 5.0):
        log(f"overhead: --batch-wait-ms {wait_ms:g}, {cfg.requests} paired rounds")
        server = ServerLog()
        with running_server(cfg.checkpoint, cfg.dtype, ["--batch-wait-ms", f"{wait_ms:g}"], server) as url:
            row = paired_rounds(url, engine, cfg)
        rows.append({"batch_wait_ms": wait_ms, **row, "server": server.summary()})
    return rows


# ---- 3. overload ----------------------------------------------------------------------------------------
async def burst(url: str, cfg: HttpBenchConfig) -> list[Outcome]:
    """K connections opened first (a GET each), then K completions sent at once. The client writes bytes
    prepared beforehand on plain asyncio sockets and reads only the status line, headers and body length:
    with an httpx client per connection, the client's own per-request work on the 2 cores it shares with
    the server made up most of what a 429 appeared to take."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    bodies = [json.dumps(completion_body(PROMPTS[i % len(PROMPTS)], cfg.overload_tokens, 0.8, i)).encode()
              for i in range(cfg.overload)]
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(cfg.overload)]
    try:
        for reader, writer in conns:
            writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            await read_response(reader)
        posts = [f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies]

        async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> Outcome:
            start = time.perf_counter()
            writer.write(request)
            try:
                status, headers = await read_response(reader)
            except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
                return Outcome(start, time.perf_counter(), None, error=type(e).__name__)
            return Outcome(start, time.perf_counter(), status, retry_after=headers.get("retry-after"),
                           error=None if status == 200 else f"HTTP {status}")

        return list(await asyncio.gather(*(send(r, w, p) for (r, w), p in zip(conns, posts))))
    finally:
        for _, writer in conns:
            writer.close()


def overload_row(outcomes: list[Outcome], cfg: HttpBenchConfig) -> dict:
    ok = [o.latency_ms for o in outcomes if o.status == 200]
    full = [o for o in outcomes if o.status == 429]
    other = [o for o in outcomes if o.status not in (200, 429)]
    lat429 = [o.latency_ms for o in full]
    return {"requests": len(outcomes), "max_queue": cfg.overload_queue, "max_batch_size": cfg.overload_batch_size,
            "max_tokens": cfg.overload_tokens, "ok": len(ok), "rejected_429": len(full), "other": len(other),
            "other_kinds": sorted({o.error or "" for o in other}),
            "p50_429_ms": _ms(percentile(lat429, 50)), "p99_429_ms": _ms(percentile(lat429, 99)),
            "p50_200_ms": _ms(percentile(ok, 50)), "max_200_ms": _ms(max(ok, default=None)),
            "all_429_retry_after": all(o.retry_after for o in full),
            "retry_after_values": sorted({o.retry_after for o in full if o.retry_after})}


def bench_overload(cfg: HttpBenchConfig, log: Log) -> dict:
    log(f"overload: {cfg.overload} requests at once, --max-queue {cfg.overload_queue} "
        f"--max-batch-size {cfg.overload_batch_size}")
    server = ServerLog()
    extra = ["--max-queue", str(cfg.overload_queue), "--max-batch-size", str(cfg.overload_batch_size)]
    with running_server(cfg.checkpoint, cfg.dtype, extra, server) as url:
        outcomes = asyncio.run(burst(url, cfg))
    return {**overload_row(outcomes, cfg), "server": server.summary()}


# ---- 4. choices and log-probabilities --------------------------------------------------------------------
CHOICES = 4


def choice_variants(prompt: str, max_tokens: int, seed: int) -> dict[str, list[dict]]:
    """The requests of one round, by variant: each variant's requests are sent at once."""
    sampled = completion_body(prompt, max_tokens, 0.8, None)
    greedy = completion_body(prompt, max_tokens, 0.0, None)
    return {f"n={CHOICES}": [{**sampled, "n": CHOICES, "seed": seed}],
            f"{CHOICES} requests": [{**sampled, "seed": seed + j} for j in range(CHOICES)],
            "logprobs 5": [{**greedy, "logprobs": 5}],
            "no logprobs": [greedy]}


async def choice_rounds(url: str, cfg: HttpBenchConfig, prompt: str, warmup: int = 2) -> dict[str, list[tuple]]:
    """(seconds, generated tokens, texts, prompt tokens, expert-routed tokens) of every timed round of each
    variant, the order of the variants reversed every other round."""
    out: dict[str, list[tuple]] = {}
    async with async_client(url, CHOICES) as client:
        async def post(body: dict) -> dict:
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()

        for n in range(warmup + cfg.choice_rounds):
            variants = list(choice_variants(prompt, cfg.max_tokens, 1000 * n).items())
            for name, bodies in variants if n % 2 == 0 else variants[::-1]:
                routed = counter_total((await client.get("/metrics")).text, "moeserve_expert_routed_tokens")
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(post(b) for b in bodies))
                dt = time.perf_counter() - t0
                routed = counter_total((await client.get("/metrics")).text, "moeserve_expert_routed_tokens") - routed
                if n >= warmup:
                    texts = [c["text"] for a in answers for c in a["choices"]]
                    out.setdefault(name, []).append((dt, sum(a["usage"]["completion_tokens"] for a in answers), texts,
                                                     answers[0]["usage"]["prompt_tokens"], routed))
    return out


def choices_row(rounds: dict[str, list[tuple]]) -> dict:
    def median_s(name: str) -> float:
        return statistics.median(r[0] for r in rounds[name])

    n, separate = f"n={CHOICES}", f"{CHOICES} requests"
    per_s = {name: round(CHOICES / median_s(name), 2) for name in (n, separate)}
    tok_s = {name: round(statistics.median(r[1] / r[0] for r in rounds[name]), 1)
             for name in ("logprobs 5", "no logprobs")}
    return {"prompt_tokens": rounds[n][0][3], "rounds": len(rounds[n]),
            "choices_per_s": per_s, "n_vs_separate": ratio(per_s[n], per_s[separate]),
            "routed_per_round": {name: statistics.median(r[4] for r in rounds[name]) for name in (n, separate)},
            "same_choices": all(a[2] == b[2] for a, b in zip(rounds[n], rounds[separate])),
            "tokens_per_s": tok_s, "logprobs_cost": ratio(tok_s["logprobs 5"], tok_s["no logprobs"]),
            "same_text": all(a[2] == b[2] for a, b in zip(rounds["logprobs 5"], rounds["no logprobs"]))}


def bench_choices(cfg: HttpBenchConfig, log: Log) -> dict:
    prompt = "".join(PROMPTS) * 4  # long enough that a prefill costs what it does in real use
    log(f"choices: n={CHOICES} vs {CHOICES} requests, logprobs 5 vs none, {cfg.choice_rounds} rounds")
    server = ServerLog()
    with running_server(cfg.checkpoint, cfg.dtype, ["--kv-slots", str(max(CHOICES, cfg.batch_size))], server) as url:
        import httpx

        ctx = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        prompt = prompt[:ctx // 2]  # byte-level at most one token a character: half the context, room to generate
        rounds = asyncio.run(choice_rounds(url, cfg, prompt))
    return {**choices_row(rounds), "server": server.summary()}


# ---- the whole bench ------------------------------------------------------------------------------------
def resolved_dtype(dtype: str) -> str:
    from moeserve.runtime.engine import resolve_device, resolve_dtype

    return str(resolve_dtype(dtype, resolve_device("auto"))).removeprefix("torch.")


def bench_http(cfg: HttpBenchConfig, log: Log = lambda msg: None) -> dict:
    report: dict = {"checkpoint": str(cfg.checkpoint), "dtype": resolved_dtype(cfg.dtype), "machine": machine(),
                    "settings": {k: v for k, v in asdict(cfg).items() if k != "checkpoint"},
                    "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    if "throughput" in cfg.parts:
        report["throughput"] = bench_throughput(cfg, log)
    if "mixed" in cfg.parts:
        report["mixed"] = bench_mixed(cfg, log)
    if "overhead" in cfg.parts:
        from moeserve.runtime.engine import Engine

        engine = Engine.load(cfg.checkpoint, dtype=cfg.dtype)
        report["overhead"] = bench_overhead(cfg, engine, log)
    if "overload" in cfg.parts:
        report["overload"] = bench_overload(cfg, log)
    if "choices" in cfg.parts:
        report["choices"] = bench_choices(cfg, log)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def config_from_args(args) -> HttpBenchConfig:
    checkpoint = args.checkpoint
    if checkpoint is None:
        from moeserve.training.default_model import default_model_path

        checkpoint = default_model_path(progress=not args.quiet)
    parts = tuple(p for p in HttpBenchConfig.parts if not getattr(args, f"skip_{p}"))
    return HttpBenchConfig(checkpoint=Path(checkpoint), dtype=args.dtype, clients=args.clients,
                           duration_s=args.duration, warmup_s=args.warmup, max_tokens=args.max_tokens,
                           long_tokens=args.long_tokens,
                           batch_size=args.batch_size, requests=args.requests, overload=args.overload,
                           overload_queue=args.overload_queue, overload_batch_size=args.overload_batch_size,
                           overload_tokens=args.overload_tokens, choice_rounds=args.choice_rounds, parts=parts)


def main(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise ValueError("moeserve bench http needs httpx: pip install httpx") from e
    cfg = config_from_args(args)
    for name in ("clients", "requests", "overload", "batch_size", "max_tokens", "long_tokens", "overload_queue",
                 "overload_batch_size", "overload_tokens", "choice_rounds"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} = {getattr(cfg, name)}: expected an integer >= 1")
    if not cfg.duration_s > 0 or not cfg.warmup_s >= 0:
        raise ValueError("--duration must be > 0 and --warmup >= 0")
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"moeserve bench http: {msg}", file=sys.stderr))
    check_plot(args)
    with sigterm_as_exit():
        report = bench_http(cfg, log)
    print(markdown(report))
    finish(report, args, "http")
    return 0
