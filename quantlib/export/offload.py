"""Export of a model whose decoder layers wait in an offload folder (layer-by-layer calibration of a model
larger than memory): the plan is made with those layers on ``meta`` (its checks read shapes and amax, and
quantizers stay resident), then each layer is read from its file when its first item is packed and goes
back to ``meta`` when the next layer's turn comes, so one layer is in memory at a time."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..calib.sequential import decoder_layers, offloaded_layer
from .items import Item
from .modules import named_modules
from .plan import Plan
from .types import ExportError


def meta_modules(model: nn.Module) -> list[str]:
    """Names of the modules holding a parameter or buffer on ``meta`` (quantizers aside: :func:`named_modules`
    does not descend into them)."""
    out = []
    for name, m in named_modules(model):
        tensors = list(m._parameters.values()) + list(m._buffers.values())
        if any(t is not None and t.is_meta for t in tensors):
            out.append(name or type(model).__name__)
    return out


class _Reader:
    """Reads the decoder layer of the item being packed from the offload folder (the one before goes back
    to ``meta``): the plan's getters read their module's tensors when called, so they see the layer."""

    def __init__(self, model: nn.Module, folder: str) -> None:
        self.folder = folder
        self.list_name, self.layers = decoder_layers(model)
        self.stack = contextlib.ExitStack()
        self.current: Optional[int] = None

    def layer_of(self, it: Item) -> Optional[int]:
        prefix = self.list_name + "."
        if not it.where.startswith(prefix):
            return None
        index = it.where[len(prefix):].split(".", 1)[0]
        return int(index) if index.isdigit() and int(index) < len(self.layers) else None

    def enter(self, idx: int) -> None:
        if self.current == idx:
            return
        self.stack.close()
        self.current = None
        where = f"{self.list_name}.{idx}"
        try:
            self.stack.enter_context(offloaded_layer(self.layers[idx], where, self.folder))
        except (OSError, ValueError, RuntimeError) as exc:
            raise ExportError(f"{where}: cannot read it from the offload folder {self.folder}: {exc}") from exc
        self.current = idx

    def getter(self, it: Item, idx: Optional[int], key: Optional[str], get: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            if idx is not None:
                self.enter(idx)
            t = get()
            if t.is_meta:
                raise ExportError(f"{it.where}: {key or 'weight'} is on the meta device and is not part of a decoder layer in "
                                  f"{self.folder}")
            return t

        return read


@contextlib.contextmanager
def read_offloaded(model: nn.Module, plan: Plan, folder: str) -> Iterator[None]:
    """For the ``with`` body, the plan's getters read each decoder layer from ``folder`` in turn; after it
    the model's layers are back on ``meta`` and the plan's getters as they were."""
    reader = _Reader(model, folder)
    saved = [(it, it.weight, dict(it.extras)) for it in plan.items]
    for it in plan.items:
        idx = reader.layer_of(it)
        if it.weight is not None:
            it.weight = reader.getter(it, idx, None, it.weight)
        it.extras = {k: reader.getter(it, idx, k, get) for k, get in it.extras.items()}
    try:
        yield
    finally:
        reader.stack.close()
        for it, weight, extras in saved:
            it.weight, it.extras = weight, extras
