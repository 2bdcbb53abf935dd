"""TE 2.x's fused norm under autocast: quantlib's input quantizer acts on the norm's output before TE's own FP8
quantizer (``te_adapters.quantized_norm``), driven with a stand-in norm kernel (TE's binding needs a GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import quantlib as ql
from quantlib.nn import TensorQuantizer
from quantlib.plugins import te_adapters as ta


def test_quantized_norm_under_autocast_casts_the_fake_quantized_output_with_tes_quantizer():
    """Under TE's autocast, TE hands its norm its FP8 quantizer (2.x ``apply_normalization``'s 6th argument) to write
    FP8 directly: quantlib's input quantizer must act first, then TE's quantizer, and the norm must run without it."""
    seen = []

    def norm(inputmat, ln_out, ln_weight, ln_bias, eps, output_quantizer, output_dtype, *rest):
        seen.append(output_quantizer)
        return F.layer_norm(inputmat, inputmat.shape[-1:], ln_weight, ln_bias, eps), None, None

    quantizer = TensorQuantizer(ql.QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    quantizer.amax = torch.tensor(2.0)
    te_calls = []

    def te_quantizer(t):
        te_calls.append(t)
        return t * 2

    x, w, b = torch.randn(4, 16), torch.rand(16) + 0.5, torch.randn(16)
    plain = F.layer_norm(x, (16,), w, b, 1e-5)
    out, *_ = ta.quantized_norm(norm, quantizer)(x, None, w, b, 1e-5, te_quantizer, x.dtype, "LayerNorm", 0, False)
    assert seen == [None] and len(te_calls) == 1
    assert torch.equal(te_calls[0], quantizer(plain)) and not torch.equal(te_calls[0], plain)
    assert torch.equal(out, 2 * quantizer(plain))
    out, *_ = ta.quantized_norm(norm, quantizer)(x, None, w, b, 1e-5, None, x.dtype, "LayerNorm", 0, False)  # no autocast
    assert torch.equal(out, quantizer(plain)) and len(te_calls) == 1
