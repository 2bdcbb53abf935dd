"""Tensors that transformers' ``save_pretrained`` writes under another key than the model's own: renamed (a router's
``e_score_correction_bias`` saved as ``expert_bias``) or built on save (q / k / v concatenated into one
``query_key_value``, a router weight transposed, an unembedding padded). :mod:`.hf_names` finds them on its probe;
here they become items of their own. A renamed tensor is written as it is under its key; a built key is made from its
real sources by transformers' own conversion. Neither may hold a quantized module's tensor (its scales are written
beside its weight under the module's name, where no loader of the moved key looks for them), except the weights of
quantized linears that the key holds as whole rows, which become one quantized item of the key (:mod:`.built_rows`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .built_rows import fused_item, row_order
from .fold import times_rows
from .items import Item, live
from .layouts import ModelLayout
from .types import ExportError


def moved_sources(layout: ModelLayout) -> list[str]:
    """The model's tensors that the checkpoint of ``layout`` saves under other keys (renamed or built)."""
    return [*layout.tensors, *(s for srcs, _ in layout.built.values() for s in srcs)]


class Moved:
    """The moved tensors of one export's walk (:func:`~quantlib.export.plan.walk`), by source tensor."""

    def __init__(self, model: nn.Module, layout: ModelLayout, out_folds: Optional[dict[str, torch.Tensor]] = None):
        self.model, self.renamed, self.built = model, layout.tensors, layout.built
        self.out = out_folds or {}  # a module's output channels times a scale (:class:`~quantlib.export.fold.Folds`), read at the source
        self.by_source: dict[str, list[str]] = {}  # a save may build several keys of one tensor (a fused conv split in q / k / v)
        for key, (srcs, _) in self.built.items():
            for src in srcs:
                self.by_source.setdefault(src, []).append(key)
        self.emitted: set[str] = set()
        self.pending: dict[str, dict[str, Item]] = {}  # built key -> its quantized members' items so far, by source tensor
        self._orders: dict[str, Optional[tuple[str, ...]]] = {}

    def refuse(self, name: str, direct: Iterable[str], where: str = "") -> None:
        """Refuses quantized module ``name`` (its quantizer ``where``, default its weight quantizer) if the checkpoint saves
        any of its tensors ``direct`` under another key."""
        for k in direct:
            full = f"{name}.{k}" if name else k
            if full in self.renamed:
                why = f"transformers saves {full} as {self.renamed[full]} (tensor renamed)"
            elif full in self.by_source:
                why = self.built[self.by_source[full][0]][1]
            else:
                continue
            raise ExportError(f"{where or name + '.weight_quantizer'} is enabled, but {why}; quantlib writes a quantized module's "
                              "tensors as the model holds them, under its name: disable the quantizer")

    def rows_of(self, name: str, direct: Iterable[str]) -> Optional[str]:
        """The key whose rows hold quantized module ``name``'s weight with the rows of other quantized modules alone
        (:mod:`.built_rows`); None where the checkpoint keeps its tensors under its own name. Any other move is refused."""
        full = f"{name}.weight" if name else "weight"
        keys = self.by_source.get(full, [])
        if len(keys) == 1 and self._order(keys[0]) is not None and not any(f"{name}.{k}" in self.renamed for k in direct):
            return keys[0]
        off = [s for s in self.built[keys[0]][0] if not self._quantized(s)] if len(keys) == 1 else []
        if off:
            raise ExportError(f"{name}.weight_quantizer is enabled, but transformers saves {full} within {keys[0]} with {off}, which are "
                              "not quantized: one key is quantized whole; quantize them alike or disable this quantizer")
        self.refuse(name, direct)
        return None

    def _quantized(self, src: str) -> bool:
        """Whether source tensor ``src`` is the weight of a module with an enabled weight quantizer."""
        module = self.model.get_submodule(src.rpartition(".")[0])
        return src.endswith(".weight") and bool(getattr(getattr(module, "weight_quantizer", None), "is_enabled", False))

    def _order(self, key: str) -> Optional[tuple[str, ...]]:
        if key not in self._orders:
            srcs = self.built[key][0]
            self._orders[key] = None
            if all(map(self._quantized, srcs)):  # only then is every source a module's weight, with rows to count
                rows = {s: self.model.get_submodule(s.rpartition(".")[0]).weight.shape[0] for s in srcs}
                self._orders[key] = row_order(self.model, key, srcs, rows)
        return self._orders[key]

    def add_rows(self, key: str, item: Item, name: str) -> Optional[Item]:
        """Collects ``item`` (quantized module ``name``'s) for built key ``key``; returns the key's item once every member is in."""
        got = self.pending.setdefault(key, {})
        got[f"{name}.weight"] = item
        order = self._orders[key]
        if len(got) < len(order):
            return None
        del self.pending[key]
        members = [got[s] for s in order]
        module = key.rpartition(".")[0]
        extras = {}
        for k in dict.fromkeys(k for m in members for k in m.extras):  # a bias of every member, saved as one key beside the weight
            built = f"{module}.{k}"
            if built not in self.built or set(self.built[built][0]) != {f"{m.rpartition('.')[0]}.{k}" for m in order}:
                raise ExportError(f"{', '.join(m.where for m in members)}: their {k} is not saved as {built} of all of them, beside the "
                                  f"weight saved within {key}")
            extras[k] = self._builder(built)
            self.emitted.add(built)
        self.emitted.add(key)
        return fused_item(module, members, self._builder(key), extras)

    def unfinished(self) -> None:
        """Refuses a key whose quantized members the walk did not all meet (none so far: every source is checked quantized)."""
        for key, got in self.pending.items():
            raise ExportError(f"{key}: saved of {list(self._orders[key])}, but the export met only {sorted(got)}")

    def split(self, items: list[Item], module: nn.Module, name: str, direct: dict) -> dict:
        """Appends to ``items`` an unquantized item per moved key that a tensor of ``module`` goes into (once per key);
        returns the tensors left to write under the module's own name."""
        kept = {}
        for k, t in direct.items():
            full = f"{name}.{k}" if name else k
            if full in self.renamed:
                moved = [(self.renamed[full], self._source(module, name, k))]
            elif full in self.by_source:
                moved = [(key, self._builder(key)) for key in self.by_source[full] if key not in self.emitted]
                self.emitted.update(key for key, _ in moved)
            else:
                kept[k] = t
                continue
            for key, get in moved:
                at, _, local = key.rpartition(".")
                # leaf: the key, which names no module, so no fold planned for a module applies twice (Folds.apply)
                items.append(Item(at, "unquantized", full, extras={local: get}, parent="", leaf=key))
        return kept

    def _source(self, module: nn.Module, name: str, k: str) -> Callable[[], torch.Tensor]:
        """The getter of tensor ``k`` of ``module`` (named ``name``), with the fold into its output channels where one is planned."""
        get = live(module, k)
        p = self.out.get(name)
        return times_rows(get, p) if p is not None and k in ("weight", "bias") else get

    def _builder(self, key: str) -> Callable[[], torch.Tensor]:
        """The getter of built key ``key``: transformers' conversion run on its sources as they are when called."""
        from transformers.core_model_loading import revert_weight_conversion

        srcs, why = self.built[key]
        gets = [self._source(self.model.get_submodule(m), m, t) for m, _, t in (s.rpartition(".") for s in srcs)]
        model = self.model

        def get() -> torch.Tensor:
            with torch.no_grad():
                out = revert_weight_conversion(model, {s: g() for s, g in zip(srcs, gets)})
            if key not in out:  # the probe found it; the real tensors must give it too
                raise ExportError(f"{type(model).__name__}: {why}, but transformers' conversion of those tensors gave {sorted(out)}")
            return out[key]

        return get
