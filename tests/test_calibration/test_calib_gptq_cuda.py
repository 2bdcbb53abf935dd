"""gptq on a CUDA GPU (skipped without one): the same weights as on the CPU for every supported weight format
(each column quantized alone as a [rows, 1] tensor by the CUDA fake-quant kernels), and the updated weight a
fixed point of its fake quant there too. Run on the GPU machine:
``python -m pytest tests/test_calibration/test_calib_gptq_cuda.py -q``."""

from __future__ import annotations

import copy

import pytest
import torch

import quantlib as ql

from ._models import loop
from .test_calib_gptq import WEIGHTS, _cfg, correlated, linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("weight", list(WEIGHTS))
def test_gptq_on_cuda_gives_the_cpu_weights(weight):
    data = correlated()
    cpu = ql.quantize(linear(), _cfg("gptq", WEIGHTS[weight]), loop(data))
    gpu = ql.quantize(copy.deepcopy(linear()).cuda(), _cfg("gptq", WEIGHTS[weight]), loop([x.cuda() for x in data]))
    a, b = gpu[0].weight.detach().cpu(), cpu[0].weight.detach()
    # the Hessian's GEMMs and the Cholesky factors round otherwise on the GPU: a tie may go the other way
    assert (a != b).float().mean().item() < 0.02, weight
    with torch.no_grad():
        q, stored = gpu[0].weight_quantizer, gpu[0].weight
        first = q if isinstance(q, ql.TensorQuantizer) else q[0]  # a chain stores its first member's output
        assert torch.equal(first(stored), stored), weight
