"""Plugins for other frameworks: each registers its quantized modules only when its framework imports.

Importing this package (``quantlib/__init__`` does, last) adds :func:`register_available` to the module
registry's finders, so a conversion loads the plugins without any core module importing this one."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

from ..nn.quant_module import QuantModuleRegistry

_log = logging.getLogger("quantlib")

#: plugin module -> the framework module it needs
PLUGINS = {
    "quantlib.plugins.transformer_engine": "transformer_engine.pytorch",
    "quantlib.plugins.megatron": "megatron.core",
    "quantlib.plugins.huggingface": "transformers",
    "quantlib.plugins.hf_attention": "transformers",
    "quantlib.plugins.megatron_attention": "megatron.core",
}
_loaded: set[str] = set()


def _framework_present(name: str) -> bool:
    # A model built from a framework's classes has imported it already: never import one just to look.
    return name.split(".")[0] in sys.modules


def register_available() -> list[str]:
    """Import every plugin whose framework the process has imported; returns the loaded plugins."""
    for plugin, framework in PLUGINS.items():
        if plugin in _loaded:
            refresh = getattr(sys.modules[plugin], "refresh", None)
            if refresh is not None:  # classes of framework modules imported since the last call
                refresh()
            continue
        if not _framework_present(framework):
            continue
        if importlib.util.find_spec(plugin) is None:
            continue
        try:
            module = importlib.import_module(plugin)
        except ImportError as exc:  # e.g. TE installed without its compiled binding
            _log.info("plugin %s not loaded: %s", plugin, exc)
            continue
        except OSError as exc:  # a framework whose shared libraries do not load (TE against another cuDNN)
            _log.warning("quantlib: plugin %s not loaded, %s does not import: %s", plugin, framework, exc)
            continue
        if hasattr(module, "refresh"):  # imported earlier (by the user) before its framework's classes were
            module.refresh()
        _loaded.add(plugin)
    return sorted(_loaded)


QuantModuleRegistry.add_finder(register_available)
