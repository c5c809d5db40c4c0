"""moeserve: train, run, export and serve sparse Mixture-of-Experts models."""

from moeserve.config import ConfigError, MoEConfig

__all__ = ["ConfigError", "Engine", "MoEConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch; `import moeserve` (config, --version) stays light until it is asked for.
    if name == "Engine":
        from moeserve.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
