"""Training quantized Transformer Engine modules on real TE (a CUDA GPU and TE's torch binding; skipped elsewhere):
under TE's autocast with each FP8 recipe of sm_90, and with ``fuse_wgrad_accumulation=True``.

Under autocast TE casts quantlib's fake-quantized weight and input to FP8 again with the recipe's own scales
(quantlib.plugins.te_training says where that rounds twice): the quantized module's output and gradients must equal,
bit for bit, those of an unquantized module of the same class given the fake-quantized weights and inputs under the
same recipe. With fused wgrad accumulation the weight's gradient (after quantlib's straight-through estimator) must
land in ``weight.main_grad``, equal to the gradient of the same module built without it.
"""

from __future__ import annotations

import pytest
import torch

import quantlib as ql
from tests.test_plugins import te_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.te]
_WHY = te_gpu.gpu_and_te()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402

IN, OUT, GEMMS = 256, 128, 4
SPLITS = [128, 128, 0, 256]  # multiples of 128: FP8 block scaling's grouped GEMM takes them; expert 2 gets no token
DTYPE = torch.bfloat16
KINDS = ["linear", "layernorm_linear", "grouped"]
#: under each recipe: per-tensor FP8, FP8 128x128 weight blocks + 1x128 input tiles, NVFP4, and weights alone (inputs
#: left to TE's cast)
PRESETS = {"fp8": ql.FP8_DEFAULT_CFG, "fp8_block": ql.FP8_BLOCKWISE_CFG, "nvfp4": ql.NVFP4_DEFAULT_CFG,
           "fp8_block_weights": ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG}  # fmt: skip


def build(kind: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "linear":
        return te.Linear(IN, OUT, bias=True, params_dtype=DTYPE, device="cuda", **kwargs)
    if kind == "layernorm_linear":
        return te.LayerNormLinear(IN, OUT, bias=True, params_dtype=DTYPE, device="cuda", **kwargs)
    m = te.GroupedLinear(GEMMS, IN, OUT, bias=True, params_dtype=DTYPE, device="cuda", **kwargs)
    with torch.no_grad():
        for i in range(GEMMS):
            getattr(m, f"weight{i}").mul_(2.0**i)
    return m


def batch(kind: str, seed: int = 1, scale: float = 1.0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(SPLITS), IN, device="cuda", dtype=DTYPE, generator=g) * scale
    return (x, SPLITS) if kind == "grouped" else (x,)


def quantized(kind: str, preset: str, **kwargs) -> torch.nn.Module:
    data = [batch(kind, seed=s, scale=1 + s) for s in range(2)]
    return ql.quantize(build(kind, **kwargs), PRESETS[preset], lambda m: [m(*a) for a in data])


def weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [module.get_parameter(n) for n in te_gpu.weight_names(module)]


@pytest.mark.parametrize("recipe", sorted(te_gpu.recipes()))
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_runs_tes_fp8_gemm_on_the_fake_quantized_tensors(kind, preset, recipe):
    """Forward and backward under TE's autocast = an unquantized TE module holding the fake-quantized weights, fed the
    fake-quantized input, under the same recipe (each module's first autocast step: same delayed-scaling history)."""
    model = quantized(kind, preset)
    ref = build(kind, seed=3)
    te_gpu.load_fake_quant_weights(ref, model)
    args = batch(kind, seed=7)
    x = args[0].clone().requires_grad_(True)
    with te_gpu.autocast(te_gpu.recipes()[recipe]):
        out = te_gpu.first(model(x, *args[1:]))
    xr = (x if kind == "layernorm_linear" else model.input_quantizer(x)).detach().requires_grad_(True)
    with te_gpu.autocast(te_gpu.recipes()[recipe]):
        if kind == "layernorm_linear":
            with te_gpu.quantized_norm_output(ref, model.input_quantizer):
                expected = te_gpu.first(ref(xr, *args[1:]))
        else:
            expected = te_gpu.first(ref(xr, *args[1:]))
    assert out.dtype == DTYPE and torch.isfinite(out).all()
    assert torch.equal(out, expected), f"{kind} {preset} {recipe}: max diff {(out.float() - expected.float()).abs().max().item()}"
    g = torch.Generator(device="cuda").manual_seed(9)
    dy = torch.randn(out.shape, device="cuda", dtype=DTYPE, generator=g)
    out.backward(dy)  # outside autocast, as in training: TE keeps the forward's recipe
    expected.backward(dy)
    for w, r in zip(weights(model), weights(ref)):
        if w.grad is None:
            assert r.grad is None or not r.grad.any()
            continue
        assert torch.equal(w.grad, r.grad), f"{kind} {preset} {recipe}: weight gradient differs"
    assert torch.equal(x.grad, xr.grad)  # (the input quantizer's straight-through gradient passes everywhere)
    with torch.no_grad():  # the double rounding, for the report: TE's FP8 GEMM against quantlib's bf16 fake quant alone
        bf16 = te_gpu.first(model(*args)).float()
        err = ((out.float() - bf16).norm() / bf16.norm()).item()
    print(f"\n[te28] {kind} {preset} {recipe}: |autocast - bf16 fake quant| / |bf16 fake quant| = {err:.4f}")


def _fused_quantized(kind: str, fused: bool) -> torch.nn.Module:
    """Per-tensor FP8 weights whose calibrated amax is halved: the straight-through estimator clips the gradient
    where |w| > amax (pass_through_bwd off), so routing it around the estimator would show."""
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "axis": None, "pass_through_bwd": False},
                         "*input_quantizer": {"num_bits": (4, 3), "axis": None}, "default": {"enable": False}},
           "algorithm": "max"}  # fmt: skip
    data = [batch(kind, seed=s) for s in range(2)]
    model = ql.quantize(build(kind, fuse_wgrad_accumulation=fused), cfg, lambda m: [m(*a) for a in data])
    with torch.no_grad():
        for q in te_gpu.weight_members(model):
            q.amax = q.amax / 2
    return model


@pytest.mark.parametrize("recipe", [None, "current", "block"])
@pytest.mark.parametrize("first", [None, True, False], ids=["no_first", "first", "not_first"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_wgrad_accumulation_puts_the_gradient_in_main_grad(kind, first, recipe):
    """fuse_wgrad_accumulation=True: main_grad += the non-fused module's weight gradient (written over on TE's first
    microbatch); weight.grad is TE's dummy for Megatron's DDP (grad_added_to_main_grad set)."""
    plain, fused = _fused_quantized(kind, False), _fused_quantized(kind, True)
    params = te_gpu.give_main_grad(fused, fill=0.25)
    args = batch(kind, seed=7)
    kw = {} if first is None else {"is_first_microbatch": first}
    g = torch.Generator(device="cuda").manual_seed(9)
    dy = torch.randn(sum(SPLITS), OUT, device="cuda", dtype=DTYPE, generator=g)
    for m in (plain, fused):
        if recipe is None:
            out = te_gpu.first(m(*args, **kw))
        else:
            with te_gpu.autocast(te_gpu.recipes()[recipe]):
                out = te_gpu.first(m(*args, **kw))
        out.backward(dy)
    assert fused.fuse_wgrad_accumulation is True
    for i, (w, ref) in enumerate(zip(weights(fused), weights(plain))):
        if kind == "grouped" and SPLITS[i] == 0:
            continue
        grad = ref.grad.float()
        assert (grad == 0).any() and grad.any(), i  # clipped somewhere, not everywhere
        expected = grad if first is True else 0.25 + grad
        assert torch.equal(w.main_grad, expected), f"{kind} weight {i}: max diff {(w.main_grad - expected).abs().max().item()}"
        assert w.grad_added_to_main_grad is True and w.grad is not None and not w.grad.any()
    bias = next(p for n, p in fused.named_parameters() if n.startswith("bias"))
    assert bias.grad is not None and not bias.grad_added_to_main_grad and any(p is bias for p in params)  # biases: in .grad


@pytest.mark.parametrize("kind", KINDS)
def test_fused_wgrad_qat_steps_reduce_the_loss(kind):
    model = ql.quantize(build(kind, fuse_wgrad_accumulation=True), ql.FP8_BLOCKWISE_CFG, lambda m: m(*batch(kind)))
    args = batch(kind)
    torch.manual_seed(5)
    target = torch.randn(sum(SPLITS), OUT, device="cuda", dtype=DTYPE)
    params = te_gpu.give_main_grad(model)
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(10):
        te_gpu.zero_main_grad(params)
        loss = torch.nn.functional.mse_loss(te_gpu.first(model(*args)).float(), target.float())
        loss.backward()
        assert all(w.grad_added_to_main_grad for i, w in enumerate(weights(model)) if kind != "grouped" or SPLITS[i])
        te_gpu.finish_main_grad(params)
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], losses
