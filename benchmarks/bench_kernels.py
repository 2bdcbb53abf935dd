"""GPU throughput of every quantlib kernel and backend, with the bf16 copy as the ceiling and peers.

GB/s = (bytes read + bytes written) / median time (``triton.testing.do_bench``), counting each input
once and each output once (codes, scales, fake-quant result); the dynamic NVFP4 global amax, which
needs a second read of the input, is counted at one read, as are peers. Shapes: 8192 x 8192 and
16384 x 7168, bfloat16. Peers run when importable: torchao (blockwise FP8 Triton kernels, to_mx,
nvfp4_quantize under torch.compile) and ModelOpt (TensorQuantizer fake quant, NVFP4QTensor.quantize).

Usage: ``python benchmarks/bench_kernels.py [--shapes 8192x8192,16384x7168] [--cases SUBSTR,...] [--json out.json]``.
Prints markdown tables; "best ours / copy" is the % of the copy's GB/s. The casts that export
runs, alone: ``--shapes 16384x7168 --cases "mx_cast MXFP4,nvfp4_cast,fp8_cast" --no-peers --no-reference``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from typing import Callable, Optional

import torch

from quantlib.formats import FormatSpec, Kind, Rounding


def bench(fn: Callable[[], object], rep_ms: int = 60) -> float:
    """Median milliseconds of ``fn`` (after warm-up, autotuning and compilation)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=15, rep=rep_ms, return_mode="median")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------- quantlib cases


def fake_cases():
    """(name, spec, amax factory or None, bytes per element written besides the output)."""
    return [
        ("FP8 per-tensor (static)", FormatSpec(Kind.FP8, element=(4, 3)), lambda x: x.float().abs().amax()),
        ("FP8 per-row (dynamic)", FormatSpec(Kind.FP8, element=(4, 3), dynamic=True), None),
        ("INT8 per-channel (static)", FormatSpec(Kind.INT, num_bits=8), lambda x: x.float().abs().amax(1, keepdim=True)),
        ("INT4 block 128 (dynamic)", FormatSpec(Kind.INT, num_bits=4, block=(128,), dynamic=True), None),
        ("FP8 block 1x128", FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True), None),
        ("FP8 block 128x128", FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True), None),
        ("MXFP8", FormatSpec(Kind.MX, element=(4, 3), block=(32,)), None),
        ("MXFP4", FormatSpec(Kind.MX, element=(2, 1), block=(32,)), None),
        ("NVFP4 (static global)", FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), lambda x: x.float().abs().amax()),
        ("NVFP4 (dynamic global)", FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), None),
    ]


def cast_cases(x: torch.Tensor):
    """(name, op, args, bytes written)."""
    n = x.numel()
    m, k = x.shape
    g = x.float().abs().amax()
    return [
        ("fp8_blockwise_cast 1x128", "fp8_blockwise_cast", ((128,), 1e-10, False), n + 4 * m * (k // 128)),
        ("fp8_blockwise_cast 128x128", "fp8_blockwise_cast", ((128, 128), 1e-10, False), n + 4 * (m // 128) * (k // 128)),
        ("mx_cast MXFP8", "mx_cast", ("e4m3", 32, Rounding.RCEIL), n + n // 32),
        ("mx_cast MXFP4", "mx_cast", ("e2m1", 32, Rounding.RCEIL), n // 2 + n // 32),
        ("nvfp4_cast (static)", "nvfp4_cast", (g,), n // 2 + n // 16),
        ("nvfp4_cast (dynamic)", "nvfp4_cast", (None,), n // 2 + n // 16),
        ("fp8_cast per tensor", "fp8_cast", ((448.0 / g).reshape(()), (4, 3)), n),
        ("block_amax 1x128", "block_amax", ((128,),), 4 * n // 128),
    ]


def _wanted(case: str, cases: Optional[list[str]]) -> bool:
    return not cases or any(c in case for c in cases)


def run_quantlib(x: torch.Tensor, backends: list[str], rows: list[dict], cases: Optional[list[str]] = None) -> None:
    from quantlib.kernels import reference_impl
    from quantlib.kernels.backends import implementation, uncovered

    shape = "x".join(map(str, x.shape))
    nin = x.numel() * x.element_size()
    for name, spec, amax_fn in fake_cases():
        if not _wanted(f"fake_quant {name}", cases):
            continue
        amax = amax_fn(x) if amax_fn else None
        for be in backends:
            if uncovered("fake_quant", be, x, spec, amax) is not None:  # the cuda backend's gaps (Triton's rows measure those)
                continue
            fn = reference_impl.fake_quant if be == "reference" else implementation("fake_quant", be)
            _measure(rows, shape, f"fake_quant {name}", be, lambda fn=fn, spec=spec, amax=amax: fn(x, spec, amax), nin + nin)
    for name, op, args, written in cast_cases(x):
        if not _wanted(name, cases):
            continue
        for be in backends:
            if uncovered(op, be, x, *args) is not None:  # the cuda backend has no fp8_cast / block_amax kernel
                continue
            fn = getattr(reference_impl, op) if be == "reference" else implementation(op, be)
            _measure(rows, shape, name, be, lambda fn=fn, args=args: fn(x, *args), nin + written)


def _measure(rows, shape, case, backend, fn, nbytes, rep_ms=60) -> Optional[float]:
    try:
        ms = bench(fn, rep_ms)
    except Exception as exc:  # a missing peer kernel must not stop the run
        rows.append({"shape": shape, "case": case, "backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
        print(f"  {case} [{backend}]: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None
    rows.append({"shape": shape, "case": case, "backend": backend, "ms": ms, "GBps": gbps(nbytes, ms)})
    print(f"  {shape} {case} [{backend}]: {ms * 1e3:.1f} us, {gbps(nbytes, ms):.0f} GB/s", flush=True)
    return ms


def run_crossover(backends: list[str]) -> str:
    """Microseconds per call of the cuda and triton backends from small to large inputs: where each
    one's launch cost or its kernel decides (what ``backend="auto"`` picks by size)."""
    from quantlib.kernels.backends import implementation

    cases = [("fake_quant FP8 block 1x128", FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True)),
             ("fake_quant NVFP4 (dynamic)", FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,))),
             ("fake_quant INT4 block 128", FormatSpec(Kind.INT, num_bits=4, block=(128,), dynamic=True))]
    shapes = [(16, 4096), (256, 4096), (1024, 4096), (4096, 4096), (8192, 8192)]
    out = ["| case | elements | " + " | ".join(f"{be} us" for be in backends) + " |", "|---|---|" + "---|" * len(backends)]
    for name, spec in cases:
        for m, k in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells = []
            for be in backends:
                fn = implementation("fake_quant", be)
                cells.append(f"{bench(lambda fn=fn, x=x, spec=spec: fn(x, spec, None), 40) * 1e3:.1f}")
            out.append(f"| {name} | {m * k} | " + " | ".join(cells) + " |")
            print(out[-1], flush=True)
    return "\n".join(out)


# --------------------------------------------------------------------------- peers


def run_torchao(x: torch.Tensor, rows: list[dict]) -> None:
    shape = "x".join(map(str, x.shape))
    n, nin = x.numel(), x.numel() * x.element_size()
    m, k = x.shape
    try:
        from torchao.prototype.blockwise_fp8_training.kernels import (
            triton_fp8_blockwise_act_quant_lhs,
            triton_fp8_blockwise_weight_quant_rhs,
        )
    except Exception as exc:
        print(f"torchao blockwise fp8 kernels not importable: {exc}")
    else:
        _measure(rows, shape, "fp8_blockwise_cast 1x128", "torchao", lambda: triton_fp8_blockwise_act_quant_lhs(x, 128), nin + n + 4 * m
                 * (k // 128))
        _measure(rows, shape, "fp8_blockwise_cast 128x128", "torchao", lambda: triton_fp8_blockwise_weight_quant_rhs(x, 128), nin + n + 4
                 * (m // 128) * (k // 128))
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:
        print(f"torchao to_mx not importable: {exc}")
    else:
        to_mx_c = torch.compile(to_mx)
        _measure(rows, shape, "mx_cast MXFP8", "torchao", lambda: to_mx_c(x, torch.float8_e4m3fn, 32), nin + n + n // 32)
        _measure(rows, shape, "mx_cast MXFP4", "torchao", lambda: to_mx_c(x, torch.float4_e2m1fn_x2, 32), nin + n // 2 + n // 32)
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    except Exception as exc:
        print(f"torchao nvfp4_quantize not importable: {exc}")
    else:
        q = torch.compile(nvfp4_quantize)
        g = x.float().abs().amax() / (6.0 * 448.0)
        _measure(rows, shape, "nvfp4_cast (static)", "torchao", lambda: q(x, 16, g), nin + n // 2 + n // 16)


def run_modelopt(x: torch.Tensor, rows: list[dict], only: str = "") -> None:
    """ModelOpt's fake quant and NVFP4QTensor; ``only``: comma-separated substrings of case names (its
    FP8 / INT8 / MX fake quant JIT-compiles a CUDA extension first, about a minute each)."""
    shape = "x".join(map(str, x.shape))
    n, nin = x.numel(), x.numel() * x.element_size()
    try:
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except Exception as exc:
        print(f"ModelOpt not importable: {exc}")
        return
    amax_t = x.float().abs().amax()
    amax_c = x.float().abs().amax(1, keepdim=True)
    cases = [
        ("fake_quant FP8 per-tensor (static)", dict(num_bits=(4, 3), axis=None), amax_t),
        ("fake_quant INT8 per-channel (static)", dict(num_bits=8, axis=0), amax_c),
        ("fake_quant INT4 block 128 (dynamic)", dict(num_bits=4, block_sizes={-1: 128, "type": "dynamic"}), None),
        ("fake_quant MXFP8", dict(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}), None),
        ("fake_quant NVFP4 (static global)", dict(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}), amax_t),
    ]
    keep = [w for w in only.split(",") if w]
    for name, cfg, amax in cases:
        if keep and not any(w in name for w in keep):
            continue
        try:
            tq = TensorQuantizer(QuantizerAttributeConfig(**cfg)).cuda()
            if amax is not None:
                tq.amax = amax
            with torch.no_grad():
                _measure(rows, shape, name, "modelopt", lambda tq=tq: tq(x), nin + nin)
        except Exception as exc:
            print(f"  modelopt {name}: {type(exc).__name__}: {str(exc)[:200]}")
            rows.append({"shape": shape, "case": name, "backend": "modelopt", "error": str(exc)[:120]})
    if keep and not any("nvfp4_cast" in w for w in keep):
        return
    s2 = (x.float().abs().amax() / (6.0 * 448.0)).to(torch.float32)
    _measure(rows, shape, "nvfp4_cast (dynamic)", "modelopt", lambda: NVFP4QTensor.quantize(x, 16), nin + n // 2 + n // 16)
    _measure(rows, shape, "nvfp4_cast (static)", "modelopt", lambda: NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=s2), nin
             + n // 2 + n // 16)


# --------------------------------------------------------------------------- report


def table(rows: list[dict], copy: dict[str, float]) -> str:
    backends = [b for b in ("cuda", "triton", "reference", "torchao", "modelopt") if any(r["backend"] == b for r in rows)]
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        out.append(f"\n### {shape} bf16 (copy: {copy[shape]:.0f} GB/s)\n")
        out.append("| case | " + " | ".join(f"{b} GB/s" for b in backends) + " | best ours / copy | vs torchao | vs ModelOpt |")
        out.append("|---" * (len(backends) + 4) + "|")
        cases = dict.fromkeys(r["case"] for r in rows if r["shape"] == shape)
        for case in cases:
            got = {r["backend"]: r.get("GBps") for r in rows if r["shape"] == shape and r["case"] == case}
            ours = max((got.get(b) or 0) for b in ("cuda", "triton"))
            cells = [f"{got[b]:.0f}" if got.get(b) else ("err" if b in got else "") for b in backends]
            ta = f"{ours / got['torchao']:.2f}x" if got.get("torchao") and ours else ""
            mo = f"{ours / got['modelopt']:.2f}x" if got.get("modelopt") and ours else ""
            frac = f"{100 * ours / copy[shape]:.0f}%" if ours else ""
            out.append(f"| {case} | " + " | ".join(cells) + f" | {frac} | {ta} | {mo} |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8192x8192,16384x7168")
    p.add_argument("--json", default=None)
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--crossover", action="store_true", help="also time cuda vs triton from small to large inputs")
    p.add_argument("--cases", default="", help="comma-separated substrings of quantlib case names to time (default: all), "
                   "e.g. 'mx_cast MXFP4,nvfp4_cast' for the FP4 casts export runs")
    p.add_argument("--modelopt-cases", default="", help="comma-separated substrings of ModelOpt case names (default: all)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU")
        return 0
    from quantlib.kernels.backends import has_cuda_kernels, triton_available

    backends = (["cuda"] if has_cuda_kernels() else []) + (["triton"] if triton_available()
                                                           else []) + ([] if args.no_reference else ["reference"])
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, "
          f"backends {backends}")
    rows: list[dict] = []
    copy: dict[str, float] = {}
    t0 = time.time()
    try:
        for s in args.shapes.split(","):
            m, k = (int(v) for v in s.split("x"))
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            y = torch.empty_like(x)
            ms = bench(functools.partial(y.copy_, x))
            copy[s] = gbps(2 * x.numel() * 2, ms)
            print(f"{s}: bf16 copy {ms * 1e3:.1f} us = {copy[s]:.0f} GB/s", flush=True)
            run_quantlib(x, backends, rows, [c for c in args.cases.split(",") if c])
            if not args.no_peers:
                for peer in (run_torchao, lambda x, rows: run_modelopt(x, rows, args.modelopt_cases)):
                    try:
                        peer(x, rows)
                    except Exception:
                        traceback.print_exc()
            del x, y
            torch.cuda.empty_cache()
    except KeyboardInterrupt:  # `timeout -s INT`: report what was measured
        print("interrupted: partial results")
    print(f"\n## quantlib kernels (GB/s = (bytes read + written) / median time), {time.time() - t0:.0f} s")
    print(table(rows, copy))
    if args.crossover:
        print("\n## cuda vs triton by input size (us per call, median)")
        print(run_crossover([be for be in backends if be in ("cuda", "triton")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy": copy, "rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "triton": triton.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
