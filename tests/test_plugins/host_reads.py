"""A recorder of the device-to-host reads of a piece of code, for the tests of the MoE forwards (which must
have none: each one stalls the GPU stream).

On the CPU nothing syncs, so it records the ops that would: ``_local_scalar_dense`` (what ``.item()`` /
``bool(t)`` call), ``equal`` / ``is_nonzero`` (a bool on the host), the ops whose output shape depends on
the data (``nonzero``, ``masked_select``, ``unique``, a bool-mask index), and ``Tensor.tolist()``, which
on a CPU tensor reads its memory without dispatching any op.
"""

from __future__ import annotations

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique_consecutive", "_unique", "_unique2",
            "unique_dim", "nonzero_static", "argwhere"}


class HostReads(TorchDispatchMode):
    """Records every aten op that reads a value back to the host or whose output shape depends on data,
    and every ``Tensor.tolist()`` (which on a CPU tensor reads its memory without dispatching an op),
    named by the file and function that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self._tolist = None

    def __enter__(self):
        real = self._tolist = torch.Tensor.tolist
        seen = self.seen

        def tolist(t):
            caller = sys._getframe(1).f_code
            seen.append(f"Tensor.tolist from {caller.co_filename}:{caller.co_name}")
            return real(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in _SYNCING:
            self.seen.append(str(func))
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())):
            self.seen.append(f"{func} with a bool mask")
        return func(*args, **(kwargs or {}))


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched, by name: on a GPU each is a launch or dispatcher call the host pays for."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))
