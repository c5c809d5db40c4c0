"""The serving stack's own ceiling on this machine: a model-free OpenAI completions stub, streamed the way moeserve
streams, served (a) by uvicorn in one process and (b) by Ray Serve (its HTTP proxy in front of one FastAPI ingress
replica, as `moeserve serve --ray` deploys it), under `moeserve bench serve`'s closed loop.

The stub's "model" costs no CPU: each token is an `asyncio.sleep(--itl-ms)`. So whatever req/s a server reaches here
is the most any model behind that stack can reach on this machine: issue 38's goal for expert parallelism on two
cores (within 1.5x of one process) cannot be met by a design whose stack alone is slower than that
(docs/bench/log.md, "The serving stack's ceiling on two cores").

    PYTHONPATH=. python docs/bench/serve-floor.py [--clients 8 32] [--duration 10] [--rounds 2] [--itl-ms 4]
        [--tokens 32] [--ingress-cpus 0.5]

Prints one line per server, round and level: req/s, p50 ms, ITL p50 ms, errors, and each process's CPU seconds over
the level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def stub_app(itl_s: float) -> FastAPI:
    """/v1/models and /v1/completions; a streamed completion is exactly max_tokens text chunks, `itl_s` apart, then
    a usage chunk and [DONE], as the OpenAI API and moeserve send them."""
    app = FastAPI()

    @app.get("/readyz")
    def readyz():
        return {"status": "ready"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "moeserve"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt_tokens, n = max(1, len(body.get("prompt", "")) // 4), int(body.get("max_tokens", 16))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-stub", "object": "text_completion", "model": "stub", "usage": usage,
                                 "choices": [{"index": 0, "text": " a" * n, "finish_reason": "length"}]})

        async def events():
            for i in range(n):
                await asyncio.sleep(itl_s)
                chunk = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
                         "choices": [{"index": 0, "text": " a", "logprobs": None,
                                      "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'id': 'cmpl-stub', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve_uvicorn(port: int, itl_s: float) -> None:
    import uvicorn

    uvicorn.run(stub_app(itl_s), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_ray(port: int, itl_s: float, ingress_cpus: float) -> None:
    import ray
    from ray import serve

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    app = stub_app(itl_s)

    @serve.deployment(num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": ingress_cpus})
    @serve.ingress(app)
    class Stub:
        pass

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Stub.bind(), name="stub", route_prefix="/")
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds of every process of this user, by command line (the Ray workers are named by what they run)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
        except OSError:
            continue
        out[f"{pid} {cmd}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    p.add_argument("--duration", type=float, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--itl-ms", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--ingress-cpus", type=float, default=0.5)
    p.add_argument("--server", choices=["uvicorn", "ray"], help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.server == "uvicorn":
        serve_uvicorn(a.port, a.itl_ms / 1000)
        return 0
    if a.server == "ray":
        serve_ray(a.port, a.itl_ms / 1000, a.ingress_cpus)
        return 0

    from moeserve.bench.serve import ServeBenchConfig, bench_serve
    from moeserve.bench.server_process import free_port, wait_ready

    for rnd in range(a.rounds):
        servers = ["uvicorn", "ray"] if rnd % 2 == 0 else ["ray", "uvicorn"]
        for server in servers:
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--server", server, "--port", str(port), "--itl-ms",
                                     str(a.itl_ms), "--ingress-cpus", str(a.ingress_cpus)], start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_ready(proc, url)
                time.sleep(3)  # Serve's replicas settle
                for c in a.clients:
                    before = cpu_seconds()
                    cfg = ServeBenchConfig(url=url, concurrency=(c,), duration_s=a.duration, input_len=(32, 32),
                                           output_len=(a.tokens, a.tokens), timeout_s=120)
                    lv = bench_serve(cfg)["levels"][0]
                    after = cpu_seconds()
                    used = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
                    busy = ", ".join(f"{s:.1f} s {k.split(' ', 1)[1][:40]}" for s, k in used[:5] if s >= 0.2)
                    print(f"round {rnd} {server:8s} {c:3d} clients: {lv['requests_per_s']:.1f} req/s, p50 "
                          f"{lv['e2e_ms']['p50']:.0f} ms, ITL p50 {lv['itl_ms']['p50']:.1f} ms, errors "
                          f"{lv['errors']} | CPU: {busy}", flush=True)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(timeout=60)
                if server == "ray":
                    subprocess.run(["ray", "stop", "--force"], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
