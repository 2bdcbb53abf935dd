"""AWQ and SmoothQuant on real Transformer Engine layers built with ``bias=False`` (a CUDA GPU and TE's
torch binding; skipped elsewhere): the searched ``pre_quant_scale`` and amax equal, bit for bit, those
of an ``nn.Linear(bias=False)`` calibrated on the inputs the TE GEMM reads (LayerNormLinear: TE's own
normalized output, returned by an unquantized twin with ``return_layernorm_output=True``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantlib as ql
from tests.test_plugins import te_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.te]
_WHY = te_gpu.gpu_and_te()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402

IN, OUT, DTYPE = 256, 128, torch.bfloat16
PRESETS = {"int4_awq": ql.INT4_AWQ_CFG, "w4a8_awq": ql.W4A8_AWQ_BETA_CFG, "int8_smoothquant": ql.INT8_SMOOTHQUANT_CFG}


def build(kind: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    cls = te.LayerNormLinear if kind == "layernorm_linear" else te.Linear
    return cls(IN, OUT, bias=False, params_dtype=DTYPE, device="cuda", **kwargs)


def batches() -> list[torch.Tensor]:
    """Channels of different offset and spread: pre-norm and normalized statistics differ."""
    g = torch.Generator(device="cuda").manual_seed(1)
    spread = torch.linspace(0.5, 8.0, IN, device="cuda")
    offset = torch.linspace(-20.0, 20.0, IN, device="cuda")
    return [(torch.randn(64, IN, device="cuda", generator=g) * spread + offset).to(DTYPE) for _ in range(3)]


def states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{q}.{k}": t for q in ("input_quantizer", "weight_quantizer") for k, t in getattr(model, q).state_dict().items()}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear"])
def test_te_layer_without_bias_calibrates_as_nn_linear_on_the_gemm_input(kind, preset):
    data = batches()
    model = ql.quantize(build(kind), PRESETS[preset], lambda m: [m(x) for x in data])
    assert build(kind).bias.numel() == 0  # what TE holds for bias=False
    if kind == "layernorm_linear":
        twin = build(kind, return_layernorm_output=True)
        with torch.no_grad():
            gemm_inputs = [twin(x)[1] for x in data]
    else:
        gemm_inputs = data
    ref = nn.Linear(IN, OUT, bias=False, dtype=DTYPE, device="cuda")
    with torch.no_grad():
        ref.weight.copy_(model.weight)
    ref = ql.quantize(ref, PRESETS[preset], lambda m: [m(x) for x in gemm_inputs])
    got, want = states(model), states(ref)
    assert sorted(got) == sorted(want) and any(k.endswith("_pre_quant_scale") for k in want)
    for k in want:
        assert torch.equal(got[k], want[k]), (kind, preset, k)
