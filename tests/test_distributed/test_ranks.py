"""The harness itself (tests/ranks.py): gloo ranks fork, NCCL ranks spawn, and the spawn path (which the
GPU suite depends on) runs here on the CPU with gloo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import RankFailure, run_on_ranks, start_method

#: set by the parent before starting ranks: a forked rank inherits it, a spawned rank re-imports this module
_PARENT_STATE: list[str] = []


def _all_reduce_and_report(rank: int, world: int) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "pid": os.getpid(), "parent_state": list(_PARENT_STATE), "backend": dist.get_backend()}


def _raise_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("rank one's own error")


def test_nccl_ranks_spawn_and_gloo_ranks_fork():
    assert start_method("nccl") == "spawn"
    assert start_method("gloo") == "fork"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_gloo_job_runs_through_each_start_method(method):
    _PARENT_STATE[:] = ["set in the parent"]
    try:
        outs = run_on_ranks(_all_reduce_and_report, 2, timeout=120, method=method)
    finally:
        _PARENT_STATE.clear()
    assert [o["sum"] for o in outs] == [3.0, 3.0]
    assert all(o["backend"] == "gloo" for o in outs) and len({o["pid"] for o in outs}) == 2
    # forked ranks inherit the parent's memory; spawned ranks start a fresh interpreter and import fn by name
    assert all(o["parent_state"] == (["set in the parent"] if method == "fork" else []) for o in outs)


def test_spawned_rank_failure_reaches_the_parent():
    with pytest.raises(RankFailure, match="rank one's own error") as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout=120, method="spawn")
    assert list(info.value.errors) == [1]


def test_spawn_refuses_a_function_it_cannot_import():
    def local(rank: int, world: int) -> int:
        return rank

    with pytest.raises(ValueError, match="local.*cannot be imported by a spawned rank"):
        run_on_ranks(local, 2, method="spawn")


def test_a_port_taken_before_the_store_binds_it_is_retried(monkeypatch):
    """Parallel test workers can take free_port's port before rank 0's store binds it (EADDRINUSE): the ranks
    start again on another port rather than failing the test."""
    import socket

    from tests import ranks

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = ranks.free_port
    monkeypatch.setattr(ranks, "free_port", lambda: ports.pop() if ports else real())
    try:
        out = run_on_ranks(_all_reduce_and_report, 2, timeout=60)
    finally:
        taken.close()
    assert [o["sum"] for o in out] == [3.0, 3.0] and not ports
