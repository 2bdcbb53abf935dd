"""A recalibration that fails part way (a data-loader error, OOM, Ctrl-C) leaves a calibrated model's
quantizer state (amax, static block amax, pre_quant_scale) and weights as they were, bit for bit, for
every algorithm, in memory and layer by layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.model_quant import iter_leaf_quantizers

from ._models import int8_cfg, loop, mlp, outlier_data

transformers = pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402

#: every algorithm with a config whose quantizers it searches (int8 for smoothquant, INT4 blocks for AWQ)
CONFIGS = {
    "max": int8_cfg("max"),
    "mse": int8_cfg("mse"),
    "smoothquant": int8_cfg("smoothquant"),
    "awq_lite": {**ql.INT4_AWQ_CFG, "algorithm": "awq_lite"},
    "awq_clip": {**ql.INT4_AWQ_CFG, "algorithm": "awq_clip"},
    "awq_full": {**ql.INT4_AWQ_CFG, "algorithm": "awq_full"},
}


class DataLoaderError(RuntimeError):
    pass


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantizer buffer (amax, block amax, pre_quant_scale, bias) and every weight, cloned."""
    out = {f"{n}.{k}": b.detach().clone() for n, q in iter_leaf_quantizers(model) for k, b in q._buffers.items() if b is not None}
    out.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = state_of(model)
    assert after.keys() == before.keys()
    changed = [k for k in before if not (after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]))]
    assert not changed, changed[:5]


def failing_after(batches: list, error: BaseException, good: int = 1):
    """A forward loop that raises ``error`` after ``good`` batches in all (over all its calls)."""
    seen = [0]

    def loop_(model: nn.Module) -> None:
        for x in batches:
            if seen[0] == good:
                raise error
            seen[0] += 1
            model(x)

    return loop_


def tiny_neox() -> nn.Module:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64)
    return GPTNeoXForCausalLM(cfg).eval()


@pytest.mark.parametrize("error", [DataLoaderError("batch 2 is corrupt"), KeyboardInterrupt()], ids=["loader-error", "ctrl-c"])
@pytest.mark.parametrize("algo", sorted(CONFIGS))
def test_failed_recalibration_keeps_the_calibrated_state(algo, error):
    data = outlier_data()
    model = ql.quantize(mlp(), CONFIGS[algo], loop(data))
    if algo in ("smoothquant", "awq_lite", "awq_full"):
        assert model[0].input_quantizer.pre_quant_scale is not None  # the state the failure must not clear
    before = state_of(model)
    x = outlier_data(1, seed=9)[0]
    with torch.no_grad():
        out = model(x)
    with pytest.raises(type(error)):
        ql.calibrate(model, algo, failing_after(data, error))
    assert_same_state(model, before)
    with torch.no_grad():
        assert torch.equal(model(x), out)  # still static: no silent fall back to dynamic amax


@pytest.mark.parametrize("sequential", [False, True], ids=["in-memory", "layer-by-layer"])
@pytest.mark.parametrize("preset, algo", [("INT8_DEFAULT_CFG", "max"), ("W4A8_AWQ_BETA_CFG", "awq_lite")])
def test_failed_recalibration_of_a_transformers_model_keeps_its_state(preset, algo, sequential):
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = ql.quantize(tiny_neox(), {**getattr(ql, preset), "algorithm": algo}, loop(batches))
    before = state_of(model)
    kept = "_pre_quant_scale" if algo == "awq_lite" else "_amax"
    assert any(k.endswith("input_quantizer." + kept) for k in before)
    # layer by layer: the first pass feeds 3 batches, layer 0 is recalibrated, the second pass fails
    others = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    failing = failing_after(others, DataLoaderError("loader died"), good=4 if sequential else 1)
    with pytest.raises(DataLoaderError):
        ql.calibrate(model, algo, failing, sequential=sequential)
    assert_same_state(model, before)
    assert all("forward" not in layer.__dict__ for layer in model.gpt_neox.layers)  # the driver's patches are gone


def test_successful_recalibration_still_replaces_the_state():
    data = outlier_data()
    model = ql.quantize(mlp(), CONFIGS["max"], loop(data))
    before = model[0].input_quantizer.amax.clone()
    ql.calibrate(model, "max", loop([2 * x for x in data]))
    assert torch.equal(model[0].input_quantizer.amax, 2 * before)
