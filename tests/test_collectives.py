"""The one collective layer (quantlib/collectives.py): the slot packing both the amax sync and the searches
use, and the digest (its own gloo-rank behaviour is tested through them in tests/test_distributed and
tests/test_calibration/test_calib_collectives.py)."""

from __future__ import annotations

import torch

from quantlib.collectives import pack_by_slot, structure_digest


def test_pack_by_slot_puts_each_value_at_its_slot():
    head = torch.tensor([7.0])
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    buf, where = pack_by_slot(head, [a, b], [(3, 1), (2, 0)], 0.0)
    assert buf.tolist() == [7.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 0.0]
    assert buf[where].tolist() == [1.0, 2.0, 3.0]


def test_pack_by_slot_without_slots_is_a_concatenation():
    buf, where = pack_by_slot(torch.zeros(0), [torch.tensor([1.0]), torch.tensor([2.0, 3.0])], [(1, 0), (1, 0)], float("-inf"))
    assert buf.tolist() == [1.0, 2.0, 3.0] and buf[where].tolist() == [1.0, 2.0, 3.0]


def test_structure_digest_fits_a_negated_int64():
    d = structure_digest(["a", "b"])
    assert 0 <= d < 2**56 and d == structure_digest(["ab"]) and d != structure_digest(["b", "a"])
