"""The main job: quantize a small built-in model with several presets, report the error, round-trip a
checkpoint, export it for an inference engine and load the export back with compressed-tensors (when
installed). No downloads; runs in seconds on a CPU."""

from __future__ import annotations

import copy
import os
import tempfile
import time
from typing import Callable

import torch
from torch import nn

from . import presets
from .checkpoint import restore, save
from .export import export_checkpoint
from .model_quant import disable_quantizer, print_quant_summary, quantize

DEMO_PRESETS = ("INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "FP8_BLOCKWISE_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A8_AWQ_BETA_CFG",
                "MXFP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG")


class TinyBlockModel(nn.Module):
    """A conv stem and two pre-norm MLP blocks, shaped like a transformer's feed-forward path."""

    def __init__(self, dim: int = 256, hidden: int = 1024, vocab: int = 512) -> None:
        super().__init__()
        self.stem = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                    for _ in range(2))
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
    print()
    failures += not export_demo(forward_loop)
    return 1 if failures else 0


def export_demo(forward_loop: Callable[[nn.Module], None]) -> bool:
    """Export an FP8-block model in compressed-tensors' format and load it back with compressed-tensors'
    own decompressor (skipped, saying so, when compressed-tensors is not installed). True if it matched."""
    model = build_model()
    quantize(model, presets.FP8_BLOCKWISE_CFG, forward_loop)
    disable_quantizer(model, "*stem*")  # export formats carry linear (2-D) weights, not the conv stem
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "export")
        manifest = export_checkpoint(model, out, "ct_fp8_block")
        print(f"exported {len(manifest.quantized_modules)} FP8-block linears ({manifest.num_bytes / 1e6:.2f} MB) to "
              f"{', '.join(manifest.files)}; left unquantized: {', '.join(manifest.unquantized_modules)}")
        try:
            loaded = _decompress_with_compressed_tensors(out)
        except ImportError:
            print("compressed-tensors is not installed: skipped loading the export back (pip install compressed-tensors)")
            return True
    same = all(torch.equal(loaded[name], model.get_submodule(name).quantize_weight(model.get_submodule(name).weight))
               for name in manifest.quantized_modules)
    print(f"compressed-tensors decompressed {len(loaded)} weights: {'identical to' if same else 'MISMATCH with'} quantlib's fake-quantized "
          "weights")
    return same


def _decompress_with_compressed_tensors(out: str) -> dict[str, torch.Tensor]:
    """Weights of a compressed-tensors checkpoint as its own decompressor gives them."""
    import json

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    modules: dict[str, dict] = {}
    for key, t in load_file(os.path.join(out, "model.safetensors")).items():
        mod, _, local = key.rpartition(".")
        modules.setdefault(mod, {})[local] = t
    return {mod: compressor.decompress(local, scheme)["weight"].float() for mod, local in modules.items() if "weight_scale" in local}
