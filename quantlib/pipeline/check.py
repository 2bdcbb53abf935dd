"""The export loaded back by its consumer (transformers, compressed-tensors, ModelOpt) and compared with the
weights the fake-quantized model ran with, under each format's rule (docs/design.md §8)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from ..export.fold import Folds, plan_folds, times_rows
from ..export.transposed import stored_transposed, swap_weight
from ..nn.quant_module import QuantModule
from ..plugins import hf_experts
from .model import NO_HUB_KERNELS
from .options import PipelineError

#: format -> how the consumer's weight must compare with quantlib's: "exact"; "bf16ulp1" (compressed-tensors
#: multiplies NVFP4 values by their scales in bf16, which can round a tie the other way: at most 1 bf16 ulp
#: from quantlib's fp32 weight rounded to bf16); "ulp1" (INT: consumers multiply codes by a stored scale)
RULES = {"ct_nvfp4": "bf16ulp1", "ct_int8": "ulp1", "ct_int_pack": "ulp1", "modelopt_int4_awq": "ulp1"}
#: the rule of a weight whose rows (a folded pre_quant_scale) or columns (a carried one) the export scaled by p:
#: both sides multiply by p in fp32, and an INT fold stores s / p, then 1 / (s / p): each a rounding more
SCALED_RULES = {"exact": "exact", "ulp1": "ulp3", "bf16ulp1": "bf16ulp2"}


@dataclass
class CheckResult:
    """What loading the export back gave: the consumer, the modules compared, the worst ulp distance, and
    the modules that broke the format's rule (empty: passed)."""

    consumer: str
    rule: str
    compared: int = 0
    max_ulp: int = 0
    mismatched: list[str] = field(default_factory=list)
    scaled: int = 0  # weights compared with a folded or carried pre_quant_scale applied (rule SCALED_RULES[rule])

    @property
    def passed(self) -> bool:
        return self.compared > 0 and not self.mismatched


@torch.no_grad()
def iter_weights(model: nn.Module, quantized: bool = True) -> Iterator[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
    """(checkpoint module name, weight, the weight the fake-quantized model computes with) of every quantized
    weight, one at a time (never all at once); experts per expert, gate/up split as checkpoints hold them.
    ``quantized=False`` yields None in place of the quantized weight (names and shapes only)."""
    for name, m in model.named_modules():
        if isinstance(m, hf_experts.QuantFusedExperts):
            for proj in m.projections:
                for e in range(m.num_experts):
                    if not getattr(m, f"{proj}_weight_quantizer")[e].is_enabled:
                        continue  # an excluded expert is a plain tensor in the checkpoint, as an excluded linear
                    raw = hf_experts.expert_weight(m, proj, e)
                    w = m.quantize_weight(raw, f"{proj}_weight_quantizer", e) if quantized else raw
                    if proj == "gate_up_proj":
                        half = w.shape[0] // 2
                        yield f"{name}.{e}.gate_proj", raw[:half], w[:half] if quantized else None
                        yield f"{name}.{e}.up_proj", raw[half:], w[half:] if quantized else None
                    else:
                        yield f"{name}.{e}.{proj}", raw, w if quantized else None
        elif isinstance(m, QuantModule) and hasattr(m, "weight") and m.weight_quantizer.is_enabled:
            # the weight as its quantizer sees it, (out, in), quantized then laid out as the module holds it (GPT-2's Conv1D: (in, out))
            shown = next(iter(m.weight_groups()))[1][0] if type(m).weight_groups is not QuantModule.weight_groups else m.weight
            w = (m.quantize_weight(shown) if shown is m.weight else m.quantize_weight(shown).t()) if quantized else None
            yield name, m.weight, w


def checkpoint_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Checkpoint name -> (out, in) of every quantized weight of ``model`` as an export writes it (the family's own names:
    Mixtral's experts are ``block_sparse_moe.experts.{e}.w1``), for :func:`reload_export`'s dequantizers."""
    from ..export.layouts import layout_for
    from ..export.plan import walk

    return {it.name: torch.Size(it.shape) for it in walk(model, layout_for(model)) if it.spec is not None}


def _expert_part(name: str) -> bool:
    """Whether ``name`` names one expert's part of a fused-experts module (``<experts>.{e}.gate_proj``)."""
    parts = name.split(".")
    return len(parts) > 3 and parts[-1] in ("gate_proj", "up_proj", "down_proj") and parts[-3] == "experts"


def loaded_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The weight a loaded transformers model holds under checkpoint name ``name`` (experts from their fused tensors)."""
    parts = name.split(".")
    if _expert_part(name):
        experts, e = model.get_submodule(".".join(parts[:-2])), int(parts[-2])
        if parts[-1] == "down_proj":
            return hf_experts.expert_weight(experts, "down_proj", e)
        gu = hf_experts.expert_weight(experts, "gate_up_proj", e)
        half = gu.shape[0] // 2
        return gu[:half] if parts[-1] == "gate_proj" else gu[half:]
    return model.get_submodule(name).weight


def _ulp(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
    """Largest distance in units of the last place of ``dtype`` (fp32 or bf16) between ``a`` and ``b``."""
    a, b = a.to(dtype), b.to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    d = (a.view(bits).long() - b.view(bits).long()).abs()
    d = torch.where((a == 0) & (b == 0), torch.zeros_like(d), d)  # packed codes keep no sign of zero
    return int(d.max()) if d.numel() else 0


def check_weight(res: CheckResult, name: str, ref: torch.Tensor, loaded: nn.Module, scaled: bool = False) -> None:
    """Compare ``loaded``'s weight ``name`` with ``ref`` (fake-quantized; ``scaled``: times a pre_quant_scale)
    under the format's rule; record it in ``res``."""
    try:
        got = loaded_weight(loaded, name).detach()
    except AttributeError:
        res.mismatched.append(f"{name} (absent from the reloaded model)")
        return
    res.compared += 1
    if got.shape != ref.shape:
        res.mismatched.append(f"{name} (shape {tuple(got.shape)} != {tuple(ref.shape)})")
        return
    ref = ref.detach().cpu()
    got = got.cpu().to(ref.dtype)
    ulp = _ulp(got, ref)
    res.max_ulp = max(res.max_ulp, ulp)
    res.scaled += scaled
    rule = SCALED_RULES[res.rule] if scaled else res.rule
    bound = 0 if rule == "exact" else int(rule.rpartition("ulp")[2])
    if (_ulp(got, ref, torch.bfloat16) if rule.startswith("bf16") else ulp) > bound:
        res.mismatched.append(f"{name} ({ulp} ulp, rule {rule})")


def _read_modules(export_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint module -> its tensors by local name, from every safetensors file of ``export_dir``."""
    from safetensors import safe_open

    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(n for n in os.listdir(export_dir) if n.endswith(".safetensors")):
        with safe_open(os.path.join(export_dir, f), "pt") as sf:
            for k in sf.keys():
                mod, _, local = k.rpartition(".")
                by_module.setdefault(mod, {})[local] = sf.get_tensor(k)
    return by_module


def _ct_dequantizer(export_dir: str) -> Callable[[dict, torch.Size, str], torch.Tensor]:
    """compressed-tensors' own decompressor, each module by the format of the config group that targets it (one group, or
    ``mixed-precision``: its name or a ``re:`` pattern among the group's targets)."""
    import re

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(export_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    groups = list(QuantizationConfig.model_validate(qc).config_groups.values())

    def dequantize(t: dict, shape: torch.Size, mod: str) -> torch.Tensor:
        hits = groups if len(groups) == 1 else [g for g in groups if any(
            x == mod or (x.startswith("re:") and re.match(x[3:], mod)) for x in g.targets)]
        if len(hits) != 1:
            raise PipelineError(f"check: {mod}: {len(hits)} compressed-tensors config groups target it; the check reads one")
        compressor = BaseCompressor.get_value_from_registry(hits[0].format or qc["format"])
        return compressor.decompress(t, hits[0])["weight"].float()

    return dequantize


def modelopt_dequantize(fmt: str, t: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """One module's weight of a ModelOpt-format export (its tensors ``t`` by local name) as ModelOpt's own
    qtensor ``dequantize`` gives it, in fp32."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "transformers X is not tested with this modelopt"
        from modelopt.torch.quantization import qtensor

    if fmt in ("modelopt_int4_awq", "modelopt_w4a8_awq"):  # no ModelOpt dequantizer for pack_int4_in_uint8: two rows per byte
        packed = t["weight"]
        codes = torch.stack([packed & 0x0F, packed >> 4], 1).reshape(shape).to(torch.int8)
        codes = torch.where(codes > 7, codes - 16, codes)
        int4 = codes.float() * t["weight_scale"].repeat_interleave(shape[1] // t["weight_scale"].shape[1], dim=1)
        if fmt == "modelopt_int4_awq":
            return int4
        # W4A8: the INT4 stage in FP8 per tensor, as ModelOpt's FP8 qtensor makes it with weight_scale_2
        fp8, _ = qtensor.FP8QTensor.quantize(int4, scales=t["weight_scale_2"])
        return fp8.dequantize(dtype=torch.float32, scale=t["weight_scale_2"])
    if fmt == "modelopt_nvfp4":
        q = qtensor.NVFP4QTensor(shape, torch.float32, t["weight"])
        return q.dequantize(dtype=torch.float32, scale=t["weight_scale"], double_scale=t["weight_scale_2"], block_sizes={-1: 16})
    if fmt == "modelopt_mxfp8":
        return qtensor.MXFP8QTensor(shape, torch.float32, t["weight"]).dequantize(dtype=torch.float32, scale=t["weight_scale"])
    q = qtensor.FP8QTensor(shape, torch.float32, t["weight"])
    if fmt == "modelopt_fp8_pb":
        s = t["weight_scale"]
        return q.dequantize(dtype=torch.float32, scale=s.reshape(s.shape[0], s.shape[2]), block_sizes={-1: 128, -2: 128})
    return q.dequantize(dtype=torch.float32, scale=t["weight_scale"])


#: ModelOpt quant_algo -> the single-algorithm format whose tensors a MIXED_PRECISION layer of it holds
_MODELOPT_ALGOS = {"FP8": "modelopt_fp8", "FP8_PB_WO": "modelopt_fp8_pb", "NVFP4": "modelopt_nvfp4", "W4A16_NVFP4": "modelopt_nvfp4",
                   "NVFP4_AWQ": "modelopt_nvfp4", "MXFP8": "modelopt_mxfp8", "W4A16_AWQ": "modelopt_int4_awq",
                   "W4A8_AWQ": "modelopt_w4a8_awq"}


def _mixed_dequantizer(export_dir: str) -> Callable[[dict, torch.Size, str], torch.Tensor]:
    """ModelOpt MIXED_PRECISION: each layer dequantized by the algorithm ``quantized_layers`` names for it (an export of one
    scheme is the plain config: its ``quant_algo`` for every layer)."""
    with open(os.path.join(export_dir, "hf_quant_config.json")) as f:
        quant = json.load(f)["quantization"]
    layers = quant.get("quantized_layers")

    def dequantize(t: dict, shape: torch.Size, mod: str) -> torch.Tensor:
        algo = quant["quant_algo"] if layers is None else layers.get(mod, {}).get("quant_algo")
        if algo not in _MODELOPT_ALGOS:
            raise PipelineError(f"check: {mod}: quantized_layers names {algo!r}, which the check cannot dequantize")
        return modelopt_dequantize(_MODELOPT_ALGOS[algo], t, shape)

    return dequantize


def _dense_copy(
    export_dir: str, dequantize: Callable[[dict, torch.Size, str], torch.Tensor], shapes: dict[str, torch.Size], out_dir: str
) -> None:
    """A dense checkpoint of the export in ``out_dir``: each quantized weight dequantized by the consumer's own
    code, the other tensors as written; config.json without its quantization_config."""
    from safetensors.torch import save_file

    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    dense = {}
    for mod, t in _read_modules(export_dir).items():
        if mod in shapes and stored_transposed(config.get("model_type"), mod):
            # read as vLLM's GPT-2 loader reads it (``weight`` transposed, the rest as a linear's), held (in, out) again
            w = dequantize(swap_weight(t), shapes[mod][::-1], mod).t().contiguous()
            dense[f"{mod}.weight"] = w * t["pre_quant_scale"].float()[:, None] if "pre_quant_scale" in t else w
            if "bias" in t:
                dense[f"{mod}.bias"] = t["bias"]
        elif mod in shapes:
            w = dequantize(t, shapes[mod], mod)
            # a carried pre_quant_scale multiplies the input: x * p @ W^T == x @ (W * p)^T, as the consumer computes
            dense[f"{mod}.weight"] = w * t["pre_quant_scale"].float() if "pre_quant_scale" in t else w
            if "bias" in t:
                dense[f"{mod}.bias"] = t["bias"]
        else:
            dense.update({f"{mod}.{k}": v for k, v in t.items() if k not in ("k_scale", "v_scale")})
    save_file(dense, os.path.join(out_dir, "model.safetensors"))
    config.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)


def _any_transposed(export_dir: str, modules: Iterable[str]) -> bool:
    """Whether the export stores any of ``modules``' weights (in, out) (GPT-2's Conv1D), by its config's model_type."""
    modules = list(modules)
    if not modules:
        return False
    with open(os.path.join(export_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    return any(stored_transposed(model_type, mod) for mod in modules)


def _hf_fp8_dequantize(t: dict[str, torch.Tensor], _shape: torch.Size, _mod: str) -> torch.Tensor:
    """One module of a Hugging Face FP8 export as transformers' own dequantization op (its CPU path) computes it, in fp32."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(t["weight"], t["weight_scale_inv"], torch.float32)


def reload_export(
    export_dir: str, fmt: str, shapes: dict[str, torch.Size], trust_remote_code: bool, **load: object
) -> tuple[Optional[nn.Module], str, str]:
    """(model, consumer, why-skipped): the export loaded by its consumer as a dense fp32 transformers model
    (HF formats: transformers itself; compressed-tensors and ModelOpt formats: their own dequantization, the
    dense weights then loaded by transformers; weights stored (in, out), GPT-2's, read as vLLM's GPT-2 loader lays
    them out, HF ones by transformers' own FP8 dequantization op); None and the reason when the consumer is not installed.
    ``load``: more ``from_pretrained`` arguments (e.g. ``experts_implementation``)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = dict(dtype=torch.float32, local_files_only=True, trust_remote_code=trust_remote_code, **NO_HUB_KERNELS, **load)
    if fmt.startswith("hf_") and not _any_transposed(export_dir, shapes):
        try:
            return AutoModelForCausalLM.from_pretrained(export_dir, **kwargs).eval(), "transformers from_pretrained", ""
        except ImportError as exc:  # transformers' FP8 loader asks for accelerate when it loads, not when it imports
            return None, fmt, f"its consumer cannot run here ({exc}; pip install quantlib[export])"
    try:
        if fmt.startswith("hf_"):  # GPT-2's Conv1D, which transformers' FP8 loader does not convert (it fails to load)
            dequantize, consumer = _hf_fp8_dequantize, "transformers' Fp8Dequantize (tensors as vLLM's GPT-2 loader reads them)"
        elif fmt.startswith("ct_"):
            dequantize, consumer = _ct_dequantizer(export_dir), "compressed-tensors decompressor"
        else:
            import modelopt.torch.quantization.qtensor  # noqa: F401  (fail here, not per module)

            dequantize, consumer = (lambda t, shape, _mod: modelopt_dequantize(fmt, t, shape)), "ModelOpt qtensor dequantize"
            if fmt == "modelopt_mixed":
                dequantize = _mixed_dequantizer(export_dir)
            elif fmt == "modelopt_int4_awq":
                consumer = "ModelOpt pack_int4_in_uint8 layout unpacked"
            elif fmt == "modelopt_w4a8_awq":
                consumer = "ModelOpt pack_int4_in_uint8 layout unpacked, then ModelOpt's FP8 qtensor"
    except ImportError as exc:
        return None, fmt, f"its consumer is not installed ({exc.name}; pip install quantlib[export])"
    tmp = tempfile.mkdtemp(prefix=".reload-", dir=os.path.dirname(os.path.abspath(export_dir)))
    try:
        _dense_copy(export_dir, dequantize, shapes, tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, **kwargs).eval(), consumer, ""
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def require_passed(res: CheckResult, fmt: str) -> None:
    """Stop the run when the consumer's weights break the format's rule."""
    if res.compared == 0:
        raise PipelineError(f"check: the {fmt} export holds no quantized weight the reloaded model could be compared on")
    if res.mismatched:
        raise PipelineError(
            f"check: {res.consumer} loaded {len(res.mismatched)} of {res.compared} weights of the {fmt} export differently from the "
            "fake-quantized model "
            f"(rule {res.rule}): {', '.join(res.mismatched[:3])}"
        )


def export_folds(model: nn.Module, fmt: str) -> Folds:
    """Where the export put each ``pre_quant_scale`` of ``model``: the plan :func:`export_checkpoint` follows
    (the model itself is unchanged by the export)."""
    from ..export.modules import named_modules
    from ..export.writers import packer

    return plan_folds(model, named_modules(model), packer(fmt).carries_pre_quant_scale, fmt)


def expected_weight(name: str, w: torch.Tensor, folds: Folds) -> tuple[torch.Tensor, bool]:
    """(the weight the consumer's model holds for checkpoint module ``name``, whether a scale changed it): a folded
    scale multiplies the rows (output channels), a carried one the columns (the consumer's ``x * p @ W^T``)."""
    if name not in folds.out and name not in folds.carried:
        return w, False
    w = w.float()
    if name in folds.out:
        w = w * folds.out[name].float().to(w.device)[:, None]
    if name in folds.carried:
        w = w * folds.carried[name].float().to(w.device)[None, :]
    return w, True


@torch.no_grad()
def check_folded_ops(res: CheckResult, model: nn.Module, folds: Folds, loaded: nn.Module, quantized: set[str]) -> None:
    """The ops that took a folded scale and hold no quantized weight (norms, unquantized linears): the consumer's
    tensors must be the export's own ``tensor * p`` per output channel, bit for bit."""
    for name, p in folds.out.items():
        if name in quantized:
            continue
        if _expert_part(name):  # an unquantized expert's up rows (fold_experts): a slice of the fused tensor, no module
            res.compared += 1
            if not torch.equal(loaded_weight(loaded, name).detach().cpu().float(),
                               times_rows(lambda n=name: loaded_weight(model, n).detach(), p)().cpu().float()):
                res.mismatched.append(f"{name}.weight (a folded pre_quant_scale)")
            continue
        mine, theirs = model.get_submodule(name), loaded.get_submodule(name)
        for k in ("weight", "bias"):
            t = getattr(mine, k, None)
            if isinstance(t, torch.Tensor):
                res.compared += 1
                if not torch.equal(getattr(theirs, k).detach().cpu().float(), times_rows(lambda t=t: t.detach(), p)().cpu().float()):
                    res.mismatched.append(f"{name}.{k} (a folded pre_quant_scale)")
