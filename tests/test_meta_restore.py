"""Restore into a model built on the meta device, as large models are built before their weights load:
``with torch.device("meta"): model = build()``, ``ql.restore``, ``model.to_empty(device=...)``,
``model.load_state_dict(weights)``. The restored amax must survive ``to_empty`` (a meta tensor holds no
values), giving the outputs of the same flow on a CPU-built model bit for bit; saving a meta model works
where its amax have values and fails clearly where they have none."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib import CheckpointError, TensorQuantizer
from quantlib.model_quant import iter_leaf_quantizers

KINDS = ["mlp", "conv"]


def plain_weights(model: nn.Module) -> dict:
    """The weights of an unquantized model, as a user's weight file holds them (no quantizer state)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def on_meta(build, *args) -> nn.Module:
    with torch.device("meta"):
        return build(*args)


def materialise(model: nn.Module, weights: dict, strict: bool = False) -> nn.Module:
    model.to_empty(device="cpu")
    model.load_state_dict(weights, strict=strict)
    return model


@pytest.fixture
def saved(make_model, make_data, make_loop, tmp_path):
    """``saved(kind, preset)``: (checkpoint path, the quantized model it was saved from)."""

    def write(kind: str, name: str):
        model = ql.quantize(make_model(kind), ql.PRESETS[name], make_loop(make_data(kind)))
        path = tmp_path / f"{kind}-{name}.pt"
        ql.save(model, path)
        return path, model

    return write


@pytest.mark.parametrize("kind", KINDS)
def test_restore_into_a_meta_built_model_keeps_every_amax(kind, preset_name, saved, make_model, make_data):
    path, source = saved(kind, preset_name)
    weights = plain_weights(make_model(kind))
    cpu = ql.restore(make_model(kind), path)
    cpu.load_state_dict(weights, strict=False)
    meta = ql.restore(on_meta(make_model, kind), path)
    assert all(q.amax.is_meta for _, q in iter_leaf_quantizers(meta) if q.amax is not None)
    materialise(meta, weights)
    for (name, a), (_, b) in zip(iter_leaf_quantizers(cpu), iter_leaf_quantizers(meta)):
        assert (a.amax is None) == (b.amax is None), name
        if a.amax is not None:
            assert b.amax.device.type == "cpu" and torch.equal(a.amax, b.amax), name
    x = make_data(kind, 1, seed=11)[0]
    with torch.no_grad():
        assert torch.equal(meta(x), cpu(x))
        assert torch.equal(meta(x), source(x))


@pytest.mark.parametrize("name", ["INT8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "W4A8_AWQ_BETA_CFG"])
def test_quantize_on_meta_then_restore_keeps_every_amax(name, saved, make_model, make_data):
    path, source = saved("mlp", name)
    meta = ql.quantize(on_meta(make_model, "mlp"), ql.PRESETS[name])  # weight amax calibrated on meta: no values
    ql.restore(meta, path)
    materialise(meta, plain_weights(make_model("mlp")))
    x = make_data("mlp", 1, seed=11)[0]
    with torch.no_grad():
        assert torch.equal(meta(x), source(x))


def test_full_state_dict_loads_into_a_meta_built_restored_model_strictly(saved, make_model, make_data):
    path, source = saved("mlp", "INT8_DEFAULT_CFG")
    meta = ql.restore(on_meta(make_model, "mlp"), path)
    materialise(meta, source.state_dict(), strict=True)
    x = make_data("mlp", 1, seed=11)[0]
    with torch.no_grad():
        assert torch.equal(meta(x), source(x))


def test_grouped_quantizer_members_keep_their_amax_through_meta(two_experts, tmp_path):
    src = ql.quantize(two_experts(), ql.INT8_WEIGHT_ONLY_CFG)
    ql.save(src, tmp_path / "g.pt")
    meta = ql.restore(on_meta(two_experts), tmp_path / "g.pt")
    materialise(meta, plain_weights(two_experts()))
    for i in range(2):
        assert torch.equal(meta.weight_quantizer[i].amax, src.weight_quantizer[i].amax)
    assert not torch.equal(meta.weight_quantizer[0].amax, meta.weight_quantizer[1].amax)


def test_save_of_a_restored_meta_model_writes_the_restored_amax(saved, make_model, tmp_path):
    path, source = saved("mlp", "FP8_DEFAULT_CFG")
    meta = ql.restore(on_meta(make_model, "mlp"), path)
    ql.save(meta, tmp_path / "again.pt")
    fresh = ql.restore(make_model("mlp"), tmp_path / "again.pt")
    held = [(n, a, b) for (n, a), (_, b) in zip(iter_leaf_quantizers(source), iter_leaf_quantizers(fresh)) if a.amax is not None]
    assert len(held) == 4
    for name, a, b in held:
        assert torch.equal(a.amax, b.amax), name


def test_save_of_a_model_quantized_on_meta_fails_clearly_and_writes_nothing(make_model, tmp_path):
    meta = ql.quantize(on_meta(make_model, "mlp"), ql.INT8_DEFAULT_CFG)
    with pytest.raises(CheckpointError, match=r"fc1\.weight_quantizer: _amax is on the meta device and holds no values"):
        ql.save(meta, tmp_path / "q.pt")
    assert list(tmp_path.iterdir()) == []


def test_save_of_a_meta_model_with_dynamic_quantizers_only_works(make_model, tmp_path):
    meta = ql.quantize(on_meta(make_model, "mlp"), ql.MXFP8_DEFAULT_CFG)  # MX: no amax to hold
    ql.save(meta, tmp_path / "q.pt")
    fresh = ql.restore(make_model("mlp"), tmp_path / "q.pt")
    assert all(q.amax is None for _, q in iter_leaf_quantizers(fresh))


def test_amax_calibrated_on_meta_is_dropped_when_materialised_not_left_uninitialised(make_model):
    meta = ql.quantize(on_meta(make_model, "mlp"), ql.INT8_DEFAULT_CFG)
    assert meta.fc1.weight_quantizer.amax.is_meta
    meta.to_empty(device="cpu")
    assert meta.fc1.weight_quantizer.amax is None  # uncalibrated (uses each tensor's amax), not garbage
    assert "fc1.weight_quantizer._amax" not in meta.state_dict()


def test_amax_survives_a_round_trip_through_meta():
    q = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=torch.tensor([[1.5], [2.5]]))
    q.to("meta")
    assert q.amax.is_meta and torch.equal(q.amax_values, torch.tensor([[1.5], [2.5]]))
    q.to_empty(device="cpu")
    assert torch.equal(q.amax, torch.tensor([[1.5], [2.5]]))
    assert q.amax_values is q.amax


def test_amax_set_on_a_meta_quantizer_is_kept_for_materialisation():
    q = TensorQuantizer({"num_bits": 8}, amax=torch.tensor(1.0)).to("meta")
    q.amax = torch.tensor(4.0)
    q.to_empty(device="cpu")
    assert torch.equal(q.amax, torch.tensor(4.0))


def test_reset_amax_on_meta_forgets_the_held_values():
    q = TensorQuantizer({"num_bits": 8}, amax=torch.tensor(3.0)).to("meta")
    q.reset_amax()
    q.amax = torch.empty((), device="meta")  # e.g. calibrated again on meta weights
    q.to_empty(device="cpu")
    assert q.amax is None


def test_restore_into_a_meta_built_hf_moe_model_gives_the_cpu_flow_logits(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from quantlib.plugins import huggingface as hf

    hf.refresh()  # registers the fused experts of the modeling code imported above
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                      experts_implementation="eager")  # fmt: skip

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(cfg).eval()

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    source = ql.quantize(build(), ql.FP8_DEFAULT_CFG, lambda m: m(ids))
    ql.save(source, tmp_path / "moe.pt")
    weights = plain_weights(build())
    cpu = ql.restore(build(), tmp_path / "moe.pt")
    cpu.load_state_dict(weights, strict=False)
    meta = ql.restore(on_meta(build), tmp_path / "moe.pt")
    materialise(meta, weights)
    persistent = cpu.state_dict()
    for name, buf in cpu.named_buffers():  # rotary tables: from_pretrained recomputes them, as done here
        if name not in persistent:
            module, _, attr = name.rpartition(".")
            setattr(meta.get_submodule(module), attr, buf.clone())
    experts = meta.model.layers[0].mlp.experts.gate_up_proj_weight_quantizer
    assert len({float(m.amax.max()) for m in experts}) == len(experts)  # each expert its own amax
    with torch.no_grad():
        logits = meta(ids).logits
        assert torch.equal(logits, cpu(ids).logits)
        assert torch.equal(logits, source(ids).logits)
