"""`moeserve serve`: the app under uvicorn, with a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops accepting connections, answers 503 to new requests on
connections already open, lets requests in flight (queued, generating or streaming) finish for up to
`shutdown_timeout_s`, then cancels what is left and stops the batcher.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from moeserve.runtime import BACKENDS
from moeserve.runtime.engine import load_engine
from moeserve.serve.app import create_app
from moeserve.serve.state import ServeConfig, ServerState


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.draining = True  # before uvicorn's own shutdown: /readyz turns 503 at once
        super().handle_exit(sig, frame)


def serve(checkpoint: str | Path, cfg: ServeConfig, *, dtype: str = "auto", device: str = "auto",
          backend: str = "auto", calibration: str | None = None, compile: str = "auto", verify: bool = True,
          access_log: bool = True, log_level: str = "info", quantize: str | None = None) -> int:
    """Serve a checkpoint directory or an .onnx export until stopped (`verify=False`: its hashes were
    checked a moment ago, as the CLI does for the default model). Returns the exit status: 1 if the
    model failed to load."""
    path = Path(checkpoint)
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir() and path.suffix != ".onnx" and backend != "onnx":
        raise NotADirectoryError(f"checkpoint {str(path)!r} is not a directory (nor an .onnx export)")
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(levelname)s:     %(message)s")
    app = create_app(lambda: load_engine(path, backend, dtype=dtype, device=device, threads=cfg.threads,
                                         calibration=calibration, compile=compile, verify=verify,
                                         quantize=quantize), cfg)
    state: ServerState = app.state.serve
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, timeout_graceful_shutdown=cfg.shutdown_timeout_s,
                            access_log=access_log, log_level=log_level)
    server = _Server(config, state)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        logging.getLogger("moeserve.serve").warning(
            "moeserve: listening on %s with no API key: anyone who can reach this port can use the model "
            "(set --api-key or $MOESERVE_API_KEY)", cfg.host)
    server.run()
    return 1 if state.load_error else 0
