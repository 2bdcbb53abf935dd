"""The amax layout rules on FormatSpec, which the quantizer, the calibration, the checkpoint, the amax sync
and the export all ask (docs/design.md §3-§8): one table per format, as config.py builds the specs."""
import pytest
import torch

from quantlib.config import QuantizerAttributeConfig
from quantlib.nn.max_collector import static_amax, static_amax_shape

# (attribute config, per_tensor_amax, calibrated_amax, per_block_amax, two_level, static_blocks, scale_from_amax)
CASES = {
    "int8 per tensor": (dict(num_bits=8), True, True, False, False, False, False),
    "int8 per channel": (dict(num_bits=8, axis=0), False, True, False, False, False, False),
    "int4 static blocks": (dict(num_bits=4, block_sizes={-1: 8}), False, True, True, False, False, False),
    "int4 dynamic blocks": (dict(num_bits=4, block_sizes={-1: 8, "type": "dynamic"}), False, False, True, False, False, False),
    "fp8 per tensor": (dict(num_bits=(4, 3)), True, True, False, False, False, True),
    "fp8 per channel": (dict(num_bits=(4, 3), axis=0), False, True, False, False, False, True),
    # per token: no stored amax (the rules about one are moot), an FP8 scale where an amax is given
    "fp8 per token": (dict(num_bits=(4, 3), block_sizes={-1: None, "type": "dynamic"}), True, False, False, False, False, True),
    "fp8 static 2-D blocks": (dict(num_bits=(4, 3), block_sizes={-1: 128, -2: 128}), False, True, True, False, False, True),
    "fp8 dynamic 1-D blocks": (dict(num_bits=(4, 3), block_sizes={-1: 128, "type": "dynamic"}), False, False, True, False, False, False),
    "mxfp8": (dict(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
              False, False, True, False, False, False),
    "nvfp4 dynamic blocks": (dict(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}),
                             True, True, False, True, False, False),
    "nvfp4 static blocks": (dict(num_bits=(2, 1), block_sizes={-1: 16, "type": "static", "scale_bits": (4, 3)}),
                            True, True, False, True, True, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_amax_layout_rules_per_format(name):
    attrs, per_tensor, calibrated, per_block, two_level, static_blocks, scale_from_amax = CASES[name]
    cfg = QuantizerAttributeConfig(**attrs)
    spec = cfg.format_spec()
    got = (spec.per_tensor_amax(cfg.axis), spec.calibrated_amax, spec.per_block_amax, spec.two_level, spec.static_blocks,
           spec.scale_from_amax)
    assert got == (per_tensor, calibrated, per_block, two_level, static_blocks, scale_from_amax), name
    # a quantizer that never calibrates is the one whose spec keeps no calibrated amax (type "dynamic" aside)
    assert cfg.is_dynamic == (not calibrated)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] and "per token" not in n])
def test_per_tensor_rule_matches_the_stored_amax_shape(name):
    """The amax max calibration stores is one value exactly where the spec says per tensor."""
    cfg = QuantizerAttributeConfig(**CASES[name][0])
    spec = cfg.format_spec()
    x = torch.randn(256, 256)
    shape = static_amax_shape(spec, cfg.axis, tuple(x.shape))
    assert tuple(static_amax(x, spec, cfg.axis).shape) == shape
    assert (shape == ()) == spec.per_tensor_amax(cfg.axis)
