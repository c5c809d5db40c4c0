"""moeserve: train, run, export and serve sparse Mixture-of-Experts models."""

from moeserve.config import ConfigError, MoEConfig

__all__ = ["ConfigError", "MoEConfig"]
__version__ = "0.1.0"
