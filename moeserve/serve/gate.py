"""The gate: pure ASGI middleware in front of every request, before FastAPI parses anything.

It times each request for the metrics (to the last byte sent, streams included), and refuses at once
/v1/ calls (and the profiler's) without the bearer token (401), POST bodies that are not application/json
(415) and bodies over the limit (413), and model requests that would be refused whatever their body says (503 while
loading or shutting down, 429 when the queue is full) before reading the body. A request let through
holds a place in the queue from then until its handler submits it (or it fails and gives the place
back): under a burst, only as many requests get past the gate as the queue has room for, and none is
parsed and tokenised only to be refused. The body is read here, bounded in size and in time (408 when
a part is slower than the read timeout), and handed on: the size check is then the same whether or not
the client sent a Content-Length, and no parser ever sees an oversize body.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi.responses import JSONResponse

from moeserve.serve.protocol import ApiError
from moeserve.serve.state import PLACE, ServerState

POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/classify")
PROFILE_ROUTES = ("/start_profile", "/stop_profile")  # --profile-dir: behind the bearer token, as /v1/* is
ENDPOINTS = frozenset(POST_ROUTES + PROFILE_ROUTES + ("/v1/models", "/healthz", "/readyz", "/metrics"))  # labels


class Gate:
    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, path = time.perf_counter(), scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status = 500

        async def send_timed(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.state.metrics.observe_request(endpoint, status, time.perf_counter() - t0)

        try:
            try:
                error, receive = await self._check(scope, receive)
            except _ClientGone:
                return
            if error is not None:
                return await JSONResponse(error.body(), error.status, headers=error.headers)(scope, receive, send_timed)
            try:
                await self.app(scope, receive, send_timed)
            except Exception:  # answered 500 by the server-error middleware outside this one
                self.state.metrics.observe_request(endpoint, 500, time.perf_counter() - t0)
                raise
        finally:  # a request refused after admission (bad body, client gone) gives its place back
            if (place := scope.get(PLACE)) is not None:
                place.release()

    async def _check(self, scope, receive):
        cfg, path = self.state.cfg, scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if cfg.api_key and (path.startswith("/v1/") or path in PROFILE_ROUTES):
            token = headers.get("authorization", "")
            if not token.startswith("Bearer "):
                return ApiError("unauthorized", "missing bearer token (Authorization: Bearer <key>)",
                                headers={"WWW-Authenticate": "Bearer"}), receive
            if not hmac.compare_digest(token[7:].encode(), cfg.api_key.encode()):
                return ApiError("unauthorized", "invalid bearer token", headers={"WWW-Authenticate": "Bearer"}), receive
        if scope["method"] != "POST" or path not in POST_ROUTES:
            return None, receive
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return ApiError("unsupported_media_type", f"Content-Type {media or '(none)'!r}: expected "
                            "application/json", param="Content-Type"), receive
        limit = cfg.max_body_bytes
        too_large = ApiError("body_too_large", f"the body is over the limit of {limit} bytes", param="body",
                             limit=limit)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return too_large, receive
        try:
            scope[PLACE] = self.state.admit()
        except ApiError as refusal:
            return refusal, receive
        body, more = bytearray(), True  # read it all here (bounded), then hand it on
        while more:
            try:
                message = await asyncio.wait_for(receive(), cfg.body_timeout_s)
            except asyncio.TimeoutError:
                return ApiError("body_timeout", f"the body did not arrive: nothing for {cfg.body_timeout_s:g} s "
                                f"after {len(body)} bytes", param="body"), receive
            if message["type"] == "http.disconnect":
                raise _ClientGone
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return too_large, receive
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return None, replay


class _ClientGone(Exception):
    pass

