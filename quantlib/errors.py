"""The errors raised across layers, below all of them: an invalid setting (the kernels raise it too) and a refused
export (the KV-cache export plan in :mod:`quantlib.kv` raises it below the export layer)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid quantization config; the message names the key and the value."""


class ExportError(ValueError):
    """Export refused or failed; the message names the module, the quantizer or the file."""


__all__ = ["ConfigError", "ExportError"]
