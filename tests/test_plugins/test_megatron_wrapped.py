"""Megatron-Core models wrapped as Megatron training wraps them (``Float16Module``, bf16) on the CPU with
gloo, at TP=1 (DP=2) and TP=2: quantized (the amax sync runs through the wrapper), dist-checkpointed and
restored into a freshly built wrapped model (and into DistributedDataParallel(Float16Module(...))) through
:func:`quantlib.plugins.megatron.restore_quantizer_config`, exported, and saved / restored with
``quantlib.save`` / ``quantlib.restore``.

The wrapper's ``sharded_state_dict`` delegates to the GPTModel, so the checkpoint keys carry no
``module.`` prefix while the wrapper's submodule paths do: the restore must not turn keys into paths.
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

WORLD, SEED, EVAL_SEED = 2, 0, 99
LAYOUTS = ("tp1", "tp2")


def _wrapped(tp: int, seed: int, ddp: bool = False):
    """Float16Module(GPTModel) in bf16, inside Megatron's DistributedDataParallel where ``ddp``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    inner = shims.build_gpt(tp, 1, seed, bf16=True)
    model = Float16Module(inner.config, inner)
    return (DistributedDataParallel(inner.config, DistributedDataParallelConfig(), model) if ddp else model).eval()


def _snapshot(model) -> dict:
    pieces = [None] * WORLD
    torch.distributed.all_gather_object(pieces, shims.amax_pieces(model))
    amax, problems = shims.assemble(pieces)
    return {"logits": shims.gpt_logits(model, shims.token_batches(1, EVAL_SEED)[0]), "amax": amax, "problems": problems}


def _round_trips(rank: int, world: int, root: str) -> dict:
    from megatron.core import dist_checkpointing, parallel_state as mpu

    from quantlib.plugins.megatron import restore_quantizer_config

    out = {}
    for layout in LAYOUTS:
        tp, _ = shims.LAYOUTS[layout]
        shims.set_layout(tp, 1)
        model = _wrapped(tp, SEED)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        data = shims.token_batches(4, 1)[dp_rank::dp]
        ql.quantize(model, ql.FP8_DEFAULT_CFG, shims.forward_loop(data), parallel_state=ql.ParallelState.from_megatron())
        folder = os.path.join(root, layout)
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), folder)
        saved = _snapshot(model)
        fresh = restore_quantizer_config(_wrapped(tp, SEED + 1), folder)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), folder))
        out[layout] = {"saved": saved, "loaded": _snapshot(fresh), "dtype": next(fresh.parameters()).dtype}
        # Megatron's DDP does not delegate sharded_state_dict (it adds its module.): Megatron-LM saves and
        # loads the unwrapped model, and restore_quantizer_config reads the keys of the model inside
        ddp = restore_quantizer_config(_wrapped(tp, SEED + 1, ddp=True), folder)
        ddp.module.load_state_dict(dist_checkpointing.load(ddp.module.sharded_state_dict(), folder))
        out[layout]["loaded_ddp"] = _snapshot(ddp.module)  # (DDP's own keys carry its module.)
        out[layout]["export"] = _export_same_as_inner(model, folder, rank)
        out[layout].update(_quantlib_save_restore(model, tp, folder, rank))
    return out if rank == 0 else {}


def _export_same_as_inner(model, folder: str, rank: int):
    """(files, whether the wrapper's export equals the inner GPTModel's byte for byte, quantized modules)."""
    from quantlib.export.megatron_export import export_megatron_checkpoint

    wrapped = export_megatron_checkpoint(model, os.path.join(folder, "export_wrapped"), "modelopt_fp8", hf_config={})
    inner = export_megatron_checkpoint(model.module, os.path.join(folder, "export_inner"), "modelopt_fp8", hf_config={})
    if rank != 0:
        return None
    same = [filecmp.cmp(os.path.join(wrapped.out_dir, f), os.path.join(inner.out_dir, f), shallow=False) for f in inner.files]
    return wrapped.files, all(same), len(wrapped.quantized_modules)


def _quantlib_save_restore(model, tp: int, folder: str, rank: int) -> dict:
    """``quantlib.save`` of the wrapped model, restored into a fresh wrapped model and into a bare GPTModel."""
    path = os.path.join(folder, f"quantizers_rank{rank}.pt")
    ql.save(model, path)
    fresh = ql.restore(_wrapped(tp, SEED + 1), path)
    ours = {n: b for n, b in model.named_buffers() if n.endswith("_amax")}
    theirs = {n: b for n, b in fresh.named_buffers() if n.endswith("_amax")}
    try:
        ql.restore(shims.build_gpt(tp, 1, SEED + 1, bf16=True), path)
        bare = None
    except ql.CheckpointError as exc:
        bare = str(exc)
    return {"ql_restore_equal": bool(ours) and ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours),
            "ql_restore_bare": bare}


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> dict:
    return shims.run_distributed(_round_trips, WORLD, str(tmp_path_factory.mktemp("wrapped_ckpt")), timeout=240)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_module_restores_every_amax_and_the_logits(round_trips, layout):
    """Saved from a quantized, calibrated Float16Module(GPTModel) in bf16, restored into a fresh wrapped
    model with other weights: every amax equal, the logits equal bit for bit."""
    saved, loaded = round_trips[layout]["saved"], round_trips[layout]["loaded"]
    assert round_trips[layout]["dtype"] == torch.bfloat16
    assert saved["problems"] == [] and loaded["problems"] == []
    assert any(".experts." in k for k in saved["amax"]) and any("linear_qkv.input_quantizer" in k for k in saved["amax"])
    assert set(loaded["amax"]) == set(saved["amax"])
    for key in saved["amax"]:
        assert torch.equal(loaded["amax"][key], saved["amax"][key]), key
    assert torch.equal(loaded["logits"], saved["logits"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ddp_around_float16_module_restores_every_amax_and_the_logits(round_trips, layout):
    saved, loaded = round_trips[layout]["saved"], round_trips[layout]["loaded_ddp"]
    assert loaded["problems"] == [] and set(loaded["amax"]) == set(saved["amax"])
    assert all(torch.equal(loaded["amax"][k], saved["amax"][k]) for k in saved["amax"])
    assert torch.equal(loaded["logits"], saved["logits"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_module_amax_synced_through_the_wrapper(round_trips, layout):
    """Calibrated on other data per data-parallel rank (TP1) and on TP shards (TP2): every replica of
    every amax holds the same value after quantize()'s sync on the wrapped model."""
    snap = round_trips[layout]["saved"]
    assert snap["amax"] and snap["problems"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_module_export_equals_the_inner_models(round_trips, layout):
    files, same, quantized = round_trips[layout]["export"]
    assert "model.safetensors" in files and quantized > 0
    assert same


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantlib_restore_into_the_same_wrapper(round_trips, layout):
    assert round_trips[layout]["ql_restore_equal"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantlib_restore_into_an_unwrapped_model_names_the_wrapper(round_trips, layout):
    message = round_trips[layout]["ql_restore_bare"]
    assert message is not None and "extra prefix 'module.'" in message and "Float16Module" in message, message


def test_restore_quantizer_config_refuses_a_model_without_sharded_state_dict(tmp_path):
    from quantlib.plugins.megatron import restore_quantizer_config

    with pytest.raises(ql.CheckpointError, match="Sequential has no sharded_state_dict"):
        restore_quantizer_config(torch.nn.Sequential(torch.nn.Linear(4, 4)), str(tmp_path))
