"""Layer-by-layer calibration of tiny transformers Llama and Qwen3-MoE models (no downloads): the amax of
every quantizer equal in-memory calibration bit for bit, with layers offloaded to disk, and after a crash
and a resume."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.calib.sequential import SequentialOptions, offload_to_disk  # noqa: E402
from quantlib.model_quant import iter_leaf_quantizers  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=48, **COMMON)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                            num_experts_per_tok=2, experts_implementation="eager", **COMMON)),
}


def _with_head_input(cfg: dict) -> dict:
    """``cfg`` with the KV cache and the head's input quantizer on (a quantizer outside the layers)."""
    merged = ql.merge_kv_config(cfg, ql.FP8_KV_CFG)
    merged["quant_cfg"].append({"quantizer_name": "lm_head.input_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}})
    return merged


CONFIGS = {"fp8": _with_head_input(ql.FP8_DEFAULT_CFG), "nvfp4": _with_head_input(ql.NVFP4_DEFAULT_CFG),
           "int8": _with_head_input(ql.INT8_DEFAULT_CFG)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().eval()


def data(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (2, 6 + 3 * i), generator=g) for i in range(n)]  # batches of different lengths


def loop_over(batches):
    def loop(model):
        for x in batches:
            model(x)

    return loop


def amax_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax for n, q in iter_leaf_quantizers(model) if q.amax is not None}


def assert_same_amax(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    bad = [n for n in expected if not torch.equal(got[n].cpu(), expected[n].cpu())]
    assert not bad, bad[:5]


@pytest.fixture(scope="module")
def in_memory() -> dict:
    """In-memory amax by (model, config)."""
    out = {}
    for name in MODELS:
        for cfg in CONFIGS:
            out[(name, cfg)] = amax_of(ql.quantize(build(name), CONFIGS[cfg], loop_over(data())))
    return out


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_amax_equal_in_memory(in_memory, name, cfg):
    model = ql.quantize(build(name), CONFIGS[cfg], loop_over(data()), sequential=True)
    got = amax_of(model)
    assert "lm_head.input_quantizer" in got and "model.layers.3.self_attn.v_bmm_quantizer" in got
    assert_same_amax(got, in_memory[(name, cfg)])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_from_disk_offload_equal_in_memory(tmp_path, in_memory, name):
    model = build(name)
    files = offload_to_disk(model, str(tmp_path))
    assert len(files) == 4 and all(os.path.exists(f) for f in files)
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())
    model = ql.quantize(model, CONFIGS["fp8"], loop_over(data()), sequential=SequentialOptions(offload_folder=str(tmp_path)))
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())  # back on disk after calibration
    assert_same_amax(amax_of(model), in_memory[(name, "fp8")])


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_resume_after_crash_equal_in_memory(tmp_path, in_memory, name):
    resume = str(tmp_path / "resume.pt")
    opts = {"resume_file": resume}
    model = build(name)

    def crash(*_):
        raise _Boom("killed while calibrating layer 2")

    handle = model.model.layers[2].self_attn.register_forward_pre_hook(crash)
    with pytest.raises(_Boom):
        ql.quantize(model, CONFIGS["fp8"], loop_over(data()), sequential=opts)
    handle.remove()
    assert os.path.exists(resume)
    assert torch.load(resume, weights_only=True)["done"] == 2  # layers 0 and 1 finished

    fresh = build(name)  # as a new process would: a fresh model, the same config and data
    calls = {0: 0, 1: 0, 2: 0}
    for i in calls:
        fresh.model.layers[i].self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    fresh = ql.quantize(fresh, CONFIGS["fp8"], loop_over(data()), sequential=opts)
    assert calls[0] == 0 and calls[1] == 0 and calls[2] == 3  # finished layers never ran again
    assert not os.path.exists(resume)  # a finished run leaves no resume file
    assert_same_amax(amax_of(fresh), in_memory[(name, "fp8")])


def test_sequential_resume_file_of_another_config_refused(tmp_path):
    resume = str(tmp_path / "resume.pt")
    model = build("llama")
    model.model.layers[3].self_attn.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Boom("stop")))
    with pytest.raises(_Boom):
        ql.quantize(model, CONFIGS["fp8"], loop_over(data()), sequential={"resume_file": resume})
    with pytest.raises(ValueError, match="another model, config or algorithm"):
        ql.quantize(build("llama"), CONFIGS["int8"], loop_over(data()), sequential={"resume_file": resume})


def test_sequential_stops_every_pass_before_the_head():
    """Only the last pass reaches the head: each earlier one stops at the layer that records its inputs."""
    model = build("llama")
    heads = []
    model.lm_head.register_forward_pre_hook(lambda *_: heads.append(1))
    ql.quantize(model, CONFIGS["fp8"], loop_over(data()), sequential=True)
    assert len(heads) == len(data())


def test_sequential_needs_forward_loop_and_layers():
    with pytest.raises(ValueError, match="forward_loop"):
        ql.quantize(build("llama"), CONFIGS["fp8"], None, sequential=True)
    with pytest.raises(ValueError, match="not an nn.ModuleList"):
        ql.quantize(build("llama"), CONFIGS["fp8"], loop_over(data()), sequential={"layers": "model.norm"})
    with pytest.raises(ValueError, match="unknown option"):
        ql.quantize(build("llama"), CONFIGS["fp8"], loop_over(data()), sequential={"layer": "model.layers"})


def test_sequential_refuses_past_key_values():
    model = build("llama")
    out = model(data(1)[0], use_cache=True)
    past = getattr(out, "cache", None) or out.past_key_values

    def loop(m):
        m(data(1)[0][:, :2], cache=past, use_cache=True)

    with pytest.raises(ValueError, match="past tokens"):
        ql.quantize(model, CONFIGS["fp8"], loop, sequential=True)


def test_sequential_with_device_and_disk_equal_in_memory(tmp_path, in_memory):
    """The device path (layers loaded from disk straight to ``device``, cached inputs moved there); on the
    CPU here, on the GPU where one exists."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build("qwen3_moe")
    offload_to_disk(model, str(tmp_path))
    for name, child in list(model.model.named_children()) + [("lm_head", model.lm_head)]:
        if name != "layers":  # the resident part (the layers' weights are on meta, on disk)
            child.to(device)
    batches = [x.to(device) for x in data()]
    model = ql.quantize(model, CONFIGS["fp8"], loop_over(batches), sequential={"offload_folder": str(tmp_path), "device": device})
    if device == "cpu":
        assert_same_amax(amax_of(model), in_memory[("qwen3_moe", "fp8")])
    else:  # the GPU's GEMMs differ from the CPU's: compare with in-memory calibration on the GPU
        assert_same_amax(amax_of(model), amax_of(ql.quantize(build("qwen3_moe").to(device), CONFIGS["fp8"], loop_over(batches))))
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())


def test_sequential_refuses_a_loop_that_changes_its_batches():
    calls = []

    def shuffled(m):
        calls.append(1)
        for x in data()[:: 1 if len(calls) % 2 else -1]:  # every other call in reverse order (other lengths)
            m(x)

    with pytest.raises(RuntimeError, match="same batches in the same order"):
        ql.quantize(build("llama"), CONFIGS["fp8"], shuffled, sequential=True)


def test_sequential_keeps_instance_forwards_of_wrappers():
    """A forward set on the instance (as accelerate's hooks do) is the same object after calibration."""
    model = build("llama")
    wrapped = [model, model.model.layers[1]]
    for m in wrapped:
        m.forward = (lambda original: lambda *a, **k: original(*a, **k))(m.forward)
    before = [m.__dict__["forward"] for m in wrapped]
    ql.quantize(model, CONFIGS["fp8"], loop_over(data()), sequential=True)
    assert [m.__dict__.get("forward") for m in wrapped] == before
    assert "forward" not in model.model.layers[0].__dict__  # an unwrapped layer gets its class's forward back


_NO_GPU = not torch.cuda.is_available()
_ON_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(_NO_GPU, reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", _ON_DEVICES)
def test_sequential_runs_resident_layers_on_device_one_at_a_time(in_memory, device):
    """Layers held on the CPU, the rest of the model on ``device`` (``SequentialOptions(device=...)``): each
    layer runs on ``device`` alone, once per batch, and goes back to the CPU with its quantizers; the amax
    equal in-memory calibration on ``device`` bit for bit."""
    model = build("llama")
    for name, child in list(model.model.named_children()) + [("lm_head", model.lm_head)]:
        if name != "layers":
            child.to(device)
    batches = [x.to(device) for x in data()]
    layers = model.model.layers
    runs = []  # (layer index, the device type of every layer's first weight) when a layer's attention runs
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: runs.append((i, [m.input_layernorm.weight.device.type for m in layers])))
    model = ql.quantize(model, CONFIGS["fp8"], loop_over(batches), sequential=SequentialOptions(device=device))
    assert [i for i, _ in runs] == [i for i in range(len(layers)) for _ in batches]  # each layer once per batch, in order
    assert all(where[i] == device for i, where in runs)
    if device != "cpu":  # only the running layer is on the GPU
        assert all(where.count(device) == 1 for _, where in runs)
    assert all(t.device.type == "cpu" for t in layers.parameters())
    layer_amax = [q.amax for _, q in iter_leaf_quantizers(layers) if q.amax is not None]
    assert len(layer_amax) == 4 * 16 and all(a.device.type == "cpu" for a in layer_amax)
    if device == "cpu":
        expected = in_memory[("llama", "fp8")]
    else:  # the GPU's GEMMs differ from the CPU's: in-memory calibration on the GPU
        expected = amax_of(ql.quantize(build("llama").to(device), CONFIGS["fp8"], loop_over(batches)))
    assert_same_amax(amax_of(model), expected)
