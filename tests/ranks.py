"""Run a function on N processes with torch.distributed: the one harness of the multi-process tests.

``run_on_ranks(fn, world_size, *args, timeout=60)`` starts ``world_size`` processes, initialises a
process group in each on a free TCP port of 127.0.0.1, calls ``fn(rank, world_size, *args)`` and returns
the per-rank return values. An exception on any rank is re-raised in the parent as :class:`RankFailure`
carrying every rank's traceback; a rank that has not finished after ``timeout`` seconds is killed (only
the processes this helper started) and the parent raises :class:`RankTimeout`, so a hanging collective
fails the test instead of hanging the suite.

How ranks start: gloo (CPU) ranks are forked (children inherit the parent's imports, so 4 ranks start
in well under a second); NCCL ranks are spawned, because a process that has initialised CUDA (any
earlier GPU test in the same pytest worker) cannot fork children that use CUDA. Spawned children import
``fn`` (and ``setup`` / ``teardown``) by name, so these must be module-level functions of an importable
module: test modules are, as ``tests.<folder>.<module>`` (pytest's importlib mode with the repository
root on ``sys.path``, which spawned children inherit).

Results travel as ``torch.save`` bytes, not as pickled tensors: a pickled tensor is sent as a file
descriptor that the parent fetches from the child later, and a child that has exited by then leaves the
parent with "connection reset by peer".
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue
import socket
import traceback
from typing import Any, Callable, Optional

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
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies (a killed parent leaves no ranks)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _to_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _child(rank: int, world: int, port: int, pg_timeout: float, backend: str, setup: Optional[Callable[[], None]],
           teardown: Optional[Callable[[], None]], fn: Callable, args: tuple, results) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    die_with_parent()
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if setup is not None:
            setup()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))  # fmt: skip
        results.put((rank, True, _to_bytes(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001  (everything goes back to the parent instead of hanging it)
        results.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        if teardown is not None:
            with contextlib.suppress(Exception):
                teardown()
        results.close()
        results.join_thread()
        os._exit(0)  # no atexit handlers of the forked parent's state (pytest's, Megatron's)


def start_method(backend: str) -> str:
    """How ranks of ``backend`` start: "spawn" for NCCL (CUDA cannot be re-initialised in a forked
    child), "fork" otherwise (much faster: nothing is re-imported)."""
    return "spawn" if backend == "nccl" else "fork"


def _check_importable(role: str, f: Optional[Callable]) -> None:
    """A spawned child finds ``f`` by module and qualified name: refuse, naming it, what it cannot find."""
    if f is None:
        return
    module, qualname = getattr(f, "__module__", None), getattr(f, "__qualname__", "")
    if module in (None, "__main__") or "<" in qualname:
        raise ValueError(
            f"run_on_ranks: {role} {qualname or f!r} of module {module!r} cannot be imported by a spawned rank; "
            "make it a module-level function of an importable module"
        )


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, backend: str = "gloo",
                 setup: Optional[Callable[[], None]] = None, teardown: Optional[Callable[[], None]] = None,
                 method: Optional[str] = None) -> list[Any]:  # fmt: skip
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own
    process. ``setup`` runs in each child before the process group exists, ``teardown`` after it is gone.
    ``backend="nccl"`` gives rank r the GPU r. ``method`` ("fork" / "spawn") overrides
    :func:`start_method`; spawned ranks need ``fn``, ``setup``, ``teardown`` and ``args`` picklable."""
    method = method or start_method(backend)
    if method == "spawn":
        for role, f in (("fn", fn), ("setup", setup), ("teardown", teardown)):
            _check_importable(role, f)
    for _ in range(2):
        try:
            return _run_once(fn, world_size, args, timeout, backend, setup, teardown, method)
        except RankFailure as exc:
            # free_port's port was taken by another process before rank 0's store bound it (parallel test workers):
            # nothing of fn ran, the store never came up; again on another port
            if "EADDRINUSE" not in exc.errors.get(0, ""):
                raise
    return _run_once(fn, world_size, args, timeout, backend, setup, teardown, method)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, backend: str, setup: Optional[Callable[[], None]],
              teardown: Optional[Callable[[], None]], method: str) -> list[Any]:
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = free_port()
    # not daemonic: a rank may start processes of its own (Megatron's checkpoint writer); die_with_parent
    # and the kills below keep them from outliving the test
    procs = [ctx.Process(target=_child, args=(r, world_size, port, timeout, backend, setup, teardown, fn, args, results))
             for r in range(world_size)]
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
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in outs and r not in errors:
                        errors[r] = f"process died with exit code {p.exitcode}"
                continue
            if ok:
                outs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
                # the other ranks may now wait forever in a collective: a few seconds for their tracebacks
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=5))
    finally:
        done = len(outs) + len(errors) == world_size
        for p in procs:
            p.join(timeout=5.0 if done else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailure(errors)  # ranks still pending then are waiting on the failed one
    pending = [r for r in range(world_size) if r not in outs]
    if pending:
        raise RankTimeout(pending, timeout)
    return [outs[r] for r in range(world_size)]
