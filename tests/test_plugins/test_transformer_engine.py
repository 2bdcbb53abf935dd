"""Transformer Engine plugin: the adapters against the real signatures of TE's autograd functions
(read from TE's pure-Python wheels, which import nothing here), the quantized TE modules driven through
stand-ins built from those signatures, and a GPU test for a machine with TE's binding.

The wheels are downloaded once (``pip download --no-deps``) into the pytest cache
(``.pytest_cache/d/quantlib-te-wheels``); the tests that need them skip, saying why, where that fails.
TE's torch binding cannot be built against a CPU torch, so nothing here imports ``transformer_engine``;
the tests on real TE are in test_te_gpu.py and test_megatron_te_gpu.py (marked ``te`` and ``gpu``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib.nn import GroupedQuantizer, QuantModuleRegistry, TensorQuantizer
from quantlib.plugins import te_adapters as ta
from quantlib.plugins.huggingface import tokens_per_expert_report  # imports nothing from transformers

FP8_INPUT_INT8_WEIGHT = {
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": (4, 3), "axis": None},
                  "default": {"enable": False}},
    "algorithm": "max",
}


from ._te_wheels import WHEELS, call_site, grouped_args, non_tensor_args_fields, real_signature  # noqa: E402


def _splits_for(version: str, splits: list[int]):
    return torch.tensor(splits, dtype=torch.int64) if ta.parse_version(version) >= (2, 17) else list(splits)


def _expert_weights(num: int, out_f: int = 8, in_f: int = 16, seed: int = 0) -> list[torch.Tensor]:
    """Weight i scaled by 2**i: expert i's amax differs from every other's by construction."""
    g = torch.Generator().manual_seed(seed)
    return [(2.0**i) * torch.randn(out_f, in_f, generator=g) for i in range(num)]


# ------------------------------------------------------------------------------ adapters vs the wheels


@pytest.mark.parametrize("version", sorted(WHEELS))
def test_adapter_chosen_by_version_fits_the_real_signature(te_source, version):
    sig = real_signature(te_source(version, "grouped_linear"), "_GroupedLinear")
    adapter = ta.grouped_linear_adapter(version)
    assert adapter.generation == WHEELS[version]
    adapter.check_signature(sig)
    others = [a for a in ta.GROUPED_LINEAR_ADAPTERS if a is not adapter]
    for other in others:
        with pytest.raises(ta.AdapterError):
            other.check_signature(sig)


@pytest.mark.parametrize("version", sorted(WHEELS))
def test_adapter_layout_matches_how_grouped_linear_calls_the_function(te_source, version):
    source = te_source(version, "grouped_linear")
    adapter = ta.grouped_linear_adapter(version)
    assert call_site(source) == (len(adapter.params), "weight_tensors")
    nta = non_tensor_args_fields(source)
    if adapter.splits_item is not None:
        assert nta[adapter.splits_item] == "m_splits"
    else:
        assert "m_splits" not in nta


@pytest.mark.parametrize("version", sorted(WHEELS))
def test_adapter_quantizes_input_and_weight_i_with_member_i(te_source, version):
    source = te_source(version, "grouped_linear")
    sig = real_signature(source, "_GroupedLinear")
    adapter = ta.grouped_linear_adapter(version)
    weights = _expert_weights(3)
    biases = [torch.randn(8) for _ in range(3)]
    inp = torch.randn(10, 16)
    args = grouped_args(sig, non_tensor_args_fields(source), inp, _splits_for(version, [2, 5, 3]), weights + biases)
    sig.bind(None, *args)  # the args fit the real signature

    inq = TensorQuantizer({"num_bits": (4, 3)})
    inq.calibrate(inp)
    wq = GroupedQuantizer([TensorQuantizer({"num_bits": 8, "axis": 0}) for _ in range(3)])
    wq.calibrate(weights)
    new = adapter.quantize_args(args, inq, lambda i, w: wq[i](w))

    call = adapter.locate(args)
    assert torch.equal(new[call.inp], inq(inp))
    for i, pos in enumerate(call.weights):
        assert torch.equal(new[pos], wq[i](weights[i]))
        assert not torch.equal(new[pos], wq[0](weights[i])) or i == 0  # member i's own amax, not the first's
    untouched = [j for j in range(len(args)) if j != call.inp and j not in call.weights]
    assert all(new[j] is args[j] for j in untouched)  # biases, splits, flags: the same objects


@pytest.mark.parametrize("version", sorted(WHEELS))
def test_adapter_rejects_a_single_grouped_weight(te_source, version):
    source = te_source(version, "grouped_linear")
    sig = real_signature(source, "_GroupedLinear")
    adapter = ta.grouped_linear_adapter(version)
    packed = torch.randn(3, 8, 16)  # one (num_gemms, out, in) tensor instead of three matrices
    args = grouped_args(sig, non_tensor_args_fields(source), torch.randn(4, 16), _splits_for(version, [1, 1, 2]),
                        [packed, object(), object()])
    with pytest.raises(ta.AdapterError, match="weight 0"):
        adapter.quantize_args(args, lambda x: x, lambda i, w: w)


@pytest.mark.parametrize("version", sorted(WHEELS))
@pytest.mark.parametrize("module, cls", [("linear", "_Linear"), ("layernorm_linear", "_LayerNormLinear")])
def test_linear_args_found_by_name_in_the_real_signature(te_source, version, module, cls):
    source = te_source(version, module)
    sig = real_signature(source, cls)
    names = [n for n in sig.parameters][1:]
    located = ta.TensorArgs.from_signature(sig)
    assert names[located.inp] == "inp" and names[located.weight] == "weight"
    args = tuple(torch.randn(2, 2) if n in ("inp", "weight") else object() for n in names)
    new = located.quantize_args(args, lambda x: x + 1, lambda w: w * 2)
    assert torch.equal(new[located.inp], args[located.inp] + 1) and torch.equal(new[located.weight], args[located.weight] * 2)
    assert all(new[j] is args[j] for j in range(len(args)) if j not in (located.inp, located.weight))
    if module == "layernorm_linear":  # the norm the input quantizer wraps is a module global
        assert any(name in source for name in ("import apply_normalization", "_apply_normalization,", "    apply_normalization,"))


def test_versions_without_an_adapter_are_refused():
    for version in ("1.11.0", "2.1.0", "2.7.0"):
        with pytest.raises(ta.AdapterError, match="no GroupedLinear adapter"):
            ta.grouped_linear_adapter(version)
    assert ta.grouped_linear_adapter("2.9.0+cu12").generation == "2.8"
    assert ta.grouped_linear_adapter("2.16.1").generation == "2.10"
    assert ta.grouped_linear_adapter("2.25.0.dev0").generation == "2.18"  # newest; the signature check decides


# ------------------------------------------------------------------------------ stand-ins for TE


def fake_te_namespace(sig: inspect.Signature, cls: str = "_GroupedLinear") -> types.ModuleType:
    """A module holding a stand-in for TE's autograd function with exactly the real ``sig``: its forward
    does TE's grouped GEMM in torch (split the input by m_splits, GEMM i with weight i, add bias i) and,
    as TE's does, reaches its helpers through the module global. ``calls`` records apply/forward."""
    ns = types.ModuleType(f"fake_te_{cls}")
    params = [p for p in sig.parameters if p != "ctx" and sig.parameters[p].kind != inspect.Parameter.VAR_POSITIONAL]
    splits = "m_splits" if "m_splits" in params else "non_tensor_args[0]"
    src = (
        f"def forward(ctx, {', '.join(params)}, *weights_and_biases):\n"
        f"    return {cls}._gemms(inp, {splits}, weights_and_biases)\n"
    )
    exec(src, ns.__dict__)

    def gemms(inp, m_splits, weights_and_biases):
        n = len(m_splits)
        sizes = [int(s) for s in m_splits]
        outs = [F.linear(x, w, b) for x, w, b in zip(torch.split(inp, sizes), weights_and_biases[:n], weights_and_biases[n : 2 * n])]
        return torch.cat(outs)

    ns.calls = []
    real_forward = ns.forward

    class Function:
        _gemms = staticmethod(gemms)

        @staticmethod
        def apply(*args):
            ns.calls.append("apply")
            return real_forward(None, *args)

        @staticmethod
        @functools.wraps(real_forward)  # inspect.signature sees the real one
        def forward(ctx, *args):
            ns.calls.append("forward")
            return real_forward(ctx, *args)

    setattr(ns, cls, Function)
    return ns


def fake_grouped_linear_class(ns: types.ModuleType, sig: inspect.Signature, nta: list[str], tensor_splits: bool) -> type:
    """An nn.Module shaped like te.GroupedLinear (num_gemms, weight{i}, bias{i}) whose forward calls the
    stand-in function the way TE's does: ``apply`` with grad, ``forward(None, ...)`` without."""

    class FakeGroupedLinear(nn.Module):
        def __init__(self, num_gemms: int, in_features: int, out_features: int) -> None:
            super().__init__()
            self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
            g = torch.Generator().manual_seed(2)
            for i, w in enumerate(_expert_weights(num_gemms, out_features, in_features)):
                self.register_parameter(f"weight{i}", nn.Parameter(w))
                self.register_parameter(f"bias{i}", nn.Parameter(0.1 * torch.randn(out_features, generator=g)))

        def forward(self, inp, m_splits):
            splits = torch.as_tensor(m_splits, dtype=torch.int64) if tensor_splits else list(m_splits)
            tensors = [getattr(self, f"weight{i}") for i in range(self.num_gemms)] + [getattr(self, f"bias{i}")
                                                                                      for i in range(self.num_gemms)]
            args = grouped_args(sig, nta, inp, splits, tensors)
            ns.fuse_seen = getattr(self, "fuse_wgrad_accumulation", False)  # TE reads it into its function's args here
            fn = ns._GroupedLinear
            return fn.apply(*args) if torch.is_grad_enabled() else fn.forward(None, *args)

    return FakeGroupedLinear


@pytest.fixture
def registered():
    """``registered(original, mixin)`` registers for the test's duration."""
    done = []

    def register(original: type, mixin: type) -> None:
        QuantModuleRegistry.register(original)(mixin)
        done.append(original)

    yield register
    for original in done:
        QuantModuleRegistry.unregister(original)


@pytest.fixture(params=sorted(WHEELS))
def grouped(request, te_source, registered):
    """(FakeGroupedLinear class, its namespace, version) for a TE generation, registered with the
    plugin's grouped mixin bound to the stand-in and to the adapter chosen for the version."""
    version = request.param
    source = te_source(version, "grouped_linear")
    sig = real_signature(source, "_GroupedLinear")
    ns = fake_te_namespace(sig)
    cls = fake_grouped_linear_class(ns, sig, non_tensor_args_fields(source), ta.parse_version(version) >= (2, 17))
    adapter = ta.grouped_linear_adapter(version)
    assert list(inspect.signature(ns.forward).parameters) == list(sig.parameters)
    registered(cls, type("_QuantFakeGrouped", (ta.QuantTEGroupedLinearBase,), {"te_namespace": ns, "te_adapter": adapter}))
    return cls, ns, version


class SeparateExperts(nn.Module):
    """The same experts as separate nn.Linear modules: expert i takes rows of split i."""

    def __init__(self, grouped: nn.Module) -> None:
        super().__init__()
        self.experts = nn.ModuleList()
        for i in range(grouped.num_gemms):
            lin = nn.Linear(grouped.in_features, grouped.out_features)
            lin.weight.data.copy_(getattr(grouped, f"weight{i}").data)
            lin.bias.data.copy_(getattr(grouped, f"bias{i}").data)
            self.experts.append(lin)

    def forward(self, inp, m_splits):
        return torch.cat([e(x) for e, x in zip(self.experts, torch.split(inp, list(m_splits)))])


def _batches(n: int = 3, splits: tuple[int, ...] = (3, 5, 1, 3)) -> list[tuple[torch.Tensor, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(sum(splits), 16, generator=g), list(splits)) for _ in range(n)]


def _loop(data):
    def forward_loop(model):
        for x, s in data:
            model(x, s)

    return forward_loop


def test_grouped_linear_matches_separate_linears(grouped):
    cls, ns, _ = grouped
    data = _batches()
    model = ql.quantize(cls(4, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(data))
    ref = ql.quantize(SeparateExperts(cls(4, 16, 8)), FP8_INPUT_INT8_WEIGHT, _loop(data))
    assert isinstance(model.weight_quantizer, GroupedQuantizer) and len(model.weight_quantizer) == 4
    amaxes = [m.amax for m in model.weight_quantizer]
    for i in range(4):
        assert torch.equal(amaxes[i], ref.experts[i].weight_quantizer.amax)
        assert torch.equal(amaxes[i], getattr(model, f"weight{i}").detach().abs().amax(dim=1, keepdim=True))
    for i in range(1, 4):  # expert i is scaled by 2**i: its amax is never the first expert's
        assert not torch.equal(amaxes[i], amaxes[0])
    # One input quantizer for the group: the max over every split (what the expert-group sync of
    # docs/design.md §5 gives separate expert linears).
    shared = torch.stack([e.input_quantizer.amax for e in ref.experts]).amax()
    assert torch.equal(model.input_quantizer.amax, shared)
    for e in ref.experts:
        e.input_quantizer.amax = shared
    x, s = _batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(x, s), ref(x, s))
    assert ns.calls[-1] == "forward"  # no grad: TE calls _GroupedLinear.forward(None, ...)
    assert model.tokens_per_expert.tolist() == [9, 15, 3, 9]


def test_expert_without_tokens_gets_its_own_weight_amax(grouped):
    cls, _, _ = grouped
    model = ql.quantize(cls(4, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(_batches(splits=(3, 5, 0, 4))))
    assert model.tokens_per_expert.tolist() == [9, 15, 0, 12]
    assert torch.equal(model.weight_quantizer[2].amax, model.weight2.detach().abs().amax(dim=1, keepdim=True))
    assert tokens_per_expert_report(model, warn=False) == {"": [9, 15, 0, 12]}
    ql.calibrate(model, forward_loop=_loop(_batches(1)))  # a new calibration counts from zero
    assert model.tokens_per_expert.tolist() == [3, 5, 1, 3]


def test_grouped_linear_grad_path_quantizes_and_passes_gradients(grouped):
    cls, ns, _ = grouped
    model = ql.quantize(cls(4, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(_batches()))
    x, s = _batches(1)[0]
    with torch.no_grad():
        expected = model(x, s)
    x = x.clone().requires_grad_(True)
    out = model(x, s)
    assert ns.calls[-1] == "apply" and torch.equal(out, expected)
    out.sum().backward()
    assert x.grad is not None and all(getattr(model, f"weight{i}").grad is not None for i in (0, 1, 3))
    assert isinstance(ns._GroupedLinear, type)  # the stand-in function is back in place


def test_function_is_restored_when_forward_raises(grouped):
    cls, ns, _ = grouped
    model = ql.quantize(cls(2, 16, 8), FP8_INPUT_INT8_WEIGHT, None)
    original = ns._GroupedLinear
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 16), [1, 1])  # the splits do not cover the input
    assert ns._GroupedLinear is original


def test_grouped_linear_save_restore_round_trip(grouped, tmp_path):
    cls, _, _ = grouped
    data = _batches()
    model = ql.quantize(cls(4, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(data))
    ql.save(model, tmp_path / "q.pt")
    fresh = ql.restore(cls(4, 16, 8), tmp_path / "q.pt")
    for a, b in zip(model.weight_quantizer, fresh.weight_quantizer):
        assert torch.equal(a.amax, b.amax)
    assert torch.equal(fresh.input_quantizer.amax, model.input_quantizer.amax)
    x, s = data[0]
    with torch.no_grad():
        assert torch.equal(fresh(x, s), model(x, s))


def _with_main_grad(model: nn.Module, megatron_ddp: bool) -> None:
    """Give each weight the fp32 ``main_grad`` (and, as Megatron's DDP does, ``grad_added_to_main_grad``) TE's fused
    wgrad accumulation writes into."""
    for i in range(model.num_gemms):
        w = getattr(model, f"weight{i}")
        w.main_grad = torch.full(w.shape, 0.25, dtype=torch.float32)  # accumulated into, not written over
        if megatron_ddp:
            w.grad_added_to_main_grad = False


@pytest.mark.parametrize("megatron_ddp", [True, False])
def test_fused_wgrad_accumulates_the_straight_through_gradient_into_main_grad(grouped, megatron_ddp):
    """fuse_wgrad_accumulation=True: each weight's gradient, clipped by the straight-through estimator exactly as
    without it, is added to weight.main_grad; weight.grad gets TE's dummy (zeros) under Megatron's DDP, else nothing."""
    cls, ns, _ = grouped
    # static per-tensor INT8 weight amax at half the weights' max: the estimator's clip mask is not all ones
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": None, "pass_through_bwd": False},
                         "*input_quantizer": {"num_bits": (4, 3), "axis": None}, "default": {"enable": False}},
           "algorithm": "max"}  # fmt: skip
    data = _batches()
    plain, fused = (ql.quantize(cls(4, 16, 8), cfg, _loop(data)) for _ in range(2))
    for m in (plain, fused):
        for q in m.weight_quantizer:
            q.amax = q.amax / 2
    x, s = _batches(1)[0]
    plain(x, s).square().sum().backward()
    fused.fuse_wgrad_accumulation = True
    _with_main_grad(fused, megatron_ddp)
    fused(x, s).square().sum().backward()
    assert ns.fuse_seen is False and fused.fuse_wgrad_accumulation is True  # TE ran unfused; the flag is back
    for i in range(4):
        w, ref = getattr(fused, f"weight{i}"), getattr(plain, f"weight{i}").grad
        assert (ref == 0).any() and (ref != 0).any(), i  # clipped somewhere, not everywhere
        assert torch.equal(w.main_grad, 0.25 + ref), i
        if megatron_ddp:
            assert w.grad_added_to_main_grad is True and torch.equal(w.grad, torch.zeros_like(w)), i
        else:
            assert w.grad is None, i
    assert torch.equal(fused.bias0.grad, plain.bias0.grad)  # biases keep their ordinary gradient


@pytest.mark.parametrize("first", [True, False])
def test_fused_wgrad_writes_over_main_grad_on_megatrons_first_microbatch(grouped, first):
    """As TE does with is_first_microbatch=True, which Megatron's TE wrappers pass from their own attribute."""
    cls, _, _ = grouped
    data = _batches(1, (2, 2))
    plain, fused = (ql.quantize(cls(2, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(data)) for _ in range(2))
    x, s = data[0]
    plain(x, s).sum().backward()
    fused.fuse_wgrad_accumulation = True
    fused.is_first_microbatch = first
    _with_main_grad(fused, True)
    fused(x, s).sum().backward()
    for i in range(2):
        grad = getattr(plain, f"weight{i}").grad
        assert torch.equal(getattr(fused, f"weight{i}").main_grad, grad if first else 0.25 + grad), i


def test_fused_wgrad_without_main_grad_is_refused_and_inference_needs_none(grouped):
    cls, _, _ = grouped
    model = ql.quantize(cls(2, 16, 8), FP8_INPUT_INT8_WEIGHT, None)
    model.fuse_wgrad_accumulation = True
    with pytest.raises(RuntimeError, match="fuse_wgrad_accumulation=True but the weight has no main_grad"):
        model(torch.randn(2, 16), [1, 1])
    assert model.fuse_wgrad_accumulation is True
    with torch.no_grad():
        model(torch.randn(2, 16), [1, 1])  # inference does not accumulate gradients


class DelayedScaling:  # TE's recipes are told apart by class name (transformer_engine.common.recipe needs TE's binding)
    pass


class Float8BlockScaling:
    pass


class MXFP8BlockScaling:
    pass


class NVFP4BlockScaling:
    pass


def test_te_autocast_recipes_run_or_are_refused_by_name(grouped):
    cls, _, _ = grouped
    model = ql.quantize(cls(2, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(_batches(1, (1, 1))))
    model.fp8 = True  # what TE's prepare_forward sets under its autocast, with the recipe in fp8_meta
    for recipe in (DelayedScaling(), Float8BlockScaling()):
        model.fp8_meta = {"recipe": recipe}
        model(torch.randn(2, 16), [1, 1])
    for recipe in (MXFP8BlockScaling(), NVFP4BlockScaling()):
        model.fp8_meta = {"recipe": recipe}
        with pytest.raises(RuntimeError, match=f"QuantFakeGroupedLinear: .*autocast recipe {type(recipe).__name__} is not supported"):
            model(torch.randn(2, 16), [1, 1])


def test_delayed_wgrad_compute_is_refused(grouped):
    cls, _, _ = grouped
    model = ql.quantize(cls(2, 16, 8), FP8_INPUT_INT8_WEIGHT, None)
    model.wgrad_store = types.SimpleNamespace(delay_wgrad_compute=lambda: True)
    with pytest.raises(RuntimeError, match="delay_wgrad_compute=True is not supported"):
        model(torch.randn(2, 16), [1, 1])
    with torch.no_grad():
        model(torch.randn(2, 16), [1, 1])


def test_single_grouped_weight_is_refused_at_conversion(grouped):
    cls, _, _ = grouped
    m = cls(2, 16, 8)
    m.single_grouped_weight = True
    with pytest.raises(NotImplementedError, match="single_grouped_weight"):
        ql.quantize(m, FP8_INPUT_INT8_WEIGHT, None)


# ------------------------------------------------------------------------------ Linear / LayerNormLinear


def fake_linear_namespace(sig: inspect.Signature, cls: str) -> types.ModuleType:
    """A stand-in for ``_Linear`` or ``_LayerNormLinear`` with the real ``sig``; the latter normalizes
    through the module global ``apply_normalization`` as TE does."""
    ns = types.ModuleType(f"fake_te_{cls}")
    params = [p for p in sig.parameters if p != "ctx"]
    norm = "    inp = apply_normalization(inp, ln_weight, ln_bias)[0]\n" if cls == "_LayerNormLinear" else ""
    ns.F = F
    exec(f"def forward(ctx, {', '.join(params)}):\n{norm}    return F.linear(inp, weight)\n", ns.__dict__)
    ns.apply_normalization = lambda x, w, b: (F.layer_norm(x, x.shape[-1:], w, b), None, None)
    forward = ns.forward
    setattr(ns, cls, type(cls, (), {"apply": staticmethod(lambda *a: forward(None, *a)), "forward": staticmethod(forward)}))
    ns.params = params
    return ns


def fake_linear_class(ns: types.ModuleType, cls_name: str) -> type:
    """An nn.Module shaped like te.Linear / te.LayerNormLinear calling the stand-in function by name."""

    class FakeTELinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.weight = nn.Parameter(torch.randn(8, 16))
            self.weight_names = ["weight"]
            self.ln_weight, self.ln_bias = nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))
            self.parallel_mode = "column"

        def forward(self, inp):
            values = {"inp": inp, "weight": self.weight, "ln_weight": self.ln_weight, "ln_bias": self.ln_bias}
            return getattr(ns, cls_name).apply(*(values.get(p) for p in ns.params))

    return FakeTELinear


@pytest.mark.parametrize("version", ["1.13.0", "2.20.2"])
@pytest.mark.parametrize("layernorm", [False, True])
def test_te_linear_matches_nn_linear(te_source, registered, version, layernorm):
    cls_name, module = ("_LayerNormLinear", "layernorm_linear") if layernorm else ("_Linear", "linear")
    sig = real_signature(te_source(version, module), cls_name)
    ns = fake_linear_namespace(sig, cls_name)
    FakeTELinear = fake_linear_class(ns, cls_name)

    base = ta.QuantTELayerNormLinearBase if layernorm else ta.QuantTELinearBase
    attrs = {"te_namespace": ns, "te_args": ta.TensorArgs.from_signature(sig), "te_norm_name": "apply_normalization"}
    registered(FakeTELinear, type("_QuantFake", (base,), attrs))

    data = [torch.randn(6, 16) for _ in range(2)]
    model = ql.quantize(FakeTELinear(), FP8_INPUT_INT8_WEIGHT, lambda m: [m(x) for x in data])
    assert model.parallel_role == "column"
    ref_lin = nn.Linear(16, 8, bias=False)
    ref_lin.weight.data.copy_(model.weight.data)
    norm = (lambda x: F.layer_norm(x, (16,))) if layernorm else (lambda x: x)
    ref = ql.quantize(ref_lin, FP8_INPUT_INT8_WEIGHT, lambda m: [m(norm(x)) for x in data])
    assert torch.equal(model.weight_quantizer.amax, ref.weight_quantizer.amax)
    assert torch.equal(model.input_quantizer.amax, ref.input_quantizer.amax)  # LayerNormLinear: of the normalized input
    with torch.no_grad():
        assert torch.equal(model(data[0]), ref(norm(data[0])))
    assert ns.apply_normalization.__name__ == "<lambda>"  # the norm global is restored


# ------------------------------------------------------------------------------ the plugin module


@pytest.fixture
def plugin_with(te_source, monkeypatch):
    """``plugin_with(version, signatures_of=version)``: imports quantlib.plugins.transformer_engine
    against a stand-in ``transformer_engine`` package of TE ``version`` whose autograd functions have the
    real signatures of TE ``signatures_of``; returns (plugin module, stand-in te.pytorch)."""
    loaded = []

    def load(version: str, signatures_of: str = ""):
        src = signatures_of or version
        gsrc = te_source(src, "grouped_linear")
        gsig = real_signature(gsrc, "_GroupedLinear")
        grouped_ns = fake_te_namespace(gsig)
        linear_ns = fake_linear_namespace(real_signature(te_source(src, "linear"), "_Linear"), "_Linear")
        ln_ns = fake_linear_namespace(real_signature(te_source(src, "layernorm_linear"), "_LayerNormLinear"), "_LayerNormLinear")
        pytorch = types.ModuleType("transformer_engine.pytorch")
        pytorch.GroupedLinear = fake_grouped_linear_class(grouped_ns, gsig, non_tensor_args_fields(gsrc), ta.parse_version(src) >= (2, 17))
        pytorch.Linear = fake_linear_class(linear_ns, "_Linear")
        pytorch.LayerNormLinear = fake_linear_class(ln_ns, "_LayerNormLinear")
        module = types.ModuleType("transformer_engine.pytorch.module")
        module.grouped_linear, module.linear, module.layernorm_linear = grouped_ns, linear_ns, ln_ns
        te = types.ModuleType("transformer_engine")
        te.__version__, te.pytorch, pytorch.module = version, pytorch, module
        for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", pytorch), ("transformer_engine.pytorch.module",
                                                                                                module),
                          ("transformer_engine.pytorch.module.grouped_linear", grouped_ns), ("transformer_engine.pytorch.module.linear",
                                                                                             linear_ns),
                          ("transformer_engine.pytorch.module.layernorm_linear", ln_ns)):  # fmt: skip
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.delitem(sys.modules, "quantlib.plugins.transformer_engine", raising=False)
        plugin = importlib.import_module("quantlib.plugins.transformer_engine")
        loaded.append(pytorch)
        return plugin, pytorch

    yield load
    sys.modules.pop("quantlib.plugins.transformer_engine", None)
    ql.plugins._loaded.discard("quantlib.plugins.transformer_engine")  # convert() saw the stand-in "installed"
    if hasattr(ql.plugins, "transformer_engine"):
        delattr(ql.plugins, "transformer_engine")
    for pytorch in loaded:
        for cls in (pytorch.GroupedLinear, pytorch.Linear, pytorch.LayerNormLinear):
            QuantModuleRegistry.unregister(cls)


@pytest.mark.parametrize("version", sorted(WHEELS))
def test_plugin_registers_the_adapter_of_the_installed_version(plugin_with, version):
    plugin, te = plugin_with(version)
    assert plugin.te_version() == version
    mixin = QuantModuleRegistry._mixins[te.GroupedLinear]
    assert mixin.te_adapter is ta.grouped_linear_adapter(version)
    assert mixin.te_namespace is sys.modules["transformer_engine.pytorch.module.grouped_linear"]
    data = _batches()
    model = ql.quantize(te.GroupedLinear(4, 16, 8), FP8_INPUT_INT8_WEIGHT, _loop(data))
    assert type(model).__name__ == "QuantFakeGroupedLinear"
    for i in range(4):
        assert torch.equal(model.weight_quantizer[i].amax, getattr(model, f"weight{i}").detach().abs().amax(dim=1, keepdim=True))
    for cls in (te.Linear, te.LayerNormLinear):
        lin = ql.quantize(cls(), FP8_INPUT_INT8_WEIGHT, lambda m: m(torch.randn(4, 16)))
        assert lin.weight_quantizer.amax.shape == (8, 1) and lin.input_quantizer.amax is not None


@pytest.mark.parametrize("version, signatures_of", [("2.5.0", "2.20.2"), ("2.20.2", "2.14.0")])
def test_plugin_refuses_grouped_linear_it_cannot_adapt(plugin_with, version, signatures_of, caplog):
    _, te = plugin_with(version, signatures_of)
    with pytest.raises(NotImplementedError, match="cannot quantize FakeGroupedLinear with this Transformer Engine"):
        ql.quantize(te.GroupedLinear(2, 16, 8), FP8_INPUT_INT8_WEIGHT, None)
    assert "te.GroupedLinear of TE" in caplog.text
    ql.quantize(te.Linear(), FP8_INPUT_INT8_WEIGHT, None)  # the others still work
