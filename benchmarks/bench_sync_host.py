"""Host time and aten-op count of one RL weight sync (``sync_pairs``) on the CPU, where a structure-identical tiny model
has the GPU model's Python and op count: a sync with its cast kernels stubbed (each returns its first outputs again)
takes the host's per-sync work, and each aten op is a launch or dispatcher call the host pays for on a GPU. With expert
stacks it also prints the host time from the call to the first stack's cast: a GPU left idle by its caller (as
bench_export.py leaves it) waits that long before its first large kernel.

    python benchmarks/bench_sync_host.py                    # tiny Qwen3-MoE: hidden 128, 4 layers, 128 experts of 128
    python benchmarks/bench_sync_host.py --model llama      # tiny Llama (bench_export.py --small's shape)
    options: --formats fp8_block,mxfp8 --runs 50 --repeats 5
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from typing import Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # run from a checkout: quantlib and bench_export

from bench_export import RECIPES, _Traffic, build, share_sibling_amax, sync_all  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.kernels import backends  # noqa: E402


class _StubbedCasts:
    """While installed, each cast kernel of :mod:`quantlib.kernels` on the CPU returns the outputs its first call with the
    same arguments made (the real kernel's, kept): a sync then costs its host work alone, the device's on a GPU."""

    OPS = ("fp8_blockwise_cast", "mx_cast", "nvfp4_cast", "fp8_cast")

    def __init__(self) -> None:
        self.saved: dict = {}
        self.memo: dict = {}
        self.first_stack: Optional[float] = None  # time.process_time() of the first cast of an expert stack (a 3-D input)

    def __enter__(self) -> "_StubbedCasts":
        for key, fn in list(backends._SELECTED.items()):
            if key[0] in self.OPS and key[2] == "cpu":
                self.saved[key] = fn

                def stub(x, *args, _fn=fn, _op=key[0]):
                    if self.first_stack is None and x.dim() == 3:
                        self.first_stack = time.process_time()
                    k = (_op, x.data_ptr(), x.shape, x.stride(), x.dtype, repr(args))
                    if k not in self.memo:
                        self.memo[k] = _fn(x, *args)
                    return self.memo[k]

                backends._SELECTED[key] = stub
        return self

    def __exit__(self, *exc) -> None:
        backends._SELECTED.update(self.saved)


def model_for(kind: str, key: str) -> torch.nn.Module:
    """The tiny model of ``kind`` quantized with recipe ``key`` as bench_export.py quantizes its model."""
    if kind == "moe":
        base = build(128, 256, 4, 1, 1, 256, "cpu", experts=128, moe_intermediate=128)
        ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(1))
    else:
        base = build(256, 512, 2, 2, 2, 512, "cpu")
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    _, cfg, _, _ = RECIPES[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(base, getattr(ql, cfg), lambda m: m(ids))
    ql.disable_quantizer(base, "*lm_head*")
    share_sibling_amax(base)
    return base


def measure(model: torch.nn.Module, fmt: str, runs: int) -> tuple[float, float, Optional[float], int, collections.Counter]:
    """(median CPU ms of one sync, median CPU ms of one with the casts stubbed: its host work, median CPU ms of that from
    the call to its first expert stack's cast (what a GPU waits for before its first large kernel; None without
    stacks), aten ops of one sync (real casts), the ops by name)."""
    with torch.no_grad():
        for _ in range(3):
            sync_all(model, fmt)  # the plan, the layout and the kernels' first calls
        times, to_stack = [], []
        for stub in (False, True):
            with _StubbedCasts() if stub else contextlib.nullcontext() as stubs:
                sync_all(model, fmt)  # the stubs' outputs
                gc.collect()
                gc.disable()
                try:
                    for _ in range(runs if stub else max(1, runs // 10)):
                        if stub:
                            stubs.first_stack = None
                        t0 = time.process_time()  # this process's CPU time: the machine may be shared
                        sync_all(model, fmt)
                        times.append((stub, time.process_time() - t0))
                        if stub and stubs.first_stack is not None:
                            to_stack.append(stubs.first_stack - t0)
                finally:
                    gc.enable()
        with _Traffic(1 << 62) as rec:  # its op count alone
            sync_all(model, fmt)
    real, host = ([t for s, t in times if s is stub] for stub in (False, True))
    first = statistics.median(to_stack) * 1e3 if to_stack else None
    return statistics.median(real) * 1e3, statistics.median(host) * 1e3, first, sum(rec.ops.values()), rec.ops


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("moe", "llama"), default="moe")
    p.add_argument("--formats", default="fp8_block,mxfp8")
    p.add_argument("--runs", type=int, default=50, help="syncs timed per repeat (median)")
    p.add_argument("--repeats", type=int, default=5, help="repeats, each a median; the median of them is printed too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for key in args.formats.split(","):
        model, fmt = model_for(args.model, key), RECIPES[key][2]
        rows = [measure(model, fmt, args.runs) for _ in range(args.repeats)]
        hosts = [r[1] for r in rows]
        each = ", ".join(f"{h:.3f}" for h in hosts)
        firsts = [r[2] for r in rows if r[2] is not None]
        first = f"; to the first expert stack's cast ms {statistics.median(firsts):.3f}" if firsts else ""
        ops = dict(rows[-1][4].most_common(8))
        print(f"{args.model} {key}: host ms {statistics.median(hosts):.3f} (repeats {each}){first}; "
              f"sync ms (real casts) {statistics.median(r[0] for r in rows):.3f}; aten ops {rows[-1][3]}: {ops}",
              flush=True)


if __name__ == "__main__":
    main()
