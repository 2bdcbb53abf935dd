"""``export_checkpoint``: a sharded safetensors checkpoint with the config a consumer reads, written
atomically (a temporary directory beside ``out_dir``, renamed at the end)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Optional, Union

import torch
from torch import nn

from . import safetensors_io
from .iterate import check_arguments, iter_plan
from .layouts import ModelLayout, layout_for
from .modules import ModuleWalk
from .offload import meta_modules, read_offloaded
from .plan import Plan, make_plan
from .types import ExportError, ExportFormat, ExportManifest
from .writers import as_format, packer as get_packer

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
#: a progress bar from this many bytes of weights on
_PROGRESS_BYTES = 2**30


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``5GB`` / ``500MiB`` / a positive int."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ExportError(f"max_shard_size={size!r}: must be positive")
        return size
    if not isinstance(size, str):
        raise ExportError(f"max_shard_size={size!r} ({type(size).__name__}): expected an int of bytes or a size such as '5GB'")
    s = size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            try:
                n = int(float(s[: -len(unit)]) * _UNITS[unit])
            except ValueError:
                break
            if n <= 0:
                raise ExportError(f"max_shard_size={size!r}: must be positive")
            return n
    raise ExportError(f"max_shard_size={size!r}: expected an int of bytes or a size such as '5GB'")


def _base_config(model: nn.Module, hf_config: Any) -> dict:
    cfg = hf_config if hf_config is not None else getattr(model, "config", None)
    if cfg is None:
        return {}
    if isinstance(cfg, dict):
        return dict(cfg)
    if not callable(getattr(cfg, "to_dict", None)):
        what = "hf_config" if hf_config is not None else f"{type(model).__name__}.config"
        raise ExportError(f"{what}={cfg!r} ({type(cfg).__name__}): expected a transformers PretrainedConfig or a dict of config.json")
    out = cfg.to_dict()
    if not out.get("architectures") and cfg is getattr(model, "config", None) and hasattr(model, "save_pretrained"):
        # a model built from its config (never saved) has none; vLLM then picks a pooling model without lm_head
        out["architectures"] = [type(model).__name__]
    return out


def _resolve_out_dir(out_dir: Union[str, os.PathLike]) -> str:
    """The directory the export replaces: a symlink's target, as ``open`` writes through a link (the link
    stays and points at the new export; a link to nothing gets its target created)."""
    path = os.path.abspath(os.fspath(out_dir))
    return os.path.realpath(path) if os.path.islink(path) else path


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ExportError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not overwrite:
            raise ExportError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise ExportError(f"the parent directory of {out_dir} does not exist")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _ShardWriter:
    """Collects tensors into shards of at most ``limit`` bytes, each written when full."""

    def __init__(self, tmp: str, limit: int) -> None:
        self.tmp, self.limit = tmp, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[tuple[str, list[str], int]] = []  # (temp file, keys, bytes)

    def add(self, key: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.limit:
            self.flush()
        self.pending[key] = t.detach().contiguous()
        self.size += n

    def flush(self) -> None:
        if not self.pending:
            return
        path = os.path.join(self.tmp, f"shard-{len(self.shards):05d}.tmp")
        try:
            safetensors_io.save_file(self.pending, path, metadata={"format": "pt"})
        except Exception as exc:
            raise ExportError(f"writing {path}: {exc}") from exc
        self.shards.append((path, list(self.pending), self.size))
        self.pending, self.size = {}, 0

    def finish(self) -> list[str]:
        """Rename the shards to their final names; write the index when there are several."""
        self.flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (path, keys, _), name in zip(self.shards, names):
            os.replace(path, os.path.join(self.tmp, name))
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": sum(s for _, _, s in self.shards)}, "weight_map": dict(sorted(weight_map.items()))}
            _write_json(os.path.join(self.tmp, "model.safetensors.index.json"), index)
            names.append("model.safetensors.index.json")
        return names


def _write_json(path: str, obj: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
    except Exception as exc:
        raise ExportError(f"writing {path}: {exc}") from exc


def export_checkpoint(
    model: nn.Module,
    out_dir: str,
    format: Union[ExportFormat, str],
    *,
    layout: Optional[ModelLayout] = None,
    overwrite: bool = False,
    max_shard_size: Union[int, str] = "5GB",
    hf_config: Any = None,
    unify_siblings: bool = False,
    tp: int = 1,
    progress: Optional[bool] = None,
    offload_folder: Optional[str] = None,
) -> ExportManifest:
    """Write ``model`` to ``out_dir`` in ``format``: safetensors shards (+ index), config.json with the
    consumer's ``quantization_config`` (and ModelOpt's hf_quant_config.json). Checks everything first;
    the directory appears whole or not at all. ``tp``: also check block divisibility at that TP degree.
    ``offload_folder``: where the decoder layers of a model left on ``meta`` by offloaded layer-by-layer
    calibration are read from, one at a time."""
    from quantlib import __version__

    check_arguments(out_dir=out_dir, overwrite=overwrite, unify_siblings=unify_siblings, tp=tp, progress=progress, layout=layout)
    fmt = as_format(format)
    p = get_packer(fmt)
    limit = parse_size(max_shard_size)
    config = _base_config(model, hf_config)
    on_meta = meta_modules(model)
    if on_meta and offload_folder is None:
        raise ExportError(f"{on_meta[0]} (and {len(on_meta) - 1} more module(s)) hold tensors on the meta device; "
                          "pass offload_folder= the folder layer-by-layer calibration loaded them from")
    mw = ModuleWalk(model)  # one traversal for the layout and the plan
    plan = make_plan(model, p, layout or layout_for(model, mw), unify_siblings=unify_siblings, tp=tp, version=__version__, modules=mw)
    if on_meta:
        progress = progress if progress is not None else plan_bytes(plan) >= _PROGRESS_BYTES  # before the getters read files
        with read_offloaded(model, plan, offload_folder):
            return write_plan(plan, fmt, out_dir, config, overwrite=overwrite, limit=limit, progress=progress)
    return write_plan(plan, fmt, out_dir, config, overwrite=overwrite, limit=limit, progress=progress)


def write_plan(plan: Plan, fmt: ExportFormat, out_dir: str, config: dict, *, overwrite: bool, limit: int,
               progress: Optional[bool]) -> ExportManifest:
    """Pack and write a checked plan atomically; ``config`` is the base of config.json."""
    p = get_packer(fmt)
    shown, out_dir = os.fspath(out_dir), _resolve_out_dir(out_dir)
    _check_out_dir(out_dir, overwrite)
    config = dict(config)
    config["quantization_config"] = p.config(plan.info)
    extra = p.extra_files(plan.info)
    parent = os.path.dirname(out_dir)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # as os.mkdir makes it (mkdtemp's 0o700 would shut out a server running as another user)
        files = _write_all(plan, fmt, tmp, limit, config, extra, progress)
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportManifest(shown, fmt, files, sum(os.path.getsize(os.path.join(out_dir, f)) for f in files), plan.quantized,
                          list(plan.info.ignore), plan.unified)


def plan_bytes(plan: Plan) -> int:
    """Bytes of the plan's quantized weights as they are in the model (read from their metadata, not their data)."""
    total = 0
    for it in plan.items:
        if it.weight is not None:
            w = it.weight()
            total += w.numel() * w.element_size()
    return total


def _write_all(plan, fmt: ExportFormat, tmp: str, limit: int, config: dict, extra: dict, progress: Optional[bool]) -> list[str]:
    writer = _ShardWriter(tmp, limit)
    show = progress if progress is not None else plan_bytes(plan) >= _PROGRESS_BYTES
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(plan.items), desc=f"export {fmt.value}", unit="module")
    for pw in iter_plan(plan, fmt):
        for key, t in pw.items():
            writer.add(key, t)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    files = writer.finish()
    _write_json(os.path.join(tmp, "config.json"), config)
    files.append("config.json")
    for name, obj in extra.items():
        _write_json(os.path.join(tmp, name), obj)
        files.append(name)
    return files


def _swap_in(tmp: str, out_dir: str) -> None:
    """Replace ``out_dir`` by ``tmp`` (an empty or, with overwrite, old ``out_dir`` is removed last)."""
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.old-", dir=os.path.dirname(os.path.abspath(out_dir)))
        os.rmdir(old)
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError as exc:
        if old is not None:
            os.replace(old, out_dir)
        raise ExportError(f"renaming {tmp} to {out_dir}: {exc}") from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
