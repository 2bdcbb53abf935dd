"""Megatron's Transformer Engine wrappers (TELinear, TEColumnParallelLinear, TERowParallelLinear,
TELayerNormColumnParallelLinear, TEColumn/RowParallelGroupedLinear).

TE's torch binding cannot be built against a CPU torch, so the wrappers themselves only run where TE
imports (:func:`test_te_wrappers_quantize_and_checkpoint`, skipped elsewhere). What the plugin adds to a
grouped linear -- GEMM i is global expert ``ep_rank * num_gemms + i``, its amax and config saved at
that index of the expert axis -- is TE-free and is tested here on a stand-in grouped linear: saved at
EP=2 (2 GEMMs per rank), loaded at EP=1 (4 GEMMs per rank).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from quantlib.nn import GroupedQuantizer, QuantModuleRegistry  # noqa: E402
from quantlib.plugins import megatron as qm  # noqa: E402
from quantlib.plugins.te_adapters import QuantTEGroupedLinearBase  # noqa: E402
from tests.test_plugins import (
    megatron_shims as shims,  # noqa: E402
    te_gpu,  # noqa: E402
)

NUM_EXPERTS, OUT, IN = 4, 8, 16
INT8_W_FP8_IN = {
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": (4, 3)}, "default": {"enable": False}},
    "algorithm": "max",
    "expert_input_policy": "skip",  # calibrated on weights only: the test sets the input amax
}


class StandInGroupedLinear(nn.Module):
    """What the plugin sees of Megatron's TEColumnParallelGroupedLinear: ``num_gemms`` weights
    ``weight{i}``, the process groups in ``_pg_collection`` and ``_tp_group``, and a
    ``sharded_state_dict`` that saves weight i at expert ``ep_rank * num_gemms + i``."""

    def __init__(self, num_gemms: int) -> None:
        from megatron.core import parallel_state as mpu

        super().__init__()
        self.num_gemms = num_gemms
        self.config = SimpleNamespace(gated_linear_unit=False)
        self._pg_collection = SimpleNamespace(ep=mpu.get_expert_model_parallel_group(), expt_dp=mpu.get_expert_data_parallel_group())
        self._tp_group = mpu.get_expert_tensor_parallel_group()
        first = mpu.get_expert_model_parallel_rank() * num_gemms
        full = shims.global_value("experts.linear_fc1.weight", (NUM_EXPERTS, OUT, IN), 0)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(full[first + i].clone()))
        # as Megatron's TEGroupedLinear registers its key-normalizing and _extra_state-merging hooks: bound
        # to the module by weak reference (with_module=True), so conversion must rebind them (issue 14)
        self.loads = 0
        self._register_load_state_dict_pre_hook(type(self)._count_load, with_module=True)

    def _count_load(self, state_dict, prefix, *args) -> None:
        self.loads += 1

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.parallel_state import get_expert_data_parallel_rank, get_expert_model_parallel_rank

        first = get_expert_model_parallel_rank() * self.num_gemms
        return {
            f"{prefix}weight{i}": ShardedTensor.from_rank_offsets(
                f"{prefix}weight",
                getattr(self, f"weight{i}"),
                (0, first + i, NUM_EXPERTS),
                replica_id=(0, 0, get_expert_data_parallel_rank()),
                prepend_axis_num=1,
            )
            for i in range(self.num_gemms)
        }


def _register() -> None:
    if not QuantModuleRegistry.is_registered(StandInGroupedLinear):
        mixin = type("_QuantStandInGroupedLinear", (qm._TEColumnGroupedMixin, QuantTEGroupedLinearBase), {})
        QuantModuleRegistry.register(StandInGroupedLinear, "test.StandInGroupedLinear")(mixin)


def _grouped_worker(rank: int, world: int, folder: str) -> dict:
    from megatron.core import dist_checkpointing

    _register()
    shims.set_layout(1, 2)  # EP=2: experts 0, 1 on rank 0 and 2, 3 on rank 1
    model = ql.quantize(StandInGroupedLinear(2), INT8_W_FP8_IN, forward_loop=None)
    model.input_quantizer.amax = torch.tensor(3.0)  # as the EP sync leaves it: one value per layer
    assert model.expert_offset == 2 * rank and model.parallel_role == "column" and model.is_expert
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), folder)

    shims.set_layout(1, 1)  # EP=1: all four experts on each rank
    fresh = qm.restore_quantizer_config(StandInGroupedLinear(4), folder)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), folder))
    q = fresh.weight_quantizer
    return {
        "loads": fresh.loads,
        "grouped": isinstance(q, GroupedQuantizer) and len(q) == NUM_EXPERTS,
        "weight_amax": [m.amax.clone() for m in q],
        "axis": [m.axis for m in q],
        "input_amax": fresh.input_quantizer.amax.clone(),
        "names": [m._qname for m in q],
    }


@pytest.mark.megatron
@pytest.mark.distributed
def test_grouped_linear_experts_restore_at_another_expert_parallel_size(tmp_path):
    out = shims.run_distributed(_grouped_worker, 2, str(tmp_path / "ckpt"), timeout=120)
    full = shims.global_value("experts.linear_fc1.weight", (NUM_EXPERTS, OUT, IN), 0)
    expected = [w.abs().amax(dim=1, keepdim=True) for w in full]
    for got in out:
        assert got["grouped"] and got["axis"] == [(0,)] * NUM_EXPERTS and got["loads"] == 1
        for e in range(NUM_EXPERTS):
            assert torch.equal(got["weight_amax"][e], expected[e]), e
        assert got["input_amax"].item() == 3.0
        assert got["names"] == [f"weight_quantizer.{e}" for e in range(NUM_EXPERTS)]


def test_extra_state_splits_per_expert_and_merges_back():
    state = {
        "quantlib_schema": qm.EXTRA_STATE_SCHEMA,
        "quantizers": {
            "input_quantizer": {"type": "tensor", "attrs": {"num_bits": 8}, "amax_shape": []},
            "weight_quantizer": {
                "type": "grouped",
                "members": [{"type": "tensor", "attrs": {"num_bits": i}, "amax_shape": [2, 1]} for i in (4, 8)],
            },
        },
    }
    pieces = qm.split_extra_state(state, 2)
    assert [p["quantizers"]["weight_quantizer"]["members"][0]["attrs"]["num_bits"] for p in pieces] == [4, 8]
    assert all(p["quantizers"]["input_quantizer"] == state["quantizers"]["input_quantizer"] for p in pieces)
    assert qm.merge_extra_states(pieces) == state


# ------------------------------------------------------------------------------------ with TE


def _te_available() -> bool:
    try:
        from megatron.core.extensions import transformer_engine as mte

        return bool(mte.HAVE_TE) and torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.te
@pytest.mark.megatron
@pytest.mark.gpu
@pytest.mark.skipif(not _te_available(), reason="needs Transformer Engine's torch binding and a GPU (TE cannot import on a CPU-only torch)")
def test_te_wrappers_quantize_and_checkpoint(tmp_path):
    """A TE-spec GPT (TELayerNormColumnParallelLinear, TERowParallelLinear, TEColumn/RowParallelGroupedLinear
    experts) on one GPU: every wrapper is quantized, calibration fills every amax, and a dist checkpoint
    restores the amax and the logits into a fresh model."""
    created = te_gpu.init_megatron_tp1()
    try:
        _te_spec_gpt_round_trip(tmp_path)
    finally:
        te_gpu.release_megatron(created)


def _te_spec_gpt_round_trip(tmp_path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    def build():
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
        config = shims.gpt_config(1, 1, use_cpu_initialization=False, moe_grouped_gemm=True)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shims.VOCAB, max_sequence_length=shims.SEQ).cuda().eval()

    tokens = [t.cuda() for t in shims.token_batches(2, 1)]

    def logits(m):
        b, s = tokens[0].shape
        with torch.no_grad():
            return m(tokens[0], torch.arange(s, device="cuda").expand(b, s), attention_mask=None)

    def loop(m):
        for t in tokens:
            b, s = t.shape
            m(t, torch.arange(s, device="cuda").expand(b, s), attention_mask=None)

    model = ql.quantize(build(), ql.FP8_DEFAULT_CFG, loop)
    assert {"TEColumnParallelGroupedLinear", "TELayerNormColumnParallelLinear", "TERowParallelLinear"} <= set(qm.TE_REGISTERED)
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, ql.QuantModule)}
    assert {
        "QuantTELayerNormColumnParallelLinear",
        "QuantTERowParallelLinear",
        "QuantTEColumnParallelGroupedLinear",
        "QuantTERowParallelGroupedLinear",
    } <= kinds
    enabled = [(n, q) for n, q in ql.model_quant.iter_leaf_quantizers(model) if q.is_enabled]
    assert enabled and all(q.amax is not None and bool(torch.isfinite(q.amax).all()) for _, q in enabled)
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    fresh = qm.restore_quantizer_config(build(), str(tmp_path))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for (n, q), (_, r) in zip(enabled, [(n, q) for n, q in ql.model_quant.iter_leaf_quantizers(fresh) if q.is_enabled]):
        assert torch.equal(q.amax, r.amax), n
    assert torch.equal(logits(model), logits(fresh))
