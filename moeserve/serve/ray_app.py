"""`moeserve serve CKPT --ray --expert-shards S`: the server as a Ray Serve application whose experts
live in other processes.

    HTTP -> Ray Serve proxy -> Ingress replica: the same FastAPI app (create_app), the step engine,
            and the dense model (embeddings, attention, norms, routers, heads)
         -> per MoE layer and forward pass: dispatch (experts.py) -> one call per shard, all at once
            -> ExpertShardServer s: experts [s*E/S, (s+1)*E/S) of every MoE layer -> combine

A shard loads only its experts' rows of each stacked expert tensor (checkpoint.load_expert_slice, with
safetensors' slices) and the ingress loads everything else (load_model with an experts factory), so no
process holds all the experts. A shard is called as `shard(x_ND, counts) -> y_ND` on its own
experts' rows (runtime/expert_shards.py), the same seam that the in-process shards are tested through;
every router (softmax, sigmoid, xmoe, vq mixed and discrete) reaches the experts through it.

The model runs on its own thread in the ingress replica (serve/state.py), so its blocking waits on
the shards' answers never block the replica's event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from torch import Tensor

from moeserve.checkpoint import load_expert_slice, read_config
from moeserve.errors import UserError
from moeserve.ray_cluster import connect
from moeserve.runtime.engine import DTYPES, Engine, resolve_device, resolve_dtype
from moeserve.runtime.backends.expert_shards import ExpertShard, ShardedExperts, contiguous_ranges
from moeserve.serve.app import create_app
from moeserve.serve import ray_metrics
from moeserve.serve.batcher import BatchConfig, Unavailable
from moeserve.serve.config import RayServeOptions
from moeserve.serve.metrics import Metrics
from moeserve.serve.shard_socket import ShardConnections, ShardListener, from_wire, to_wire
from moeserve.serve.state import ServeConfig


def shard_ranges(n_experts: int, n_shards: int) -> list[range]:
    """Shard s holds experts [s*E/S, (s+1)*E/S) of every MoE layer (expert_shards.contiguous_ranges)."""
    if not 1 <= n_shards <= n_experts:
        raise UserError(f"--expert-shards {n_shards}: expected 1..{n_experts} (the model's experts)")
    return contiguous_ranges(n_experts, n_shards)


@serve.deployment(name="experts")
class ExpertShardServer:
    """Experts `start..stop-1` of every MoE layer of a checkpoint, computed for the ingress."""

    def __init__(self, checkpoint: str, start: int, stop: int, dtype: str = "float32"):
        self.dtype = DTYPES[dtype]
        # a GPU where Ray gave this replica one (--gpus-per-shard), else the CPU
        self.device = torch.device("cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu")
        cfg, tensors = load_expert_slice(checkpoint, start, stop, dtype=self.dtype)
        ids = list(range(start, stop))
        w = {k: t.to(self.device) for k, t in tensors.items()}
        self.layers = {i: ExpertShard(ids, w[f"layers.{i}.ffn.experts.w1"], w[f"layers.{i}.ffn.experts.w2"],
                                      w.get(f"layers.{i}.ffn.experts.w3"))
                       for i in cfg.moe_layer_ids}
        for shard in self.layers.values():
            shard.prepare_inference()

        self.last_error: str | None = None
        self.listener: ShardListener | None = None

    def compute(self, layer: int, x: np.ndarray, counts: list[int]) -> np.ndarray:
        """The rows of this shard's experts for `x`, its rows of them in expert order."""
        try:
            with torch.inference_mode():
                y = to_wire(self.layers[layer](from_wire(x, self.dtype).to(self.device), counts))
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            raise
        self.last_error = None
        return y

    def forward(self, layer: int, x: np.ndarray, counts: list[int]) -> tuple[np.ndarray, float]:
        """The rows, and the seconds it took to compute them (for the metrics)."""
        t0 = time.perf_counter()
        y = self.compute(layer, x, counts)
        return y, time.perf_counter() - t0

    def listen(self) -> tuple[str, int]:
        """Serve exchanges over a socket too (`--exchange sockets`); the address to connect to."""
        if self.listener is None:
            any_layer = next(iter(self.layers.values()))
            self.listener = ShardListener(self.compute, set(self.layers), any_layer.w1.shape[-1],
                                          len(any_layer.expert_ids), to_wire(torch.empty(0, dtype=self.dtype)).dtype)
        return ray.util.get_node_ip_address(), self.listener.port

    def parameter_count(self) -> int:
        return sum(p.numel() for shard in self.layers.values() for p in shard.parameters())

    def placement(self) -> dict:
        """Where this replica computes: its device, the GPUs Ray gave it (a fraction of one is still its id), and the
        weights it holds."""
        return {"device": self.device.type, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "parameters": self.parameter_count()}

    def check_health(self) -> None:
        """Serve replaces a replica whose check fails: no weights, or its last exchange failed."""
        if not self.layers:
            raise RuntimeError("no expert weights loaded")
        if self.last_error is not None:
            raise RuntimeError(f"the last exchange failed ({self.last_error})")


class ShardActors:
    """Every shard as a Ray actor owned by the ingress, asked per exchange with (layer, its rows, counts),
    in one of three ways (`moeserve bench shards` times each; one token's rows, 2 shards, 2 cores, three runs:
    0.6-0.8, 1.3-2.0 and 2.6-4.1 ms):
    - `sockets` (the default): a TCP connection to each actor (shard_socket.py); nothing spins while idle.
    - `compiled`: behind one Ray Compiled Graph, whose channels are set up once, so an exchange submits no
      task, but each shard actor then spins on its input channel, a whole core per shard while idle.
    - `actors`: plain `actor.forward.remote` calls, a task submitted per shard per exchange.

    The actors share the ingress's fate (Serve restarts the ingress, which makes them again); one that dies
    is restarted by Ray, and the connections or graph made again at the next exchange once it is back."""

    def __init__(self, checkpoint: str, ranges: list[range], dtype: str, cpus: float, gpus: float, timeout_s: float,
                 exchange: str = "sockets"):
        actor = ray.remote(ExpertShardServer.func_or_class)
        self.actors = [actor.options(name=f"{APP_NAME}-experts-{s}", namespace=APP_NAME, num_cpus=cpus, num_gpus=gpus,
                                     max_restarts=-1, max_task_retries=0)
                       .remote(checkpoint, r.start, r.stop, dtype) for s, r in enumerate(ranges)]
        self.timeout_s, self.exchange = timeout_s, exchange
        self.graph, self.connections = None, None
        ray.get([a.check_health.remote() for a in self.actors], timeout=600)  # loaded, or the error that stopped one
        if exchange == "compiled":
            self._compile()

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            self.graph = MultiOutputNode([a.forward.bind(inp[0], inp[1 + 2 * s], inp[2 + 2 * s])
                                          for s, a in enumerate(self.actors)]).experimental_compile()

    def __call__(self, layer: int, inputs: list[tuple[Tensor, list[int]]]) -> list[tuple[np.ndarray, float | None]]:
        """Each shard's rows and compute seconds (None: not asked, having no rows); Unavailable if any fails."""
        try:
            if self.exchange == "sockets":
                if self.connections is None:
                    addresses = ray.get([a.listen.remote() for a in self.actors], timeout=self.timeout_s)
                    self.connections = ShardConnections(addresses, self.timeout_s)
                return self.connections(layer, [(to_wire(x), counts) for x, counts in inputs])
            if self.exchange == "actors":
                calls = [a.forward.remote(layer, to_wire(x), counts) for a, (x, counts) in zip(self.actors, inputs)]
                return ray.get(calls, timeout=self.timeout_s)
            flat = [v for x, counts in inputs for v in (to_wire(x), counts)]
            if self.graph is None:
                ray.get([a.check_health.remote() for a in self.actors], timeout=self.timeout_s)
                self._compile()
            return ray.get(self.graph.execute(layer, *flat), timeout=self.timeout_s)
        except Exception as e:  # an actor died or will not answer: its graph or connections are remade next time
            self.teardown()
            raise Unavailable(f"an expert shard is not answering ({type(e).__name__})") from None

    def parameter_counts(self) -> list[int]:
        return ray.get([a.parameter_count.remote() for a in self.actors])

    def teardown(self) -> None:
        connections, self.connections = self.connections, None
        if connections is not None:
            connections.close()
        graph, self.graph = self.graph, None
        if graph is not None:
            with contextlib.suppress(Exception):
                graph.teardown()


# (wall s, compute s or None where the shard was not asked, rows) per shard
ExchangeObserver = Callable[[list[float], list[float | None], list[int]], None]


class RemoteExperts(ShardedExperts):
    """One MoE layer's experts on shard deployments: each shard gets only its experts' rows, all shards
    are asked at once, and the answers are combined here with the gates. `observe` hears of every exchange
    (Metrics.observe_exchange)."""

    def __init__(self, layer_id: int, n_experts: int, handles: "list | ShardActors", ranges: list[range],
                 dtype: torch.dtype, timeout_s: float = 10.0, observe: ExchangeObserver | None = None):
        super().__init__(n_experts, [None] * len(ranges), [list(r) for r in ranges])
        self.layer_id, self.handles, self.wire_dtype, self.timeout_s = layer_id, handles, dtype, timeout_s
        self.observe = observe

    def run_shards(self, inputs: list[tuple[Tensor, list[int]]]) -> list[Tensor]:
        t0 = time.perf_counter()
        if isinstance(self.handles, ShardActors):  # every answer is read at once (one ray.get)
            answers = self.handles(self.layer_id, inputs)
            walls = [time.perf_counter() - t0] * len(answers)
        else:
            answers, walls = self._through_handles(inputs, t0)
        if self.observe is not None:
            self.observe(walls, [seconds for _, seconds in answers], [sum(counts) for _, counts in inputs])
        return [from_wire(y, self.wire_dtype).to(x.device) for (y, _), (x, _) in zip(answers, inputs)]

    def _through_handles(self, inputs: list[tuple[Tensor, list[int]]], t0: float) -> tuple[list, list[float]]:
        """Every shard asked at once; a call whose replica died is sent again (Serve routes it to a live
        replica, or waits for the replacement) until `timeout_s` from the first try, then Unavailable."""
        deadline = time.monotonic() + self.timeout_s
        wires = [to_wire(x) for x, _ in inputs]
        calls = [h.forward.remote(self.layer_id, w, counts) for h, w, (_, counts) in zip(self.handles, wires, inputs)]
        out, walls = [], []
        for s, (call, w, (x, counts)) in enumerate(zip(calls, wires, inputs)):
            while True:
                try:
                    y = call.result(timeout_s=max(0.0, deadline - time.monotonic()))
                    break
                except (RayActorError, ActorUnavailableError) as e:  # the replica died with the call
                    if time.monotonic() >= deadline:
                        raise Unavailable(f"expert shard {s} is not answering ({type(e).__name__})") from None
                    call = self.handles[s].forward.remote(self.layer_id, w, counts)
                except TimeoutError:
                    call.cancel()
                    raise Unavailable(f"expert shard {s} did not answer within {self.timeout_s:g} s") from None
            out.append(y)
            walls.append(time.perf_counter() - t0)
        return out, walls


@serve.ingress()
class Ingress:
    """The FastAPI app of the single-process server, with a model whose experts are the shards."""

    def __init__(self, checkpoint: str, shards: "list | RayServeOptions", serve_cfg: ServeConfig, dtype: str,
                 device: str, shard_timeout_s: float = 10.0):
        """`shards`: the shard deployments' handles (exchange "handles"), or the options the ingress makes
        its shard actors with (every other exchange)."""
        self.checkpoint, self.shards, self.serve_cfg = checkpoint, shards, serve_cfg
        self.dtype, self.device, self.shard_timeout_s = dtype, device, shard_timeout_s
        self.exchange: ShardActors | None = None

    def __serve_build_asgi_app__(self):
        # the series go to Ray's metrics too: one scrape of Ray's export sees every replica (ray_metrics.py)
        self.metrics = Metrics(twins=ray_metrics.twin)
        self.copier = ray_metrics.ScrapeTimeCopier(self.metrics).start()
        return create_app(self._load, self.serve_cfg, self.metrics)

    def _load(self) -> Engine:
        cfg = read_config(self.checkpoint)
        dt = resolve_dtype(self.dtype, resolve_device(self.device))
        shards = self.shards
        if isinstance(shards, RayServeOptions):
            ranges = shard_ranges(cfg.n_experts, shards.expert_shards)
            shards = self.exchange = ShardActors(self.checkpoint, ranges, self.dtype, shards.cpus_per_shard,
                                                 shards.gpus_per_shard, self.shard_timeout_s,
                                                 exchange=shards.exchange)
        else:
            ranges = shard_ranges(cfg.n_experts, len(shards))
        self.metrics.watch_shards(len(ranges))

        def experts(layer_id: int) -> RemoteExperts:
            return RemoteExperts(layer_id, cfg.n_experts, shards, ranges, dt, self.shard_timeout_s,
                                 observe=self.metrics.observe_exchange)

        # the dense layers as the plan measured for this model's shapes on this machine lays them out (cached, the
        # single-process server's plan; its expert choices do not apply here): the C kernel where it beat torch
        self.engine = Engine.load(self.checkpoint, dtype=self.dtype, device=self.device, experts_factory=experts,
                                  compile="off")
        return self.engine

    def parameter_count(self) -> int:
        """The weights this replica holds (the dense part: no expert's)."""
        return sum(p.numel() for p in self.engine.model.parameters())

    def shard_parameter_counts(self) -> list[int]:
        """The weights each of this ingress's shard actors holds (every exchange but "handles")."""
        return self.exchange.parameter_counts()

    def __del__(self):
        if getattr(self, "copier", None) is not None:
            self.copier.stop()
        if self.exchange is not None:
            self.exchange.teardown()


APP_NAME = "moeserve"


def build_app(checkpoint: str | Path, serve_cfg: ServeConfig, opts: RayServeOptions, *, dtype: str = "float32",
              device: str = "cpu"):
    """The bound application: S shard deployments and the ingress that holds their handles."""
    checkpoint = str(Path(checkpoint).absolute())
    cfg = read_config(checkpoint)
    ranges = shard_ranges(cfg.n_experts, opts.expert_shards)
    opts = opts.fitted(math.inf)  # unset: one CPU each (run() fits them to the cluster first)
    # one dtype for the ingress and every shard, resolved here: the rows cross the wire in it
    dtype = str(resolve_dtype(dtype, torch.device("cuda" if opts.ingress_gpus else "cpu"))).removeprefix("torch.")
    shards = opts if opts.exchange != "handles" else [
        ExpertShardServer.options(name=f"experts-{s}", num_replicas=opts.shard_replicas,
                                  ray_actor_options={"num_cpus": opts.cpus_per_shard, "num_gpus": opts.gpus_per_shard})
        .bind(checkpoint, r.start, r.stop, dtype)
        for s, r in enumerate(ranges)]
    ingress = serve.deployment(Ingress, name="ingress", max_ongoing_requests=ingress_max_ongoing(serve_cfg),
                               ray_actor_options={"num_cpus": opts.ingress_cpus, "num_gpus": opts.ingress_gpus})
    return ingress.bind(checkpoint, shards, serve_cfg, dtype, device, opts.shard_timeout_s)


def ingress_max_ongoing(serve_cfg: ServeConfig) -> int:
    """Requests Serve lets into the ingress replica at once: all that its own queue, its running batch or cache
    slots, and probes can hold. Serve's default (5) kept all but 5 requests waiting in Ray's proxy: cache slots
    idle, the time to first token spent before the app saw the request, and no 429 from the app's queue bound,
    ever (docs/design-notes.md)."""
    b = serve_cfg.batch
    return b.max_queue + max(serve_cfg.kv_slots, b.max_batch_size) + 32


def app_builder(args: dict):
    """The application from a Ray Serve config's `args` (what `--print-config` writes), for `serve deploy`."""
    serve_args = dict(args.get("serve") or {})
    batch = BatchConfig(**serve_args.pop("batch", {}))
    if serve_args.get("chat_template"):
        serve_args["chat_template"] = Path(serve_args["chat_template"])
    return build_app(args["checkpoint"], ServeConfig(**serve_args, batch=batch),
                     RayServeOptions(**(args.get("options") or {})), dtype=args.get("dtype", "float32"),
                     device=args.get("device", "cpu"))


def deploy_config(checkpoint: str | Path, serve_cfg: ServeConfig, opts: RayServeOptions, *, dtype: str,
                  device: str) -> dict:
    """A Ray Serve config file (`serve deploy`'s schema) for this application on a cluster: one entry per
    deployment, so replicas and resources can be edited there. The API key is not written: give the
    ingress $MOESERVE_API_KEY through its runtime_env."""
    checkpoint = str(Path(checkpoint).absolute())
    cfg = read_config(checkpoint)
    opts = opts.fitted(math.inf)  # unset: one CPU each, for a cluster planned around the file
    served = dataclasses.asdict(serve_cfg)
    served.update(api_key=None, chat_template=str(serve_cfg.chat_template) if serve_cfg.chat_template else None)
    shards = [] if opts.exchange != "handles" else [  # otherwise the ingress makes its shard actors itself
        {"name": f"experts-{s}", "num_replicas": opts.shard_replicas,
         "ray_actor_options": {"num_cpus": opts.cpus_per_shard, "num_gpus": opts.gpus_per_shard}}
        for s in range(len(shard_ranges(cfg.n_experts, opts.expert_shards)))]
    ingress = {"name": "ingress", "num_replicas": 1, "max_ongoing_requests": ingress_max_ongoing(serve_cfg),
               "ray_actor_options": {"num_cpus": opts.ingress_cpus, "num_gpus": opts.ingress_gpus}}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": serve_cfg.host, "port": serve_cfg.port},
        "applications": [{
            "name": APP_NAME, "route_prefix": "/", "import_path": "moeserve.serve.ray_app:app_builder",
            "args": {"checkpoint": checkpoint, "dtype": dtype, "device": device,
                     "options": dataclasses.asdict(opts), "serve": served},
            "deployments": [ingress, *shards],
        }],
    }


def run(checkpoint: str | Path, serve_cfg: ServeConfig, opts: RayServeOptions, *, dtype: str = "float32",
        device: str = "cpu", ready_timeout_s: float = 600.0, access_log: bool = True, log_level: str = "info") -> int:
    """`moeserve serve --ray`: deploy on the cluster ($RAY_ADDRESS, else a local Ray), say when it is ready,
    and serve until SIGTERM or Ctrl-C; then delete the application. 1 if the model failed to load.
    `access_log`, `log_level`: the replicas' (Serve's logging config), as uvicorn's are in one process."""
    ray = connect()
    resources = ray.cluster_resources()
    opts = opts.fitted(resources.get("CPU", 0))
    try:
        opts.check_fits(resources.get("CPU", 0), resources.get("GPU", 0))
    except ValueError:
        ray.shutdown()
        raise
    what = f"{opts.expert_shards} expert shard(s) x {opts.shard_replicas} replica(s)"
    return serve_until_stopped(lambda: build_app(checkpoint, serve_cfg, opts, dtype=dtype, device=device),
                               serve_cfg, what, Path(checkpoint).name, ready_timeout_s, access_log, log_level)


def serve_until_stopped(build: Callable[[], object], serve_cfg: ServeConfig, what: str, name: str,
                        ready_timeout_s: float = 600.0, access_log: bool = True, log_level: str = "info") -> int:
    """Run the application `build()` makes on the Ray this process joined, say when it is ready, serve until SIGTERM
    or Ctrl-C, then delete it and leave Ray. 1 if it never became ready."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": serve_cfg.host, "port": serve_cfg.port})
        serve.run(build(), name=APP_NAME, route_prefix="/", blocking=False,
                  logging_config={"log_level": log_level.upper(), "enable_access_log": access_log})
        host = "127.0.0.1" if serve_cfg.host in ("0.0.0.0", "::") else serve_cfg.host
        url, deadline = f"http://{host}:{serve_cfg.port}", time.monotonic() + ready_timeout_s
        while not stop.wait(0.5):
            status = _readiness(url)
            if status == "ready":
                print(f"moeserve: {serve_cfg.model_name or name} is ready on {url} (Ray Serve, {what})",
                      file=sys.stderr)
                break
            if status == "failed" or time.monotonic() > deadline:
                print(f"moeserve serve: error: the model did not load ({status}); see the replica logs "
                      f"(ray logs, or /tmp/ray/session_latest/logs)", file=sys.stderr)
                return 1
        stop.wait()
        return 0
    finally:
        # deleting the application drains its replicas (each app's lifespan lets requests in flight finish);
        # bounded, for a Ray whose processes the same signal already stopped (Ctrl-C reaches the process group)
        deleting = threading.Thread(target=_delete_app, daemon=True)
        deleting.start()
        deleting.join(serve_cfg.shutdown_timeout_s + 15)
        ray.shutdown()


def _delete_app() -> None:
    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)


def _readiness(url: str) -> str:
    """/readyz's status: ready, loading, failed; starting while nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
            return json.loads(r.read()).get("status", "starting")
    except urllib.error.HTTPError as e:  # 503: loading, failed or draining
        with contextlib.suppress(ValueError):
            return json.loads(e.read()).get("status", "starting")
        return "starting"
    except (OSError, ValueError):
        return "starting"
