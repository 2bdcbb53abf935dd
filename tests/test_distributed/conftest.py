"""Fixtures of the multi-process tests; the harness itself is ``tests/ranks.py`` (shared with the
Megatron tests): ``run_on_ranks(fn, world_size, *args, timeout=60)`` runs ``fn(rank, world_size, *args)``
on forked gloo ranks and re-raises any rank's failure or hang in the parent.

Tests that expect an exception on some ranks catch it inside ``fn`` and return what they want to check
(the message, the rank), so the parent can compare the ranks' outcomes.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.ranks import run_on_ranks


@pytest.fixture(scope="session", autouse=True)
def _warm_parent() -> None:
    """Calibrate the test model once in the parent: the first call of some ops imports torch._dynamo
    (seconds), and forked ranks inherit what the parent has loaded instead of each paying for it."""
    from . import _layouts

    layout = _layouts.Layout("single", 1)
    model, loop = _layouts.build(layout, 0, _layouts.config())
    import quantlib as ql

    ql.calibrate(model, "max", loop)


@pytest.fixture
def on_ranks() -> Callable[..., list[Any]]:
    """The :func:`run_on_ranks` helper."""
    return run_on_ranks
