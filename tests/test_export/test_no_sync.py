"""``iter_packed`` and the RL sync (``sync_pairs``) read nothing back from the device per module: every check that
needs amax values is one batched read before the first yield, and packing only queues work; the sync's kept plan
reads nothing at all.

On the CPU nothing syncs, so the test counts the Python calls that would sync on a GPU (``.item()``,
``.tolist()``, ``bool(t)``, ``float(t)``, ``torch.equal``, ``.cpu()``...) while it iterates over a 2-layer
and a 6-layer Llama: the count must not grow with the number of modules and must be zero after the first
yield. The kernels resolve to the torch reference, the same tensor-only path as the device backends
(the C++ CPU backend may read host values: its tensors are on the host).
"""

from __future__ import annotations

import contextlib
import functools
import traceback

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import iter_packed  # noqa: E402
from quantlib.kv.presets import FP8_KV_CFG, merge_kv_config  # noqa: E402
from tests.test_export._export_models import quantized, weight_only  # noqa: E402

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero", "__repr__", "__format__")
_FUNCS = ("equal", "allclose", "is_nonzero", "nonzero", "unique")

CASES = {
    "hf_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
    "hf_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
    "modelopt_fp8": merge_kv_config(ql.FP8_DEFAULT_CFG, FP8_KV_CFG),  # sibling amax and KV scales read
    "ct_nvfp4": weight_only(ql.NVFP4_DEFAULT_CFG),  # sibling global amax
    "modelopt_fp8_pb": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
}


class SyncCounter:
    """Counts (and records where) the calls that read device values on the host."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.on = False

    def wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.on:
                frame = traceback.extract_stack(limit=2)[0]  # the caller
                self.calls.append(f"{name} at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}")
            return fn(*args, **kwargs)

        return counted


@contextlib.contextmanager
def counting(monkeypatch):
    c = SyncCounter()
    for m in _METHODS:
        monkeypatch.setattr(torch.Tensor, m, c.wrap(f"Tensor.{m}", getattr(torch.Tensor, m)))
    for f in _FUNCS:
        monkeypatch.setattr(torch, f, c.wrap(f"torch.{f}", getattr(torch, f)))
    yield c


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def host_reads(monkeypatch, start) -> tuple[list[str], list[str], int]:
    """(reads before the first item, reads after it, items) of one pass over ``start()``."""
    from quantlib import kernels
    from quantlib.kernels import ops

    real = ops.select  # every op picks its kernel through select: AUTO runs the reference (no host-tensor shortcuts)
    pick = lambda op, backend, device: real(op, "reference" if backend == "auto" else backend, device)  # noqa: E731
    monkeypatch.setattr(ops, "select", pick)
    monkeypatch.setattr(kernels, "select", pick)
    with counting(monkeypatch) as c:
        c.on = True
        it = start()
        first = next(it)
        before = list(c.calls)
        c.calls.clear()
        n = 1 + sum(1 for _ in it)
        c.on = False
    assert first
    return before, c.calls, n


def reads(monkeypatch, fmt: str, layers: int) -> tuple[list[str], list[str], int]:
    """(reads before the first yield, reads after it, modules yielded) of one iteration."""
    model = quantized(llama(layers), CASES[fmt])
    return host_reads(monkeypatch, lambda: iter_packed(model, fmt))


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_no_device_read_per_module(monkeypatch, fmt):
    before2, after2, n2 = reads(monkeypatch, fmt, 2)
    before6, after6, n6 = reads(monkeypatch, fmt, 6)
    assert n6 > n2
    assert after2 == [] and after6 == [], f"device reads while packing: {after6}"
    assert len(before6) == len(before2), f"up-front reads grow with the modules: 2 layers {before2}, 6 layers {before6}"
    # the batched amax read (plus the KV one), and the checkpoint-name probe's one read of its own host tensors
    assert len([b for b in before2 if "hf_names.py" not in b]) <= 2 and len(before2) <= 3, before2


#: the RL sync's recipes: weight-only FP8 128x128, MXFP8 W8A8, NVFP4 W4A4 and FP8 W8A8 (their input scales in the stream)
SYNC_CASES = {"hf_fp8_block": CASES["hf_fp8_block"], "hf_mxfp8": CASES["hf_mxfp8"], "modelopt_nvfp4": ql.NVFP4_DEFAULT_CFG,
              "modelopt_fp8": ql.FP8_DEFAULT_CFG}


@pytest.mark.parametrize("fmt", sorted(SYNC_CASES))
def test_sync_pairs_reads_nothing_per_module_and_nothing_once_planned(monkeypatch, fmt):
    """The RL sync of a MoE model (stacked experts, dynamic scales): at most one batched read before its first pair,
    whatever the number of layers, none after it, and none at all in the next step's sync (the kept plan)."""
    from quantlib.export import sync_pairs
    from tests.test_export._export_models import qwen3_moe

    for layers in (2, 4):
        model = quantized(qwen3_moe(layers=layers), SYNC_CASES[fmt])
        before, after, n = host_reads(monkeypatch, functools.partial(sync_pairs, model, fmt))
        assert len(before) <= 1 and after == [], f"{layers} layers: before the first pair {before}, after it {after}"
        assert n > 16 * layers
        again = host_reads(monkeypatch, functools.partial(sync_pairs, model, fmt))
        assert again == ([], [], n), f"{layers} layers, the next step's sync: {again}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", sorted(CASES))
def test_no_sync_on_the_gpu(fmt):
    """On a GPU, torch's sync debug mode raises at any synchronising call after the first yield (the
    kernels compiled and tuned by a first iteration, whose tuning times them)."""
    model = quantized(llama(2), CASES[fmt]).cuda()
    for _ in iter_packed(model, fmt):
        pass
    it = iter_packed(model, fmt)
    next(it)
    torch.cuda.set_sync_debug_mode("error")
    try:
        n = 1 + sum(1 for _ in it)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert n > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", sorted(CASES))
def test_gpu_export_equals_cpu_export(fmt):
    """The device path (static FP8-block cast, MX / NVFP4 casts, FP8 per tensor in whole-tensor ops)
    packs the bytes the CPU path packs."""
    model = quantized(llama(2), CASES[fmt])
    on_cpu = {k: t for pw in iter_packed(model, fmt) for k, t in pw.items()}
    on_gpu = {k: t.cpu() for pw in iter_packed(model.cuda(), fmt) for k, t in pw.items()}
    assert on_gpu.keys() == on_cpu.keys()
    for k, t in on_cpu.items():
        g = on_gpu[k]
        assert g.dtype == t.dtype and g.shape == t.shape, k
        assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g, t.view(torch.uint8) if t.dtype.itemsize == 1 else t), k


def test_plan_traversal_is_named_modules_without_the_quantizers():
    """The plan's own traversal (which skips quantizer subtrees) lists exactly what ``named_modules``
    lists once the quantizers are filtered out: the same names, order and first names of shared modules."""
    from quantlib.export.plan import named_modules
    from quantlib.nn.containers import QuantizerContainer
    from quantlib.nn.tensor_quantizer import TensorQuantizer
    from tests.test_export._export_models import llama, qwen3_moe

    for model in (quantized(llama(), CASES["modelopt_fp8"]), quantized(qwen3_moe(), CASES["hf_mxfp8"])):
        model.extra = torch.nn.ModuleList([model.model.layers[1].mlp, torch.nn.Linear(2, 2)])  # shared: keeps its first name
        torch_order = [(n, id(m)) for n, m in model.named_modules() if not isinstance(m, (TensorQuantizer, QuantizerContainer))]
        assert [(n, id(m)) for n, m in named_modules(model)] == torch_order and "extra.1" in dict(torch_order)
