"""The model and tokenizer of a run: a Hugging Face model directory checked before transformers reads it, or
the small language model shipped with quantlib (``quantlib/embedded``); and where it runs."""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from .options import PipelineError

EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "embedded")
EMBEDDED_TEXT = os.path.join(EMBEDDED_DIR, "stdlib_sample.txt")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: share of the device's free memory a model may take and still calibrate in one piece (activations need the rest)
FIT_SHARE = 0.7
_MEGATRON_MARKERS = ("latest_checkpointed_iteration.txt", "metadata.json", "common.pt")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own loading bars and notices off while it runs inside a stage (its bar would break ours)."""
    from transformers.utils import logging as tlog

    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()


def check_model_dir(path: str) -> None:
    """Refuse, in one line, a path that is not a Hugging Face model directory."""
    if not os.path.isdir(path):
        raise PipelineError(f"--model {path}: no such directory; pass a Hugging Face model directory (config.json and weights)")
    if (
        any(os.path.exists(os.path.join(path, m)) for m in _MEGATRON_MARKERS)
        or glob.glob(os.path.join(path, "iter_*"))
        or glob.glob(os.path.join(path, "*.distcp"))
    ):
        raise PipelineError(
            f"--model {path}: a Megatron-Core checkpoint, which quantlib quantize does not read; it reads Hugging Face model "
            "directories (config.json and *.safetensors): convert the checkpoint to Hugging Face format first, or quantize the "
            "Megatron-Core model in Python (quantlib.quantize, then quantlib.export.megatron_export.export_megatron_checkpoint)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PipelineError(
            f"--model {path}: not a Hugging Face model directory (no config.json); pass the directory save_pretrained wrote"
        )
    if not glob.glob(os.path.join(path, "*.safetensors")) and not glob.glob(os.path.join(path, "pytorch_model*.bin")):
        raise PipelineError(f"--model {path}: config.json but no weights (*.safetensors or pytorch_model*.bin)")


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The model directory's own tokenizer, from local files only."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise PipelineError(
            f"--model {path}: no tokenizer that loads offline ({type(exc).__name__}); save it beside the weights "
            "(tokenizer.save_pretrained(dir))"
        ) from None
    if not callable(tok):
        raise PipelineError(f"--model {path}: no tokenizer (AutoTokenizer gave {type(tok).__name__}); save it beside the weights")
    return tok


def torch_dtype(name: str, path: str) -> Any:
    """--dtype as transformers takes it; ``auto`` is the checkpoint's dtype, fp32 for the embedded model."""
    if name == "auto":
        return torch.float32 if os.path.abspath(path) == EMBEDDED_DIR else "auto"
    if name not in DTYPES:
        raise PipelineError(f"--dtype {name}: one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(path: str, dtype: str, trust_remote_code: bool) -> nn.Module:
    """``AutoModelForCausalLM`` of ``path`` on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype(dtype, path), local_files_only=True, trust_remote_code=trust_remote_code
            )
    except PipelineError:
        raise
    except Exception as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PipelineError(f"--model {path}: transformers cannot load it as a causal LM: {msg}") from None
    return model.eval()


def resolve_device(device: Optional[str]) -> torch.device:
    """--device, or the GPU when there is one."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise PipelineError(f"--device {device}: not a torch device (cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"--device {device}: this torch sees no CUDA device; pass --device cpu")
    return dev


def model_bytes(model: nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def free_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (the host's available memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needs_sequential(model: nn.Module, device: torch.device, mode: str) -> bool:
    """Whether calibration runs layer by layer: --sequential on / off, or (auto) when the model does not fit the device."""
    if mode != "auto":
        return mode == "on"
    return device.type != "cpu" and model_bytes(model) > FIT_SHARE * free_bytes(device)
