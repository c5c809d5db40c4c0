"""The expert exchange over one TCP connection per shard actor (`--exchange sockets`, the default).

Ray places the shard actors, restarts them and reports their health; only the rows of an exchange go over a
socket of their own. Why not Ray's own transports (measured on 2 cores, `moeserve bench shards`, one token's
rows to 2 shards, three runs): a plain actor call submits a task through the raylet (2.6-4.1 ms), and a Ray
Compiled Graph, whose shared-memory channels cost less per call (1.3-2.0 ms), has every shard actor busy-wait
on its input channel, a whole core per shard while idle, which on a small machine is the cores the ingress
needs. Over sockets: 0.6-0.8 ms. A blocking read costs nothing while idle and wakes in microseconds; TCP
reaches a shard on another node as well.

    ingress:  REQUEST(layer, rows, width, experts) + counts (int64) + rows (the wire dtype)  -> shard
    shard:    ANSWER(ok, nbytes, compute seconds) + the shard's rows, or the error text      -> ingress

The shard checks every header against its own layers, width and experts before it reads a row, so a stray
connection gets an error answer and is closed, never a large allocation. Like Ray's own ports, the port is
open to the cluster's network: Ray assumes that network is trusted, and so does this.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import warnings
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from moeserve.errors import MoeServeError

REQUEST = struct.Struct("<4sIIII")  # magic, layer, rows, width, experts (counts that follow)
ANSWER = struct.Struct("<4sBQd")  # magic, ok, bytes that follow, compute seconds
REQUEST_MAGIC, ANSWER_MAGIC = b"MSXq", b"MSXa"
MAX_ROWS = 1 << 22  # rows in one exchange; a header past it is refused before anything is allocated

Compute = Callable[[int, np.ndarray, list[int]], np.ndarray]  # (layer, x_ND, counts) -> y_ND


# ---- tensors as arrays: Ray passes them without pickling their data, and a socket as their bytes ----------
def to_wire(t: Tensor) -> np.ndarray:
    """A CPU array; bf16, which numpy lacks, travels as its int16 bits."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def from_wire(a: np.ndarray, dtype: torch.dtype) -> Tensor:
    """A tensor over the array, no copy. Arrays from Ray's object store are read-only: torch warns that
    writing would be undefined, and nothing here writes to its inputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class ExchangeError(MoeServeError, ConnectionError):
    """A shard refused an exchange, failed computing it, or the connection broke."""


def raw(a) -> memoryview:
    """The bytes of an array or bytes-like (memoryview refuses to cast an array with no elements)."""
    v = memoryview(a)
    return v.cast("B") if v.nbytes else memoryview(b"")


def send_parts(sock: socket.socket, parts: list) -> None:
    """Every byte of `parts` in as few system calls as the kernel takes (one for a small exchange)."""
    views = [v for v in map(raw, parts) if len(v)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views:
            views[0] = views[0][sent:]


def recv_into(sock: socket.socket, buf: memoryview) -> bool:
    """Fill `buf` (an empty one at once); False if the peer closed the connection before the first byte."""
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            if got == 0:
                return False
            raise ExchangeError(f"the connection closed after {got} of {len(buf)} bytes")
        got += n
    return True


def recv_bytes(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if recv_into(sock, memoryview(buf)) else None


class ShardListener:
    """Serves a shard's experts to every connection on a port of this node, a thread per connection."""

    def __init__(self, compute: Compute, layers: set[int], width: int, n_experts: int, wire_dtype: np.dtype,
                 host: str = "0.0.0.0"):
        self.compute, self.layers, self.width, self.n_experts = compute, layers, width, n_experts
        self.dtype = np.dtype(wire_dtype)
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, name="moeserve-shard-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="moeserve-shard-exchange", daemon=True).start()

    def _refusal(self, magic: bytes, layer: int, rows: int, width: int, n: int) -> str | None:
        if magic != REQUEST_MAGIC:
            return "not a moeserve expert exchange"
        if layer not in self.layers:
            return f"layer {layer} has no experts on this shard (MoE layers {sorted(self.layers)})"
        if width != self.width or n != self.n_experts or rows > MAX_ROWS:
            return (f"{rows} rows of width {width} for {n} experts: this shard takes up to {MAX_ROWS} rows of "
                    f"width {self.width} for its {self.n_experts} experts")
        return None

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while (head := recv_bytes(conn, REQUEST.size)) is not None:
                    magic, layer, rows, width, n = REQUEST.unpack(head)
                    if (refusal := self._refusal(magic, layer, rows, width, n)) is not None:
                        self._answer(conn, refusal)
                        return  # the stream cannot be trusted past a bad header
                    counts = np.empty(n, "<i8")
                    x = np.empty((rows, width), self.dtype)
                    if not (recv_into(conn, raw(counts)) and recv_into(conn, raw(x))):
                        return
                    if int(counts.sum()) != rows or counts.min(initial=0) < 0:
                        self._answer(conn, f"counts {counts.tolist()} do not add up to {rows} rows")
                        return
                    t0 = time.perf_counter()
                    try:
                        y = np.ascontiguousarray(self.compute(layer, x, counts.tolist()))
                    except Exception as e:  # answered, and the shard's health check reports it (ray_app)
                        self._answer(conn, f"{type(e).__name__}: {e}")
                        continue
                    send_parts(conn, [ANSWER.pack(ANSWER_MAGIC, 1, y.nbytes, time.perf_counter() - t0), y])
            except (OSError, ExchangeError):  # the ingress went away mid-exchange
                return

    @staticmethod
    def _answer(conn: socket.socket, error: str) -> None:
        text = error.encode()
        send_parts(conn, [ANSWER.pack(ANSWER_MAGIC, 0, len(text), 0.0), text])

    def close(self) -> None:
        self.server.close()


class ShardConnections:
    """The ingress's side: one connection per shard, every shard sent its rows before any answer is read."""

    def __init__(self, addresses: list[tuple[str, int]], timeout_s: float):
        self.timeout_s = timeout_s
        self.socks: list[socket.socket] = []
        try:
            for address in addresses:
                sock = socket.create_connection(address, timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.socks.append(sock)
        except OSError:
            self.close()
            raise

    def __call__(self, layer: int, inputs: list[tuple[np.ndarray, list[int]]]) -> list[tuple[np.ndarray, float | None]]:
        """Each shard's (rows, seconds it computed) for its (rows, counts); a shard with no rows is not asked
        (its seconds: None).
        ExchangeError or TimeoutError if any shard fails, after which these connections are not to be used
        again (a late answer would be read as the next one's)."""
        deadline = time.monotonic() + self.timeout_s
        asked = [s for s, (x, _) in enumerate(inputs) if x.shape[0]]
        for s in asked:
            x, counts = inputs[s]
            self.socks[s].settimeout(self.timeout_s)
            head = REQUEST.pack(REQUEST_MAGIC, layer, x.shape[0], x.shape[1], len(counts))
            send_parts(self.socks[s], [head, np.asarray(counts, "<i8"), x])
        answers: list[tuple[np.ndarray, float | None]] = [(x, None) for x, _ in inputs]  # no rows in, none out
        for s in asked:
            answers[s] = self._answer(s, inputs[s][0], deadline)
        return answers

    def _answer(self, s: int, x: np.ndarray, deadline: float) -> tuple[np.ndarray, float]:
        sock = self.socks[s]
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        head = recv_bytes(sock, ANSWER.size)
        if head is None:
            raise ExchangeError(f"expert shard {s} closed the connection")
        magic, ok, nbytes, seconds = ANSWER.unpack(head)
        if magic != ANSWER_MAGIC or (ok and nbytes != x.nbytes) or (not ok and nbytes > 1 << 16):
            raise ExchangeError(f"expert shard {s} answered out of protocol")
        if not ok:
            text = recv_bytes(sock, nbytes) or b"(no reason given)"
            raise ExchangeError(f"expert shard {s}: {text.decode(errors='replace')}")
        y = np.empty_like(x)
        if not recv_into(sock, raw(y)):
            raise ExchangeError(f"expert shard {s} closed the connection")
        return y, seconds

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []
