"""The main job: quantize a small built-in model with several presets, report the error, round-trip a
checkpoint. No downloads; runs in seconds on a CPU."""

from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
from torch import nn

from . import config as presets
from .checkpoint import restore, save
from .model_quant import print_quant_summary, quantize

DEMO_PRESETS = ("INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "FP8_BLOCKWISE_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A8_AWQ_BETA_CFG", "MXFP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG")


class TinyBlockModel(nn.Module):
    """A conv stem and two pre-norm MLP blocks, shaped like a transformer's feed-forward path."""

    def __init__(self, dim: int = 256, hidden: int = 1024, vocab: int = 512) -> None:
        super().__init__()
        self.stem = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(2))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)


def build_model(seed: int = 0) -> TinyBlockModel:
    torch.manual_seed(seed)
    return TinyBlockModel().eval()


def calibration_data(n: int = 8, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 64, 256, generator=g) for _ in range(n)]


def run_demo(names: tuple[str, ...] = DEMO_PRESETS) -> int:
    """Returns a process exit code: 0 when every restored model reproduces its quantized outputs."""
    data = calibration_data()
    probe = calibration_data(1, seed=2)[0]
    base = build_model()
    with torch.no_grad():
        ref = base(probe)

    def forward_loop(model: nn.Module) -> None:
        for batch in data:
            model(batch)

    print(f"{'preset':34s} {'rel. error':>10s} {'quantize s':>10s}  restore")
    failures = 0
    last = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            quantize(model, getattr(presets, name), forward_loop)
            took = time.perf_counter() - t0
            with torch.no_grad():
                out = model(probe)
            err = ((out - ref).norm() / ref.norm()).item()
            path = os.path.join(tmp, f"{name}.pt")
            save(model, path)
            fresh = restore(build_model(seed=0), path)
            with torch.no_grad():
                same = torch.equal(fresh(probe), out)
            failures += not same
            print(f"{name:34s} {err:10.4f} {took:10.3f}  {'identical' if same else 'MISMATCH'}")
            last = model
    print()
    print(f"quantizers of the last preset ({names[-1]}):")
    print_quant_summary(last)
    return 1 if failures else 0
