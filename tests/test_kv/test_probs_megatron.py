"""``p_bmm_quantizer`` in Megatron-Core's DotProductAttention: a GPT (local spec) on 2 gloo ranks, at
TP=2 (two of the four heads per rank) and at TP=1.

The model runs with full (non-causal) attention masks, so that P's amax is below 1 and differs between
the heads (a causal row 0 always has P = 1). The reference is an unquantized copy of the model whose
``FusedScaleMaskSoftmax.forward`` records max|P| per layer (MAX-reduced over TP by hand) and then
fake-quantizes P by hand with it; the quantized model's amax and logits must equal it bit for bit. A dist
checkpoint saved at TP=2 restores the p amax at TP=1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from tests.test_kv.test_kv_hf import fp8_by_hand  # noqa: E402
from tests.test_kv.test_kv_megatron import GROUPS, SEED, _save, restored_tp1  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

P_CFG = ql.merge_kv_config(None, [{"quantizer_name": "*p_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}])


def _run_model(model, tokens: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """Logits (gathered over TP) with full attention: the mask masks nothing."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=torch.zeros(1, 1, s, s, dtype=torch.bool),
                     runtime_gather_output=gather).detach().clone()


def _loop(data):
    return lambda model: [_run_model(model, x, gather=False) for x in data]


def _reference(tp: int, data, tokens):
    """(hand amax per layer, each rank's own amax per layer, logits with P fake-quantized by hand)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    model = shims.build_gpt(tp, 1, SEED, num_query_groups=GROUPS)
    layer_of = {id(layer.self_attention.core_attention.scale_mask_softmax): layer.layer_number for layer in model.decoder.layers}
    amax, mode = {}, ["amax"]
    original = FusedScaleMaskSoftmax.forward

    def forward(self, *args, **kwargs):
        probs = original(self, *args, **kwargs)
        n = layer_of[id(self)]
        if mode[0] == "amax":
            a = probs.detach().abs().amax().float()
            amax[n] = torch.maximum(amax.get(n, a), a)
            return probs
        return fp8_by_hand(probs, amax[n])

    FusedScaleMaskSoftmax.forward = forward
    try:
        _loop(data)(model)
        local = {n: a.clone() for n, a in amax.items()}
        for a in amax.values():
            torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
        mode[0] = "quant"
        logits = _run_model(model, tokens)
    finally:
        FusedScaleMaskSoftmax.forward = original
    return amax, local, logits


def _load_tp1(folder: str) -> dict:
    model = restored_tp1(folder)
    out = {}
    for layer in model.decoder.layers:
        q = layer.self_attention.core_attention.p_bmm_quantizer
        assert q.is_enabled
        out[layer.layer_number] = q.amax
    _run_model(model, shims.token_batches(1, 99)[0])  # runs with the restored quantizer
    return out


def _run(rank: int, world: int, folder: str) -> dict:
    out = {}
    for tp in (2, 1):
        shims.set_layout(tp, 1)
        data, tokens = shims.token_batches(4, 1), shims.token_batches(1, 99)[0]
        hand_amax, local_amax, expected = _reference(tp, data, tokens)
        model = shims.build_gpt(tp, 1, SEED, num_query_groups=GROUPS)
        plain = _run_model(model, tokens)
        model = ql.quantize(model, P_CFG, _loop(data), parallel_state=ql.ParallelState.from_megatron())
        got = _run_model(model, tokens)
        amax = {layer.layer_number: layer.self_attention.core_attention.p_bmm_quantizer.amax for layer in model.decoder.layers}
        out[tp] = {
            "amax_equal_hand": amax.keys() == hand_amax.keys() and all(torch.equal(amax[k], hand_amax[k]) for k in hand_amax),
            "logits_equal_hand": torch.equal(got, expected),
            "changed": not torch.equal(got, plain),
            "amax": amax,
            "local": local_amax,
            "logits": got,
        }
        if tp == 2:
            _save(model, folder)
    out["restored_tp1"] = _load_tp1(folder)
    return out


def test_probs_megatron_tp2_logits_equal_hand_fake_quant(tmp_path):
    results = shims.run_distributed(_run, 2, str(tmp_path))
    for rank, res in enumerate(results):
        for tp in (2, 1):
            assert res[tp]["amax_equal_hand"], (rank, tp)
            assert res[tp]["logits_equal_hand"], (rank, tp)
            assert res[tp]["changed"], (rank, tp)
    # at TP=2 each rank saw its own heads (different maxima); the sync gave both the max, which is the
    # TP=1 amax (exact in layer 1, to rounding in layer 2 after the row-parallel sum of layer 1)
    assert any(not torch.equal(results[0][2]["local"][n], results[1][2]["local"][n]) for n in results[0][2]["local"])
    for n, value in results[0][1]["amax"].items():
        assert float(value) < 1.0
        for rank in (0, 1):
            assert torch.equal(results[rank][2]["amax"][n], torch.maximum(results[0][2]["local"][n], results[1][2]["local"][n]))
            torch.testing.assert_close(results[rank][2]["amax"][n], value, rtol=1e-5, atol=0)
    torch.testing.assert_close(results[0][2]["logits"], results[0][1]["logits"], rtol=1e-4, atol=1e-5)
    for rank in (0, 1):
        restored = results[rank]["restored_tp1"]
        assert restored.keys() == results[0][2]["amax"].keys()
        assert all(torch.equal(restored[k], results[0][2]["amax"][k]) for k in restored)


def _export_refused(rank: int, world: int, tmp: str) -> str:
    from quantlib.export import ExportError
    from quantlib.export.megatron_export import export_megatron_checkpoint
    from tests.test_export.test_megatron_kv_export import WEIGHTS

    shims.set_layout(1, 1)
    model = shims.build_gpt(1, 1, SEED)
    cfg = ql.merge_kv_config(WEIGHTS, P_CFG["quant_cfg"][1:])
    ql.quantize(model, cfg, shims.forward_loop(shims.token_batches(1, 1)), parallel_state=ql.ParallelState.from_megatron())
    try:
        export_megatron_checkpoint(model, f"{tmp}/refused", "modelopt_nvfp4", hf_config={})
    except ExportError as exc:
        return str(exc)
    return "not refused"


def test_probs_megatron_export_refused(tmp_path):
    msg = shims.run_distributed(_export_refused, 1, str(tmp_path))[0]
    assert "decoder.layers.0.self_attention.core_attention.p_bmm_quantizer = " in msg, msg
    assert "no export format carries attention-probabilities" in msg, msg
    assert not (tmp_path / "refused").exists()
