"""The export plan's one module traversal (:class:`~quantlib.export.modules.ModuleWalk`): what it lists
equals what torch's own walks give, and an export walks the model once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import iter_packed, modules  # noqa: E402
from quantlib.kv.presets import ATTENTION_QUANTIZER_NAMES, FP8_KV_CFG, merge_kv_config  # noqa: E402
from quantlib.nn.quant_module import QuantModule  # noqa: E402
from tests.test_export import _families as fam  # noqa: E402


def _quantized(family: str, tie: bool) -> torch.nn.Module:
    model = fam.build(family, tie=tie)
    ql.quantize(model, merge_kv_config(ql.FP8_DEFAULT_CFG, FP8_KV_CFG), lambda m: m(fam.tokens()))
    ql.disable_quantizer(model, "*lm_head*")
    return model


@pytest.mark.parametrize("family, tie", [("llama", True), ("qwen3_moe", False)])
def test_walk_lists_what_torch_lists(family, tie):
    model = _quantized(family, tie)
    walk = modules.ModuleWalk(model)
    quantizers = set(_quantizer_names(model))
    torch_modules = [(n, m) for n, m in model.named_modules() if n not in quantizers and not _in_quantizer(n, model)]
    assert [(n, id(m)) for n, m in walk.modules] == [(n, id(m)) for n, m in torch_modules]
    # the owners hold every tensor once, under the first name, as named_parameters / named_buffers do
    owned = {f"{n}.{k}" if n else k: id(t) for n, _, d in walk.owners for k, t in d.items()}
    persistent = {n: id(b) for n, b in model.named_buffers() if n in model.state_dict() and not _in_quantizer(n, model)}
    expected = {n: id(p) for n, p in model.named_parameters() if not _in_quantizer(n, model)} | persistent
    assert owned == expected
    assert walk.tied is tie
    assert [n for n, *_ in walk.entries] == [n for n, m in walk.modules if n in {o for o, *_ in walk.owners} or isinstance(m, QuantModule)]
    linears = [(n, isinstance(m, QuantModule)) for n, m in walk.modules if isinstance(m, (QuantModule, torch.nn.Linear))]
    assert [(n, q) for n, _, q in walk.linears] == linears
    attention = [n for n, m in walk.modules if set(ATTENTION_QUANTIZER_NAMES) & set(m._modules)]
    assert [n for n, _ in walk.attention] == attention and attention


def _quantizer_names(model: torch.nn.Module) -> list[str]:
    from quantlib.nn.containers import QuantizerContainer
    from quantlib.nn.tensor_quantizer import TensorQuantizer

    return [n for n, m in model.named_modules() if isinstance(m, (TensorQuantizer, QuantizerContainer))]


def _in_quantizer(name: str, model: torch.nn.Module) -> bool:
    return any(name.startswith(q + ".") for q in _quantizer_names(model))


def test_an_export_walks_the_model_once(monkeypatch):
    """iter_packed's layout (transformers' names) and plan share one traversal: a second one was a third
    of the plan's host time on an H100 (FP8 128x128, 3 layers)."""
    model = _quantized("llama", False)
    walks = []
    init = modules.ModuleWalk.__init__

    def counted(self, m):
        walks.append(m)
        init(self, m)

    monkeypatch.setattr(modules.ModuleWalk, "__init__", counted)
    assert list(iter_packed(model, "modelopt_fp8", unify_siblings=True))
    assert len(walks) == 1
