"""CPU microbenchmark: GB/s of every op, the C++ kernels (backend "cpu") against the torch reference.

    python benchmarks/bench_cpu_kernels.py [--size 4096] [--dtypes float32 bfloat16] [--isa avx2] [--cases mx_cast,nvfp4]
                                           [--out FILE]

(from the repository root, with quantlib installed or PYTHONPATH=., and quantlib._C built).

GB/s counts the bytes of the input plus the bytes of every output, over the median time of the runs
(reference and C++ runs alternate, so load on a shared machine hits both alike; the C++ best run is
shown too: its gap to the median is mostly page faults of freshly allocated outputs). Prints a markdown
table (and writes it, with the machine and versions, to ``--out`` if given). Both backends run in the
same process with the same torch thread count; their outputs are checked to be equal first.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch

from quantlib import kernels
from quantlib.formats import FormatSpec, Kind


def _cases(x: torch.Tensor) -> list[tuple[str, Callable[[str], object]]]:
    amax_t = x.float().abs().amax()
    amax_ch = x.float().abs().amax(dim=1, keepdim=True)
    amax_blk = kernels.block_amax(x, (128,), backend="reference")

    def fq(spec: FormatSpec, amax: torch.Tensor | None = None) -> Callable[[str], object]:
        return lambda backend: kernels.fake_quant(x, spec, amax, backend=backend)

    return [
        ("fake_quant int8 per-tensor", fq(FormatSpec(Kind.INT, 8), amax_t)),
        ("fake_quant int8 per-channel", fq(FormatSpec(Kind.INT, 8), amax_ch)),
        ("fake_quant int8 dynamic per-row", fq(FormatSpec(Kind.INT, 8, dynamic=True))),
        ("fake_quant int4 static block 128", fq(FormatSpec(Kind.INT, 4, block=(128,)), amax_blk)),
        ("fake_quant int4 dynamic block 128", fq(FormatSpec(Kind.INT, 4, block=(128,), dynamic=True))),
        ("fake_quant fp8 per-tensor", fq(FormatSpec(Kind.FP8, element=(4, 3)), amax_t)),
        ("fake_quant fp8 per-channel", fq(FormatSpec(Kind.FP8, element=(4, 3)), amax_ch)),
        ("fake_quant fp8 dynamic per-row", fq(FormatSpec(Kind.FP8, element=(4, 3), dynamic=True))),
        ("fake_quant fp8 block 1x128", fq(FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True))),
        ("fake_quant fp8 block 128x128 pow2", fq(FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True, pow2=True))),
        ("fake_quant mxfp8", fq(FormatSpec(Kind.MX, element=(4, 3), block=(32,)))),
        ("fake_quant mxfp4", fq(FormatSpec(Kind.MX, element=(2, 1), block=(32,)))),
        ("fake_quant nvfp4 dynamic", fq(FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)))),
        ("fake_quant nvfp4 static", fq(FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), amax_t)),
        ("block_amax 1x16", lambda b: kernels.block_amax(x, (16,), backend=b)),
        ("fp8_blockwise_cast 1x128", lambda b: kernels.fp8_blockwise_cast(x, (1, 128), backend=b)),
        ("fp8_blockwise_cast 128x128", lambda b: kernels.fp8_blockwise_cast(x, (128, 128), backend=b)),
        ("mx_cast e4m3", lambda b: kernels.mx_cast(x, "e4m3", backend=b)),
        ("mx_cast e2m1", lambda b: kernels.mx_cast(x, "e2m1", backend=b)),
        ("nvfp4_cast", lambda b: kernels.nvfp4_cast(x, backend=b)),
    ]


def _nbytes(out: object) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    return sum(_nbytes(o) for o in out)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            a, b = a.float(), b.float()
            return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())
        return torch.equal(a, b)
    return all(_same(u, v) for u, v in zip(a, b))


def _timings(fns: list[Callable[[], object]], min_reps: int, min_time: float) -> list[list[float]]:
    """Seconds of each run of each function, the functions taking turns (so that a burst of load on a
    shared machine hits them alike); at least ``min_reps`` runs each and ``min_time`` seconds in all."""
    for fn in fns:
        fn()  # warm up (allocations, first touch)
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_reps or time.perf_counter() - start < min_time:
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return times


def baselines(x: torch.Tensor, reps: int, min_time: float) -> str:
    """Plain torch ops of the same size: what a fresh output costs (page faults) and what copying costs."""
    out = torch.empty_like(x)
    t_new, t_copy = (statistics.median(ts) for ts in _timings([lambda: x * 2, lambda: out.copy_(x)], reps, min_time))
    nbytes = 2 * x.numel() * x.element_size()
    return (f"{str(x.dtype).replace('torch.', '')} baselines: torch `x * 2` (fresh output) {t_new * 1e3:.1f} ms = "
            f"{nbytes / t_new / 1e9:.1f} GB/s; "
            f"copy into a preallocated tensor {t_copy * 1e3:.1f} ms = {nbytes / t_copy / 1e9:.1f} GB/s.")


def run(size: int, dtypes: list[torch.dtype], reps: int, min_time: float, cases: str = "") -> tuple[list[dict], list[str]]:
    wanted = [c for c in cases.split(",") if c]
    rows, notes = [], []
    for dtype in dtypes:
        torch.manual_seed(0)
        x = (torch.randn(size, size) * 3).to(dtype)
        notes.append(baselines(x, reps, min_time))
        for name, case in _cases(x):
            if wanted and not any(w in name for w in wanted):
                continue
            ref_out, cpu_out = case("reference"), case("cpu")
            if not _same(cpu_out, ref_out):
                raise AssertionError(f"{name} ({dtype}): cpu and reference outputs differ")
            nbytes = x.numel() * x.element_size() + _nbytes(ref_out)
            ts_ref, ts_cpu = _timings([lambda case=case: case("reference"), lambda case=case: case("cpu")], reps, min_time)
            t_ref, t_cpu = statistics.median(ts_ref), statistics.median(ts_cpu)
            rows.append(dict(op=name, dtype=str(dtype).replace("torch.", ""), ref_ms=t_ref * 1e3, cpu_ms=t_cpu * 1e3,
                             ref_gbs=nbytes / t_ref / 1e9, cpu_gbs=nbytes / t_cpu / 1e9, cpu_best_gbs=nbytes / min(ts_cpu) / 1e9,
                             speedup=t_ref / t_cpu))
    return rows, notes


def table(rows: list[dict]) -> str:
    lines = ["| op | dtype | reference ms | C++ ms | reference GB/s | C++ GB/s | C++ GB/s, best run | speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['dtype']} | {r['ref_ms']:.1f} | {r['cpu_ms']:.2f} | {r['ref_gbs']:.2f} | {r['cpu_gbs']:.2f} | "
                     f"{r['cpu_best_gbs']:.2f} | {r['speedup']:.1f}x |")
    speedups = [r["speedup"] for r in rows]
    lines.append("")
    lines.append(f"Speedup: min {min(speedups):.1f}x, geometric mean {statistics.geometric_mean(speedups):.1f}x, max {max(speedups):.1f}x.")
    return "\n".join(lines)


def _lscpu(field: str) -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(field + ":")), "?")


def _compiler() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "?"


def machine() -> str:
    from quantlib import _C

    return (f"CPU: {_lscpu('Model name')} (family {_lscpu('CPU family')}, model {_lscpu('Model')}), {_lscpu('CPU(s)')} CPUs, "
            f"{torch.get_num_threads()} torch threads; kernels ISA: {_C.cpu_isa()} (compiled: {', '.join(_C.cpu_available_isas())})\n"
            f"Python {platform.python_version()}, torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), "
            f"extension built with {_compiler()}, {platform.platform()}\n"
            f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')} (torch's huge-page allocation of large tensors)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="inputs are size x size")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=7, help="timed runs per backend and case, at least")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per case, at least")
    parser.add_argument("--isa", help="the compiled variant of the kernels to run (default: the widest this CPU runs)")
    parser.add_argument("--cases", default="", help="comma-separated substrings of the op names to time (default: all)")
    parser.add_argument("--out", help="also write the results (markdown) to this file")
    args = parser.parse_args()
    if args.isa:
        from quantlib import _C

        if args.isa not in _C.cpu_available_isas():
            parser.error(f"--isa {args.isa}: this CPU runs {', '.join(_C.cpu_available_isas())}")
        _C.cpu_set_isa(args.isa)
    load_before = os.getloadavg()[0]
    rows, notes = run(args.size, [getattr(torch, d) for d in args.dtypes], args.reps, args.min_time, args.cases)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    header = f"{datetime.date.today().isoformat()}, {args.size}x{args.size} inputs, {load}\n{machine()}"
    text = f"{header}\n\n{table(rows)}\n\n" + "\n".join(notes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
