"""The benches' HTTP client side: what one request looked like to the client (`Outcome`), completions over
httpx (one client and connection per simulated user), a plain-socket response reader for when the
client's own work must stay out of the measurement (bench http's overload burst), and a load split over
processes (`Part`, `run_parts`: one process streams ~10k tokens/s at most)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import multiprocessing
import ssl
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from moeserve.bench.server_process import MODEL_NAME


@dataclass
class Outcome:
    """One request as the client saw it."""
    start: float
    end: float
    status: int | None  # None: no HTTP answer (connection error, timeout)
    tokens: int = 0
    retry_after: str | None = None
    error: str | None = None
    text: str = ""
    asked: int = 0  # max_tokens of the request

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1e3


def completion_body(prompt: str, max_tokens: int, temperature: float, seed: int | None) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    return body if seed is None else {**body, "seed": seed}


def outcome_of(start: float, status: int, headers, payload: dict | None) -> Outcome:
    end = time.perf_counter()
    if status != 200 or payload is None:
        return Outcome(start, end, status, retry_after=headers.get("retry-after"), error=f"HTTP {status}")
    return Outcome(start, end, status, tokens=payload["usage"]["completion_tokens"],
                   text=payload["choices"][0]["text"])


async def post_completion(client, body: dict) -> Outcome:
    import httpx

    start = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        return Outcome(start, time.perf_counter(), None, error=type(e).__name__)
    return outcome_of(start, r.status_code, r.headers, r.json() if r.status_code == 200 else None)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every client of this process, httpx's own (certifi's CAs, or $SSL_CERT_FILE /
    $SSL_CERT_DIR): httpx makes one per client otherwise, loading the CA bundle each time (~35 ms a client, a
    second of CPU for 32 users before a level could start)."""
    import httpx

    return httpx.create_ssl_context()


def async_client(url: str, connections: int | None, headers: dict[str, str] | None = None, timeout_s: float = 300.0):
    """An httpx client of at most `connections` connections (None: no limit)."""
    import httpx

    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s), headers=headers, verify=tls_context(),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


@contextlib.asynccontextmanager
async def clients(url: str, n: int, headers: dict[str, str] | None = None, timeout_s: float = 300.0,
                  connections: int | None = 1) -> AsyncIterator[list]:
    """n httpx clients of one connection each (by default), as n users would have. One client with an
    n-connection pool is not the same: httpcore re-scans every connection for every waiting request whenever
    one is added or done, so with n = 256 requests at once the client's own bookkeeping took seconds and set
    the latency."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(async_client(url, connections, headers, timeout_s)) for _ in range(n)]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """(status, lower-cased headers) of one HTTP/1.1 response, its body read to Content-Length."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", 0)))
    return status, headers


# ---- a load split over processes -------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """The share of a level that one client process runs: part k of n, begun at t0 (time.perf_counter's clock, which
    the processes of a machine share; None: at once). Part k sends the level's requests k, k + n, k + 2n, ..., so n
    parts send what one process would."""

    k: int = 0
    n: int = 1
    t0: float | None = None

    def share(self, total: int) -> int:
        return total // self.n + (self.k < total % self.n)

    async def start(self) -> float:
        if self.t0 is None:
            return time.perf_counter()
        await asyncio.sleep(max(0.0, self.t0 - time.perf_counter()))
        return self.t0


PART_START_S = 1.0  # a level split over processes begins this long after its parts are handed out


def run_part(level, *args):
    """A client process's part of a level (run_parts)."""
    return asyncio.run(level(*args))


def run_parts(pool: ProcessPoolExecutor, n: int, level, *args) -> list:
    """`level(*args, Part(k, n, t0))` for k < n, each in one of `pool`'s processes, begun together PART_START_S from
    now: their results, in k's order."""
    t0 = time.perf_counter() + PART_START_S
    return [f.result() for f in [pool.submit(run_part, level, *args, Part(k, n, t0)) for k in range(n)]]


@contextlib.contextmanager
def client_processes(n: int, modules: tuple[str, ...] = ()) -> Iterator[ProcessPoolExecutor | None]:
    """n load-generating processes, each started with `modules` imported (what its parts run: importing the serve
    bench takes ~2 s, longer than PART_START_S) before any level is timed; None for one."""
    if n < 2:
        yield None
        return
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_import, initargs=(modules,)) as pool:
        # n tasks at once start n workers; each takes one after its imports, and holds it long enough that no worker
        # takes a second while another is still starting
        list(pool.map(time.sleep, [1.0] * n))
        yield pool


def _import(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)
