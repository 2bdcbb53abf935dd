"""KV-cache quantizers in Megatron-Core's DotProductAttention: a GPT (local spec, GQA with 2 key/value
groups) on 2 gloo ranks, at TP=2 (one group per rank) and at TP=1.

The reference is an unquantized copy of the model whose ``DotProductAttention.forward`` records max|k|,
max|v| per layer (MAX-reduced over TP by hand) and then fake-quantizes k and v by hand with them; the
quantized model's amax and logits must equal it bit for bit. A dist checkpoint saved at TP=2 restores
the k/v amax at TP=1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from quantlib.config import ConfigError  # noqa: E402
from quantlib.formats.nvfp4 import nvfp4_fake_quant  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

SEED, GROUPS = 0, 2
PRESETS = {"fp8": ql.FP8_KV_CFG, "nvfp4": ql.NVFP4_KV_CFG}


def _hand(preset: str, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    if preset == "nvfp4":
        return nvfp4_fake_quant(x.float(), amax).to(x.dtype)
    s = torch.tensor(448.0) / amax
    return (torch.clamp(x.float() * s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * torch.reciprocal(s)).to(x.dtype)


def _reference(preset: str, tp: int, data, tokens):
    """(hand amax per (layer, k|v), logits with k/v fake-quantized by hand) of an unquantized model."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    model = shims.build_gpt(tp, 1, SEED, num_query_groups=GROUPS)
    amax, mode = {}, ["amax"]
    original = DotProductAttention.forward

    def forward(self, query, key, value, *args, **kwargs):
        if mode[0] == "amax":
            for tag, t in (("k", key), ("v", value)):
                a = t.detach().abs().amax().float()
                amax[(self.layer_number, tag)] = torch.maximum(amax.get((self.layer_number, tag), a), a)
        else:
            key = _hand(preset, key, amax[(self.layer_number, "k")])
            value = _hand(preset, value, amax[(self.layer_number, "v")])
        return original(self, query, key, value, *args, **kwargs)

    DotProductAttention.forward = forward
    try:
        with torch.no_grad():
            shims.forward_loop(data)(model)
        for a in amax.values():
            torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
        mode[0] = "quant"
        logits = shims.gpt_logits(model, tokens)
    finally:
        DotProductAttention.forward = original
    return amax, logits


def _save(model, folder: str) -> None:
    from megatron.core import dist_checkpointing

    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), folder)


def restored_tp1(folder: str):
    """A fresh TP=1 model (other weights) configured and loaded from the dist checkpoint in ``folder``."""
    from megatron.core import dist_checkpointing

    from quantlib.plugins.megatron import restore_quantizer_config

    shims.set_layout(1, 1)
    model = restore_quantizer_config(shims.build_gpt(1, 1, SEED + 1, num_query_groups=GROUPS), folder)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), folder))
    return model


def _load_tp1(folder: str) -> dict:
    """The k/v amax of :func:`restored_tp1`."""
    model = restored_tp1(folder)
    out = {}
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        for tag in ("k", "v"):
            q = getattr(core, f"{tag}_bmm_quantizer")
            assert q.is_enabled
            out[f"{core.layer_number}{tag}"] = q.amax
    shims.gpt_logits(model, shims.token_batches(1, 99)[0])  # runs with the restored quantizers
    return out


def _run(rank: int, world: int, preset: str, folder: str) -> dict:
    out = {}
    for tp in (2, 1):
        shims.set_layout(tp, 1)
        data, tokens = shims.token_batches(4, 1), shims.token_batches(1, 99)[0]
        hand_amax, expected = _reference(preset, tp, data, tokens)
        model = shims.build_gpt(tp, 1, SEED, num_query_groups=GROUPS)
        plain = shims.gpt_logits(model, tokens)
        model = ql.quantize(model, ql.merge_kv_config(None, PRESETS[preset]), shims.forward_loop(data),
                            parallel_state=ql.ParallelState.from_megatron())
        got = shims.gpt_logits(model, tokens)
        amax = {}
        for layer in model.decoder.layers:
            core = layer.self_attention.core_attention
            assert type(core).__name__ == "QuantDotProductAttention"
            for tag in ("k", "v"):
                amax[(core.layer_number, tag)] = getattr(core, f"{tag}_bmm_quantizer").amax
        out[tp] = {
            "amax_equal_hand": all(torch.equal(amax[k], hand_amax[k]) for k in hand_amax) and amax.keys() == hand_amax.keys(),
            "logits_equal_hand": torch.equal(got, expected),
            "changed": not torch.equal(got, plain),
            "amax": {f"{k[0]}{k[1]}": v for k, v in amax.items()},
        }
        if tp == 2:
            _save(model, folder)
    out["restored_tp1"] = _load_tp1(folder)
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_kv_megatron_tp2_logits_equal_hand_fake_quant(tmp_path, preset):
    results = shims.run_distributed(_run, 2, preset, str(tmp_path))
    for rank, res in enumerate(results):
        for tp in (2, 1):
            assert res[tp]["amax_equal_hand"], (rank, tp)
            assert res[tp]["logits_equal_hand"], (rank, tp)
            assert res[tp]["changed"], (rank, tp)
    # heads split over TP=2: the synced per-tensor amax is the TP=1 (all heads) amax, on both ranks; exact
    # in layer 1 (its k/v come from column-parallel GEMMs, the same numbers at both layouts), to rounding
    # later (the row-parallel reduction before layer 2 sums in another order at TP=2)
    for key, value in results[0][1]["amax"].items():
        for rank in (0, 1):
            if key.startswith("1"):
                assert torch.equal(results[rank][2]["amax"][key], value), key
            else:
                torch.testing.assert_close(results[rank][2]["amax"][key], value, rtol=1e-5, atol=0)
    # a dist checkpoint saved at TP=2 restores the same k/v amax at TP=1
    for rank in (0, 1):
        restored = results[rank]["restored_tp1"]
        assert restored.keys() == results[0][2]["amax"].keys()
        assert all(torch.equal(restored[k], results[0][2]["amax"][k]) for k in restored)


def _te_free_unreachable(rank: int, world: int) -> str:
    """A KV preset on a model whose core attention is a class quantlib does not register is refused."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    shims.set_layout(1, 1)
    model = shims.build_gpt(1, 1, SEED, num_query_groups=GROUPS)

    class FusedAttention(DotProductAttention):  # stands for TEDotProductAttention (no TE on the CPU)
        pass

    core = model.decoder.layers[1].self_attention.core_attention
    core.__class__ = FusedAttention
    try:
        ql.quantize(model, ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG), shims.forward_loop(shims.token_batches(1, 1)))
    except ConfigError as exc:
        return str(exc)
    return "not refused"


def test_kv_megatron_unreachable_core_attention_refused():
    msg = shims.run_distributed(_te_free_unreachable, 1)[0]
    assert "decoder.layers.1.self_attention.core_attention (FusedAttention)" in msg, msg


def _affine_refused(rank: int, world: int) -> str:
    shims.set_layout(1, 1)
    model = shims.build_gpt(1, 1, SEED, num_query_groups=GROUPS)
    try:
        ql.quantize(model, ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_AFFINE_KV_CFG), shims.forward_loop(shims.token_batches(1, 1)))
    except ConfigError as exc:
        return str(exc)
    return "not refused"


def test_kv_megatron_affine_preset_refused():
    """Megatron's core attention sees [seq, batch, heads, dim]: the preset's bias axes do not fit it (and
    its dist checkpoints carry no bias), so the affine preset is refused, naming the quantizer."""
    msg = shims.run_distributed(_affine_refused, 1)[0]
    assert "decoder.layers.0.self_attention.core_attention.k_bmm_quantizer" in msg and "[seq, batch, heads, dim]" in msg, msg
