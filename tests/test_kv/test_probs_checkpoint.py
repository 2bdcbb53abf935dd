"""``p_bmm_quantizer`` in quantlib checkpoints: a save / restore round trip, and schema 5 (which added
it): a schema-4 golden checkpoint (``tests/data/v4_llama.pt``, written before attention modules had a
``p_bmm_quantizer``) migrates through ``migrate_v4_to_v5`` and restores."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib import checkpoint as ckpt  # noqa: E402
from tests._scripts import load_golden_writer  # noqa: E402
from tests.test_kv.test_kv_hf import batches, build, forward_loop  # noqa: E402
from tests.test_kv.test_probs_hf import P_RULE  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
ATTN = "model.layers.0.self_attn."


def _golden_v4():
    return load_golden_writer(4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_probs_restore_round_trip(tmp_path, name):
    model = build(name, "sdpa")
    fresh = copy.deepcopy(model)
    model = ql.quantize(model, ql.merge_kv_config(ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG), [P_RULE]), forward_loop(batches()))
    ql.save(model, tmp_path / "q.pt")
    fresh = ql.restore(fresh, tmp_path / "q.pt")
    for a, b in zip(model.model.layers, fresh.model.layers):
        pa, pb = a.self_attn.p_bmm_quantizer, b.self_attn.p_bmm_quantizer
        assert pb.is_enabled and pb.spec == pa.spec and torch.equal(pa.amax, pb.amax)
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(model(x).logits, fresh(x).logits)


def test_migrate_v4_to_v5_adds_a_disabled_probs_quantizer_to_attention_only():
    assert ckpt.MIGRATIONS[4] is ckpt.migrate_v4_to_v5
    state = torch.load(os.path.join(DATA, "v4_llama.pt"), weights_only=True)
    assert state["schema"] == 4 and ATTN + "p_bmm_quantizer" not in state["quantizers"]
    v5 = ckpt.migrate_v4_to_v5(state)
    assert v5["schema"] == 5 and ATTN + "p_bmm_quantizer" not in state["quantizers"]  # input untouched
    assert set(v5["quantizers"]) - set(state["quantizers"]) == {ATTN + "p_bmm_quantizer"}
    p = v5["quantizers"][ATTN + "p_bmm_quantizer"]
    assert p["type"] == "tensor" and p["attrs"]["enable"] is False and p["_amax"] is None
    assert all(v5["quantizers"][k] is v for k, v in state["quantizers"].items())
    mlp = torch.load(os.path.join(DATA, "v3_mlp.pt"), weights_only=True)  # no attention: nothing added
    assert ckpt.migrate(mlp)["quantizers"].keys() == mlp["quantizers"].keys()


def test_golden_v4_checkpoint_without_probs_quantizer_restores():
    """The schema-4 file restores (strict) into the golden model: the attention gets a disabled
    p_bmm_quantizer, and every quantizer and the logits equal the current code's calibration of the same
    model on the same data. Without the migration the same file is refused (the bump is needed)."""
    golden = _golden_v4()
    restored = ql.restore(golden.build(), os.path.join(DATA, "v4_llama.pt"))
    data = golden.calibration_data()
    with torch.no_grad():
        now = ql.quantize(golden.build(), golden.config(), lambda m: [m(x) for x in data])
    assert not restored.model.layers[0].self_attn.p_bmm_quantizer.is_enabled
    a, b = ckpt.quantizer_state(restored)["quantizers"], ckpt.quantizer_state(now)["quantizers"]
    assert a.keys() == b.keys()
    for k in a:
        # schema 4 clipped the straight-through gradient: migrated, it still does (migrate_v5_to_v6)
        assert a[k]["attrs"]["pass_through_bwd"] is False and b[k]["attrs"]["pass_through_bwd"] is True, k
        assert a[k]["attrs"] | {"pass_through_bwd": True} == b[k]["attrs"], k
        assert (a[k]["_amax"] is None) == (b[k]["_amax"] is None) and (a[k]["_amax"] is None
                                                                       or torch.equal(a[k]["_amax"], b[k]["_amax"])), k
    assert a[ATTN + "k_bmm_quantizer"]["_amax"] is not None
    x = batches(1, seed=9)[0] % 32
    with torch.no_grad():
        assert torch.equal(restored(x).logits, now(x).logits)
    state = torch.load(os.path.join(DATA, "v4_llama.pt"), weights_only=True)
    with pytest.raises(ql.CheckpointError, match=r"1 quantizer\(s\) missing from it \['model\.layers\.0\.self_attn\.p_bmm_quantizer'\]"):
        ql.restore_state(golden.build(), {**state, "schema": 5})
