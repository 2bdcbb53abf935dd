"""Run a function on N processes with torch.distributed (gloo on 127.0.0.1).

``run_on_ranks(fn, world_size, *args, timeout=60)`` forks ``world_size`` processes (the ``fork`` start
method: children inherit the parent's imports, so 4 ranks start in well under a second), initialises a
gloo process group in each on a free TCP port of 127.0.0.1, calls ``fn(rank, world_size, *args)`` and
returns the list of per-rank return values (which must pickle). An exception on any rank is re-raised in
the parent as :class:`RankFailure` carrying every rank's traceback; a rank that has not finished after
``timeout`` seconds is killed (only the processes this helper started, by pid) and the parent raises
:class:`RankTimeout`, so a hanging collective fails the test instead of hanging the suite.

Tests that expect an exception on some ranks catch it inside ``fn`` and return what they want to check
(the message, the rank), so the parent can compare the ranks' outcomes.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """Some rank raised; ``errors`` maps rank -> formatted traceback."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))


class RankTimeout(RuntimeError):
    """Some rank did not finish in time (a hang); ``pending`` lists them."""

    def __init__(self, pending: list[int], timeout: float) -> None:
        self.pending = pending
        super().__init__(f"ranks {pending} did not finish within {timeout:.0f} s (hang?); they were killed")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, pg_timeout: float, backend: str, fn: Callable, args: tuple, results) -> None:
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        results.close()
        results.join_thread()
        os._exit(0)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own
    process; see the module docstring for errors and timeouts. ``backend="nccl"`` gives rank r the
    GPU r (the parent must not have initialised CUDA: the children are forked)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, timeout, backend, fn, args, results), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(outs) + len(errors) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outs and r not in errors]
                for r in dead:
                    errors[r] = f"process died with exit code {procs[r].exitcode}"
                continue
            (outs if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(outs) + len(errors) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    pending = [r for r in range(world_size) if r not in outs and r not in errors]
    if pending:
        raise RankTimeout(pending, timeout)
    if errors:
        raise RankFailure(errors)
    return [outs[r] for r in range(world_size)]


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
