"""Quantized models copy and pickle: ``copy.deepcopy`` after an optimizer step (the expert-view and
weight caches hold tensors made under no_grad) and ``torch.save(model)`` / ``torch.load`` (the quantized
classes are built at run time), for nn.Linear models and a real tiny Qwen3-MoE."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def qwen3_moe() -> nn.Module:
    cfg = T.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                           experts_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    return T.Qwen3MoeForCausalLM(cfg)


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


CASES = {
    "linear-int8": (mlp, ql.INT8_DEFAULT_CFG, lambda: torch.randn(4, 16, generator=torch.Generator().manual_seed(1))),
    "qwen3-moe-fp8": (qwen3_moe, ql.FP8_DEFAULT_CFG, lambda: ids(1)),
    "qwen3-moe-nvfp4": (qwen3_moe, ql.NVFP4_DEFAULT_CFG, lambda: ids(1)),
}


def logits(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def quantized(case):
    build, cfg, data = CASES[case]
    model = ql.quantize(build(), cfg, lambda m: m(data()))
    with torch.no_grad():
        logits(model, data())  # fills the expert-view and weight caches
    return model, data


def train_step(model, data) -> None:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    logits(model, data()).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        logits(model, data())  # caches made again after the step, under no_grad


@pytest.mark.parametrize("case", list(CASES))
def test_deepcopy_after_an_optimizer_step_gives_the_same_output(case):
    model, data = quantized(case)
    train_step(model, data)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(logits(twin, data()), logits(model, data()))
    train_step(twin, data)  # the copy trains on its own parameters
    with torch.no_grad():
        assert not torch.equal(logits(twin, data()), logits(model, data()))


@pytest.mark.parametrize("case", list(CASES))
def test_torch_save_load_round_trip_gives_the_same_output(case):
    model, data = quantized(case)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(logits(loaded, data()), logits(model, data()))
    assert ql.quantizer_state(loaded)["quantizers"].keys() == ql.quantizer_state(model)["quantizers"].keys()


def test_pickled_quantized_module_names_its_original_class():
    model, _ = quantized("linear-int8")
    payload = pickle.dumps(model[0])
    assert b"QuantLinear" not in payload  # rebuilt from torch.nn.Linear through the registry
    assert type(pickle.loads(payload)) is type(model[0])


def test_torch_load_in_a_fresh_process_rebuilds_the_quantized_moe(tmp_path):
    import os
    import subprocess
    import sys

    model, data = quantized("qwen3-moe-fp8")
    torch.save(model, tmp_path / "model.pt")
    torch.save(data(), tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(logits(model, data()), tmp_path / "expected.pt")
    script = (
        "import torch\n"  # nothing of quantlib or transformers imported: unpickling must find both
        f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        f"x, want = torch.load({str(tmp_path / 'ids.pt')!r}), torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(m(x).logits, want), 'outputs differ'\n"
        "print(type(m.model.layers[0].mlp.experts).__name__)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "QuantQwen3MoeExperts"
