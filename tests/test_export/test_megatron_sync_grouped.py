"""The Megatron sync of grouped expert GEMMs (TEGroupedMLP: ``linear_fc1`` / ``linear_fc2`` holding ``weight{j}`` for
local expert j, quantized by quantlib's TE GroupedLinear mixin with weight-quantizer member j) on gloo ranks: each rank's
stream equals, part for part and bit for bit, that of the same model with SequentialMLP experts, at TP1 and TP2xEP2.

TE cannot run here (its binding needs CUDA torch), so the grouped experts are a module with the parameters and
attributes of TE's GroupedLinear that the sync reads (``num_gemms``, ``weight{j}``, ``parallel_mode``) and TEGroupedMLP's
``num_local_experts``, converted by the real mixin; the sync never runs a forward. The GPU test on real TE is
test_megatron_sync_te_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
import quantlib as ql  # noqa: E402
from quantlib.nn import QuantModuleRegistry  # noqa: E402
from quantlib.plugins import te_adapters as ta  # noqa: E402
from tests.test_export._export_models import bit_equal  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

CASES = {"modelopt_nvfp4": ql.NVFP4_DEFAULT_CFG, "ct_int8": ql.INT8_WEIGHT_ONLY_CFG, "hf_fp8_block": ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG}
MOE = dict(gated_linear_unit=True, normalization="RMSNorm", activation_func=torch.nn.functional.silu, hidden_size=128,
           moe_ffn_hidden_size=128, ffn_hidden_size=128)  # fmt: skip
#: layout -> (ranks, attention heads, formats): one 128-wide head at TP1 keeps q / k / v whole 128-row blocks (FP8 128x128)
LAYOUTS = {"tp1": (1, 1, tuple(CASES)), "tp2ep2": (4, 2, ("modelopt_nvfp4", "ct_int8"))}


class GroupedGEMMs(nn.Module):
    """What the sync and the file export read of TE's GroupedLinear: ``num_gemms`` weights ``weight{j}`` (this rank's
    shards), the parallel mode, and the global index of GEMM 0 (Megatron's TE wrapper gives it: quantlib's mixin)."""

    def __init__(self, weights: list[torch.Tensor], parallel_mode: str, expert_offset: int) -> None:
        super().__init__()
        self.num_gemms, self.parallel_mode, self.expert_offset = len(weights), parallel_mode, expert_offset
        self.out_features, self.in_features = weights[0].shape
        for j, w in enumerate(weights):
            self.register_parameter(f"weight{j}", nn.Parameter(w.detach().clone()))


class GroupedExperts(nn.Module):
    """TEGroupedMLP's layout of a SequentialMLP's local experts."""

    def __init__(self, sequential: nn.Module) -> None:
        super().__init__()
        from megatron.core import parallel_state

        local = list(sequential.local_experts)
        self.num_local_experts = len(local)
        offset = parallel_state.get_expert_model_parallel_rank() * len(local)
        self.linear_fc1 = GroupedGEMMs([e.linear_fc1.weight for e in local], "column", offset)
        self.linear_fc2 = GroupedGEMMs([e.linear_fc2.weight for e in local], "row", offset)


def build(tp: int, ep: int, heads: int, grouped: bool) -> nn.Module:
    """The 2-layer, 4-expert GPT (RoPE, RMSNorm, SwiGLU), weights independent of the layout; ``grouped``: its
    experts in TEGroupedMLP's layout."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=shims.gpt_config(tp, ep, num_attention_heads=heads, **MOE), transformer_layer_spec=spec, vocab_size=shims.VOCAB,
                     max_sequence_length=shims.SEQ, position_embedding_type="rope").eval()  # fmt: skip
    shims.init_global_weights(model, 0)
    if grouped:
        for layer in model.decoder.layers:
            layer.mlp.experts = GroupedExperts(layer.mlp.experts)
    return model


def weight_only(preset: dict) -> dict:
    """``preset``'s weight quantizer alone (router and output layer off)."""
    return {"quant_cfg": {"*weight_quantizer": preset["quant_cfg"]["*weight_quantizer"], "*router*": {"enable": False},
                          "*output_layer*": {"enable": False}, "default": {"enable": False}}, "algorithm": "max"}  # fmt: skip


def _compare(rank: int, world: int, layout: str) -> list[str]:
    from quantlib.export.megatron_sync import megatron_sync_tensors

    QuantModuleRegistry.register(GroupedGEMMs)(type("_QuantGroupedGEMMs", (ta.QuantTEGroupedLinearBase,), {}))
    tp, ep = shims.LAYOUTS[layout]
    shims.set_layout(tp, ep)
    _, heads, formats = LAYOUTS[layout]
    bad = []
    for fmt in formats:
        preset = CASES[fmt]
        sequential, grouped = build(tp, ep, heads, False), build(tp, ep, heads, True)
        for model in (sequential, grouped):
            ql.quantize(model, weight_only(preset), None, parallel_state=ql.ParallelState.from_megatron())
        assert sum(type(m).__name__ == "QuantGroupedGEMMs" for m in grouped.modules()) == 4
        for experts in ("per_expert", "stacked"):
            want = {p.name: p for p in megatron_sync_tensors(sequential, fmt, experts=experts)}
            got = {p.name: p for p in megatron_sync_tensors(grouped, fmt, experts=experts)}
            if sorted(got) != sorted(want):
                bad.append(f"{layout} {fmt} {experts} rank {rank}: names differ {sorted(set(got) ^ set(want))[:4]}")
                continue
            for name, p in want.items():
                q = got[name]
                if not (bit_equal(q.tensor, p.tensor) and q.splits == p.splits and q.replica == p.replica):
                    bad.append(f"{layout} {fmt} {experts} rank {rank}: {name}")
    return bad


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grouped_expert_stream_equals_the_sequential_mlp_stream(layout):
    results = shims.run_distributed(_compare, LAYOUTS[layout][0], layout, timeout=400)
    assert [b for r in results for b in r] == []


def _first_expert_off(rank: int, world: int) -> list:
    from quantlib.export.megatron_export import _specs

    QuantModuleRegistry.register(GroupedGEMMs)(type("_QuantGroupedGEMMs", (ta.QuantTEGroupedLinearBase,), {}))
    shims.set_layout(1, 1)
    model = build(1, 1, 1, True)
    ql.quantize(model, weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), None, parallel_state=ql.ParallelState.from_megatron())
    model.decoder.layers[0].mlp.experts.linear_fc1.weight_quantizer[0].disable()
    return sorted(e for layer, module, e in _specs(model) if layer == 0 and module == "mlp.experts.experts.linear_fc1")


def test_grouped_experts_with_the_first_member_off_keep_the_others_quantized():
    # a grouped quantizer's is_enabled reads its first member alone: the file export's plan skipped every GEMM of the
    # grouped linear, which it then wrote unquantized though the model fake-quantizes experts 1-3 (the GPU test
    # test_megatron_sync_te_gpu.py runs the file export itself on TE's GroupedLinear)
    assert shims.run_distributed(_first_expert_off, 1, timeout=300) == [[1, 2, 3]]
