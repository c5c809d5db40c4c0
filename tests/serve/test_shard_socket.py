"""The socket exchange with an expert shard (serve/shard_socket.py), over real loopback sockets, no Ray: the
rows that come back are the shard's own computation, a shard with no rows is not asked, bad headers and
failures are answered by name, and a broken or stalled exchange fails the caller instead of hanging it."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from moeserve.runtime.backends.expert_shards import ExpertShard
from moeserve.serve.shard_socket import (ANSWER, MAX_ROWS, REQUEST, REQUEST_MAGIC, ExchangeError, ShardConnections,
                                         ShardListener, from_wire, recv_bytes, to_wire)

D, F = 16, 24
LAYERS = {1, 3}


def shard(ids: list[int], seed: int = 0, dtype=torch.float32) -> ExpertShard:
    g = torch.Generator().manual_seed(seed)
    E = len(ids)
    return ExpertShard(ids, torch.randn(E, F, D, generator=g, dtype=dtype), torch.randn(E, D, F, generator=g,
                       dtype=dtype), torch.randn(E, F, D, generator=g, dtype=dtype))


class Served:
    """An ExpertShard behind a listener, as the shard actor serves it; `calls` counts what it computed."""

    def __init__(self, experts: ExpertShard, dtype=torch.float32, compute=None):
        self.experts, self.dtype, self.calls = experts, dtype, []
        self.listener = ShardListener(compute or self.compute, LAYERS, D, len(experts.expert_ids),
                                      to_wire(torch.empty(0, dtype=dtype)).dtype, host="127.0.0.1")
        self.address = ("127.0.0.1", self.listener.port)

    def compute(self, layer: int, x: np.ndarray, counts: list[int]) -> np.ndarray:
        self.calls.append((layer, counts))
        with torch.inference_mode():
            return to_wire(self.experts(from_wire(x, self.dtype), counts))


@pytest.fixture
def two_shards():
    shards = [Served(shard([0, 1], seed=0)), Served(shard([2, 3], seed=1))]
    yield shards
    for s in shards:
        s.listener.close()


def test_the_rows_come_back_as_each_shard_computes_them_and_a_shard_without_rows_is_not_asked(two_shards):
    conns = ShardConnections([s.address for s in two_shards], timeout_s=10)
    try:
        torch.manual_seed(0)
        for counts in ([[2, 1], [0, 3]], [[5, 0], [1, 1]], [[1, 0], [0, 0]], [[0, 0], [0, 0]]):
            xs = [torch.randn(sum(c), D) for c in counts]
            answers = conns(3, [(to_wire(x), c) for x, c in zip(xs, counts)])
            for s, (x, c, (y, seconds)) in enumerate(zip(xs, counts, answers)):
                with torch.inference_mode():
                    want = two_shards[s].experts(x, c)  # the same module, here (on another thread there)
                torch.testing.assert_close(from_wire(y, torch.float32), want, atol=1e-5, rtol=1e-5)
                assert (seconds is None) == (sum(c) == 0)
        assert [s.calls for s in two_shards] == [[(3, [2, 1]), (3, [5, 0]), (3, [1, 0])], [(3, [0, 3]), (3, [1, 1])]]
    finally:
        conns.close()


def test_bf16_rows_travel_as_their_bits():
    served = Served(shard([0, 1], dtype=torch.bfloat16), dtype=torch.bfloat16)
    conns = ShardConnections([served.address], timeout_s=10)
    try:
        x = torch.randn(3, D, dtype=torch.bfloat16)
        (y, _), = conns(1, [(to_wire(x), [1, 2])])
        with torch.inference_mode():
            torch.testing.assert_close(from_wire(y, torch.bfloat16), served.experts(x, [1, 2]))
    finally:
        conns.close()
        served.listener.close()


def raw_exchange(address, head: bytes, body: bytes = b"") -> tuple[tuple, bytes, bool]:
    """Send a hand-made request; the answer's header, its payload, and whether the shard then closed."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(head + body)
        magic, ok, nbytes, seconds = ANSWER.unpack(recv_bytes(sock, ANSWER.size))
        payload = recv_bytes(sock, nbytes) if nbytes else b""
        closed = sock.recv(1) == b""
    return (magic, ok, nbytes), payload, closed


@pytest.mark.parametrize("head, why", [
    (REQUEST.pack(b"GET ", 1, 2, D, 2), "not a moeserve expert exchange"),
    (REQUEST.pack(REQUEST_MAGIC, 2, 2, D, 2), "layer 2 has no experts on this shard (MoE layers [1, 3])"),
    (REQUEST.pack(REQUEST_MAGIC, 1, 2, D + 1, 2), f"2 rows of width {D + 1} for 2 experts: this shard takes"),
    (REQUEST.pack(REQUEST_MAGIC, 1, 2, D, 3), "2 rows of width 16 for 3 experts: this shard takes"),
    (REQUEST.pack(REQUEST_MAGIC, 1, MAX_ROWS + 1, D, 2), f"{MAX_ROWS + 1} rows of width 16"),
])
def test_a_bad_header_is_answered_by_name_before_any_row_is_read_and_the_connection_closed(two_shards, head, why):
    (_, ok, _), text, closed = raw_exchange(two_shards[0].address, head)
    assert (ok, closed) == (0, True) and text.decode().startswith(why), text
    assert two_shards[0].calls == []
    # and the shard serves the next connection as before
    conns = ShardConnections([two_shards[0].address], timeout_s=5)
    (y, _), = conns(1, [(to_wire(torch.ones(1, D)), [1, 0])])
    conns.close()
    assert y.shape == (1, D)


def test_counts_that_do_not_add_up_are_refused(two_shards):
    body = np.asarray([1, 2], "<i8").tobytes() + np.zeros((2, D), np.float32).tobytes()
    (_, ok, _), text, closed = raw_exchange(two_shards[0].address, REQUEST.pack(REQUEST_MAGIC, 1, 2, D, 2), body)
    assert (ok, closed, text) == (0, True, b"counts [1, 2] do not add up to 2 rows")
    assert two_shards[0].calls == []


def test_a_failed_computation_is_the_callers_named_error_and_the_shard_goes_on():
    def compute(layer, x, counts):
        if counts[0] == 7:
            raise RuntimeError("out of memory, say")
        return x * 2
    served = Served(shard([0, 1]), compute=compute)
    conns = ShardConnections([served.address], timeout_s=5)
    try:
        with pytest.raises(ExchangeError, match=r"^expert shard 0: RuntimeError: out of memory, say$"):
            conns(1, [(np.ones((7, D), np.float32), [7, 0])])
        (y, _), = conns(1, [(np.ones((2, D), np.float32), [1, 1])])  # the same connection, still in step
        assert (y == 2).all()
    finally:
        conns.close()
        served.listener.close()


def test_a_stalled_shard_times_the_exchange_out_and_a_dead_one_fails_it():
    release = threading.Event()

    def stall(layer, x, counts):
        release.wait(10)
        return x
    served = Served(shard([0, 1]), compute=stall)
    conns = ShardConnections([served.address], timeout_s=0.5)
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        conns(1, [(np.ones((1, D), np.float32), [1, 0])])
    assert time.monotonic() - t < 3
    release.set()
    conns.close()

    # a shard whose process dies: its connection closes under the caller
    server = socket.create_server(("127.0.0.1", 0))

    def die():  # reads the whole request (so that closing sends a FIN, not a reset), then goes
        conn, _ = server.accept()
        recv_bytes(conn, REQUEST.size + 2 * 8 + D * 4)
        conn.close()
    threading.Thread(target=die, daemon=True).start()
    conns = ShardConnections([server.getsockname()], timeout_s=5)
    with pytest.raises(ExchangeError, match="expert shard 0 closed the connection"):
        conns(1, [(np.ones((1, D), np.float32), [1, 0])])
    conns.close()
    server.close()
    served.listener.close()


def test_a_caller_gone_mid_request_leaves_the_shard_serving(two_shards):
    with socket.create_connection(two_shards[1].address) as sock:
        sock.sendall(REQUEST.pack(REQUEST_MAGIC, 1, 4, D, 2)[:10])  # half a header, then gone
    with socket.create_connection(two_shards[1].address) as sock:
        sock.sendall(REQUEST.pack(REQUEST_MAGIC, 1, 4, D, 2) + np.asarray([2, 2], "<i8").tobytes() + b"\0" * 64)
    conns = ShardConnections([two_shards[1].address], timeout_s=5)
    (y, seconds), = conns(3, [(np.zeros((2, D), np.float32), [0, 2])])
    conns.close()
    assert y.shape == (2, D) and seconds is not None
    assert two_shards[1].calls == [(3, [0, 2])]
