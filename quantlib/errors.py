"""The error every layer raises for an invalid setting (below all of them, so the kernels can raise it too)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid quantization config; the message names the key and the value."""


__all__ = ["ConfigError"]
