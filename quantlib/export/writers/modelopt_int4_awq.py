"""ModelOpt ``W4A16_AWQ`` (its INT4_AWQ): ``weight`` uint8 [out/2, in], two output rows per byte (row
``2i`` in the low nibble, ``2i+1`` in the high one, two's complement, as ModelOpt's ``pack_int4_in_uint8``);
``weight_scale`` fp32 [out, in/G], the multiplier ``1 / s`` (see :mod:`.ct_int`); ``pre_quant_scale``
[in] on each linear whose SmoothQuant / AWQ scale folds into no op before it (:mod:`quantlib.export.fold`)."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, Kind, QuantizedTensor
from ...kv.scales import ModelOptKVCache
from ..types import ExportFormat
from . import ct_int, modelopt_common
from .base import ConfigInfo, Packer


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Signed INT4 ``codes`` [out, in] as uint8 [out/2, in]: even rows in the low nibble."""
    nib = (codes.to(torch.int16) & 0x0F).to(torch.uint8)
    return (nib[0::2] | (nib[1::2] << 4)).contiguous()


class ModelOptInt4AWQ(ModelOptKVCache, Packer):
    fmt = ExportFormat.MODELOPT_INT4_AWQ
    carries_pre_quant_scale = True
    transposed_why = ("vLLM, the consumer that reads GPT-2's (in, out) weights, has no W4A16_AWQ / W4A8_AWQ, and ModelOpt's own export "
                      "writes a quantized Conv1D (out, in), as its quantized model holds it, unlike GPT-2's checkpoints")

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        if spec.kind != Kind.INT or spec.num_bits != 4 or spec.unsigned or spec.block is None or len(spec.block) != 1:
            return "needs signed INT4 weights in blocks along the input dim (block_sizes {-1: G})"
        if len(amax_shape) == 2 and amax_shape[0] % 2:
            return f"an odd number of rows ({amax_shape[0]}) does not pack two rows per byte"
        return None

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return "W4A16_AWQ is weight-only; disable the input quantizer"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": pack_int4_rows(q.codes.reshape(q.shape)), "weight_scale": ct_int.multiplier_scale(q)}

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        quant = modelopt_common.hf_quant_config("W4A16_AWQ", info, group_size=info.weight_spec.block[0])
        quant["quantization"].update(has_zero_point=False, pre_quant_scale=True)  # ModelOpt writes both for every INT4_AWQ export
        return {"hf_quant_config.json": quant}
