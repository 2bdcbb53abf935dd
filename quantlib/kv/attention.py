"""The q/k/v/p bmm quantizers every quantized attention module carries (transformers', Megatron-Core's)."""

from __future__ import annotations

from typing import Iterator

import torch

from ..config import QuantizerAttributeConfig
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .presets import ATTENTION_QUANTIZER_NAMES


class AttentionQuantizers(QuantModule):
    """``q_bmm_quantizer``, ``k_bmm_quantizer``, ``v_bmm_quantizer`` and ``p_bmm_quantizer`` (the softmax
    output; ModelOpt's names; disabled until a config enables them) and no weights: the projections around attention are quantized as
    linears."""

    quantizer_names = ATTENTION_QUANTIZER_NAMES
    weight_quantizer_names = ()

    def _setup(self) -> None:
        for name in self.quantizer_names:
            setattr(self, name, TensorQuantizer(QuantizerAttributeConfig(enable=False)))

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        return iter(())
