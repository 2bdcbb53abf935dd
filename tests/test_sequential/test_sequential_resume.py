"""The resume file of layer-by-layer calibration is used only for the model it was written for: another
model with the same module names (other weights, other widths) and damaged or foreign files are refused
with a CalibrationError naming the file and the first difference, and leave the model as it was."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib import CalibrationError  # noqa: E402
from quantlib.calib.resume import tensor_digest  # noqa: E402
from quantlib.calib.sequential import offload_to_disk  # noqa: E402
from quantlib.model_quant import iter_leaf_quantizers  # noqa: E402

CFG = ql.INT8_DEFAULT_CFG


def llama(seed: int = 0, hidden: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def neox(seed: int = 0, hidden: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
                        max_position_embeddings=64)
    return GPTNeoXForCausalLM(cfg).eval()


BUILD = {"llama": llama, "gpt_neox": neox}


def layers_of(model: nn.Module) -> nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.gpt_neox.layers


def data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (2, 6 + 3 * i), generator=g) for i in range(3)]


def loop(model: nn.Module) -> None:
    for x in data():
        model(x)


class _Boom(RuntimeError):
    pass


def crash_in_layer_2(model: nn.Module, resume: str, **opts) -> None:
    """A layer-by-layer run of ``model`` killed in layer 2: ``resume`` holds layers 0 and 1."""
    layer = layers_of(model)[2]
    attn = getattr(layer, "self_attn", None) or layer.attention  # runs only when the layer itself runs
    handle = attn.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Boom("killed in layer 2")))
    with pytest.raises(_Boom):
        ql.quantize(model, CFG, loop, sequential={"resume_file": resume, **opts})
    handle.remove()
    assert torch.load(resume, weights_only=True)["done"] == 2


def refused(model: nn.Module, resume: str, match: str, **opts) -> None:
    """Quantizing ``model`` from ``resume`` raises CalibrationError naming the file and ``match``, and
    leaves the model unquantized."""
    with pytest.raises(CalibrationError, match=match) as info:
        ql.quantize(model, CFG, loop, sequential={"resume_file": resume, **opts})
    assert resume in str(info.value) and "delete it" in str(info.value)
    assert not list(iter_leaf_quantizers(model))  # quantize() rolled back


@pytest.mark.parametrize("name", sorted(BUILD))
def test_resume_file_of_the_same_architecture_with_other_weights_refused(tmp_path, name):
    resume = str(tmp_path / "resume.pt")
    crash_in_layer_2(BUILD[name](seed=0), resume)
    refused(BUILD[name](seed=1), resume, r"written for another model: the values of \S+ differ \(same shape\)")
    assert os.path.exists(resume)  # kept for the model it was written for


def test_resume_file_refused_naming_the_finished_layer_whose_weight_changed(tmp_path):
    resume = str(tmp_path / "resume.pt")
    crash_in_layer_2(llama(), resume)
    model = llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # one element of a finished layer
    refused(model, resume, r"the values of model\.layers\.1\.mlp\.down_proj\.weight differ")


def test_resume_file_ignores_changes_in_layers_not_yet_calibrated(tmp_path):
    resume = str(tmp_path / "resume.pt")
    crash_in_layer_2(llama(), resume)
    changed, reference = llama(), llama()
    for m in (changed, reference):
        with torch.no_grad():
            m.model.layers[3].mlp.down_proj.weight.mul_(2)  # layer 3 is calibrated after the resume
    got = ql.quantize(changed, CFG, loop, sequential={"resume_file": resume})
    expected = dict(iter_leaf_quantizers(ql.quantize(reference, CFG, loop)))
    for n, q in iter_leaf_quantizers(got):
        assert (q.amax is None and expected[n].amax is None) or torch.equal(q.amax, expected[n].amax), n


def test_resume_file_checks_offloaded_finished_layers_on_disk(tmp_path):
    resume = str(tmp_path / "resume.pt")
    first = llama()
    offload_to_disk(first, str(tmp_path / "a"))
    crash_in_layer_2(first, resume, offload_folder=str(tmp_path / "a"))
    other = llama()
    with torch.no_grad():
        other.model.layers[0].self_attn.q_proj.weight[0, 0] = 0.5
    offload_to_disk(other, str(tmp_path / "b"))
    refused(other, resume, r"the values of model\.layers\.0\.self_attn\.q_proj\.weight differ", offload_folder=str(tmp_path / "b"))
    assert all(p.device.type == "meta" for p in other.model.layers.parameters())  # back on disk


@pytest.mark.parametrize("name", sorted(BUILD))
def test_resume_file_of_another_width_refused_naming_the_tensor(tmp_path, name):
    resume = str(tmp_path / "resume.pt")
    crash_in_layer_2(BUILD[name](hidden=32), resume)
    refused(BUILD[name](hidden=48), resume, r"written for another model: \S+ is \(64, 48\) torch\.float32 here, \(64, 32\) torch\.float32 "
                                            r"in the file")


def _truncated(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read()
    with open(path, "wb") as f:
        f.write(head[: len(head) // 2])


def _foreign_object(path: str) -> None:
    torch.save(nn.Linear(2, 2), path)  # a pickled module: not loadable with weights_only


def _text(path: str) -> None:
    with open(path, "w") as f:
        f.write("not a checkpoint\n")


def _plain_tensor(path: str) -> None:
    torch.save(torch.ones(3), path)


@pytest.mark.parametrize(
    "damage, match",
    [
        (_truncated, r"cannot be read \(truncated, corrupt or not written by quantlib"),
        (_foreign_object, r"cannot be read .*objects other than tensors and plain containers"),
        (_text, r"cannot be read \(truncated, corrupt or not written by quantlib"),
        (_plain_tensor, r"is not a quantlib resume file"),
    ],
    ids=["truncated", "pickled-module", "text", "plain-tensor"],
)
def test_damaged_or_foreign_resume_file_refused_naming_it(tmp_path, damage, match):
    resume = str(tmp_path / "resume.pt")
    crash_in_layer_2(llama(), resume)
    damage(resume)
    with pytest.raises(CalibrationError, match=match) as info:
        ql.quantize(llama(), CFG, loop, sequential={"resume_file": resume})
    assert resume in str(info.value) and "weights_only=False" not in str(info.value)


def test_digest_changes_with_one_element_and_with_swapped_rows():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    d = tensor_digest(w)
    assert torch.equal(tensor_digest(w.clone()), d)
    one = w.clone()
    one[7, 3] = torch.nextafter(one[7, 3], torch.tensor(float("inf")))  # the smallest change of one element
    assert not torch.equal(tensor_digest(one), d)
    swapped = w[[1, 0] + list(range(2, 64))]
    assert tensor_digest(swapped)[0] == d[0] and tensor_digest(swapped)[1] != d[1]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
        assert tensor_digest(w.to(dtype)).shape == (2,)
