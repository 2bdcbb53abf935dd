"""A framework whose shared libraries fail to load (Transformer Engine against another cuDNN raises
OSError from ctypes) must not break quantize() of models that do not use it: its plugin is skipped with
a warning naming it."""

from __future__ import annotations

import importlib
import logging
import sys
import types

from quantlib import plugins


def test_a_plugin_whose_framework_raises_oserror_is_skipped(monkeypatch, caplog):
    monkeypatch.setitem(plugins.PLUGINS, "quantlib.plugins._broken_for_test", "broken_framework_for_test")
    monkeypatch.setitem(sys.modules, "broken_framework_for_test", types.ModuleType("broken_framework_for_test"))
    real_find_spec, real_import = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name.endswith("_broken_for_test")
                        else real_find_spec(name, *a))

    def fake_import(name, *args):
        if name == "quantlib.plugins._broken_for_test":
            raise OSError("libcudnn_cnn.so.9: undefined symbol")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        loaded = plugins.register_available()
    assert "quantlib.plugins._broken_for_test" not in loaded
    assert any("_broken_for_test" in r.getMessage() and "undefined symbol" in r.getMessage() for r in caplog.records)
