"""Bytes an export moves, counted op by op on the CPU (:class:`ByteCount`): what bounds the RL weight sync on a GPU,
where every op is limited by memory bandwidth, measured without one."""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from quantlib import kernels

#: the cast kernels real_quantize calls for stacked experts (their work is one call, unseen by the dispatcher)
CASTS = ("fp8_blockwise_cast", "mx_cast")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class ByteCount(TorchDispatchMode):
    """``moved``: bytes every aten op under it read and wrote (its tensor inputs plus the outputs that are not an input
    written in place; views, allocations and tensors under ``floor`` bytes move nothing). ``peak``: the most bytes of CPU
    storages made under it alive at once (views and in-place results of tensors made outside, e.g. the model's weights,
    not counted). ``cast_inputs``: bytes of the weights cast. Use with :func:`counting_casts`, which counts the cast kernels
    the dispatcher does not see."""

    def __init__(self, floor: int = 4096):
        super().__init__()
        self.floor, self.moved, self.ops, self.cast_inputs = floor, 0, {}, 0
        self.refs: dict[int, list] = {}  # storage pointer -> [tensors alive, bytes]
        self.now = self.peak = 0

    def count(self, name: str, n: int) -> None:
        """Add ``n`` bytes moved by ``name``."""
        if n:
            self.moved += n
            self.ops[name] = self.ops.get(name, 0) + n

    def _gone(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if not entry[0]:
            self.now -= entry[1]
            del self.refs[ptr]

    def track(self, out, inputs: list[torch.Tensor]) -> None:
        """Follow the storages of ``out`` made by an op whose tensor inputs are ``inputs``."""
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        for t in _tensors(out):
            if t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.refs:
                if ptr in seen:
                    continue
                self.refs[ptr] = [0, storage.nbytes()]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.refs[ptr][0] += 1
            weakref.finalize(t, self._gone, ptr)

    def made(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was made under this mode (a packed tensor, not a model tensor passed through)."""
        return t.untyped_storage().data_ptr() in self.refs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _tensors((args, kwargs))
        self.track(out, inputs)
        if not func.is_view and not func.__name__.startswith(("empty", "new_empty")):
            ids = {(t.data_ptr(), t.shape, t.stride()) for t in inputs}
            big = [t for t in inputs if _nbytes(t) >= self.floor]
            big += [t for t in _tensors(out) if _nbytes(t) >= self.floor and (t.data_ptr(), t.shape, t.stride()) not in ids]
            self.count(str(func.overloadpacket.__name__), sum(map(_nbytes, big)))
        return out


@contextmanager
def counting_casts(monkeypatch, count: ByteCount) -> Iterator[None]:
    """Count each cast kernel as reading its input once and writing its outputs once, plus the contiguous copy (a read and
    a write) the kernels make of a strided input (csrc ``checked_input``: ``x.contiguous()``); the kernel itself runs
    with the dispatch mode off, whichever backend (C++, reference) serves it."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    def wrap(name, real):
        def cast(x, *args, **kwargs):
            with _pop_mode_temporarily():
                out = real(x, *args, **kwargs)
            count.count(name, _nbytes(x) * (1 if x.is_contiguous() else 3) + sum(map(_nbytes, _tensors(out))))
            count.cast_inputs += _nbytes(x)
            count.track(out, [x])
            return out

        return cast

    for name in CASTS:
        monkeypatch.setattr(kernels, name, wrap(name, getattr(kernels, name)))
    yield
