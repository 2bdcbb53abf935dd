"""Cost of quantization on top of the model's own forward, quantlib vs ModelOpt, in one run.

For a stack of Linear blocks (d -> 4d -> d with GELU) it measures, per preset:
  (a) the bare forward loop (the calibration batches through the unquantized model), best of 3, in its
      own process (for memory) and alternated with (b) in (b)'s process (for the time ratio),
  (b) ``quantize(model, cfg, forward_loop)`` with max calibration (conversion included), best of 3 on
      fresh models; "first (b)" is the process's first one, with the library's one-time costs. One bare
      loop warms torch (threads, allocator) before both (a) and (b),
  (c) one eval forward of the quantized model (after a warm-up, so cached weights count as they would
      for a user evaluating many batches), alternated with the bare forward, best of 10 each,
and reports (b)/(a), (c)/bare forward, and peak memory of (b) as a ratio to (a)'s and to the model
size (peak RSS in a fresh process on CPU; ``max_memory_allocated`` on GPU). ModelOpt 0.47 runs where it
imports and supports the format on the device.

    python benchmarks/bench_calibrate.py                 # CPU defaults
    python benchmarks/bench_calibrate.py --device cuda --dim 1024 --blocks 8 --tokens 4096
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

PRESETS = {
    "INT8": "INT8_DEFAULT_CFG",
    "FP8": "FP8_DEFAULT_CFG",
    "INT4-block": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "NVFP4": "NVFP4_DEFAULT_CFG",
    "MXFP8": "MXFP8_DEFAULT_CFG",
}
WEIGHT_ONLY = {"INT4-block"}
MODELOPT_CPU = {"INT8", "FP8", "INT4-block"}  # ModelOpt's NVFP4 / MX fake quant needs CUDA


def build(dim: int, blocks: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*layers).to(device).eval()


def batches(n: int, tokens: int, dim: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(tokens, dim, generator=g).to(device) for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def quantize_with(lib: str, model: nn.Module, preset: str, loop) -> nn.Module:
    if lib == "quantlib":
        import quantlib

        return quantlib.quantize(model, getattr(quantlib, PRESETS[preset]), loop)
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, copy.deepcopy(getattr(mtq, PRESETS[preset])), loop)


def forward_loop(data: list[torch.Tensor]):
    """(a)'s forward loop over ``data``, also the calibration loop of (b)."""

    def loop(m: nn.Module) -> None:
        with torch.no_grad():
            for b in data:
                m(b)

    return loop


def rss_file() -> int:
    """Bytes of file-backed resident memory (code and data of loaded libraries first touched)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def phase(args, lib: str, preset: str, what: str) -> dict:
    """One measurement in this process (called in a fresh subprocess for memory)."""
    device = args.device
    model = build(args.dim, args.blocks, device)
    data = batches(args.batches, args.tokens, args.dim, device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loop = forward_loop(data)
    if what == "quantize" and args.warmup:
        # JIT compilation and autotuning happen once per process and shape: keep them out of (b)
        warm = quantize_with(lib, build(args.dim, args.blocks, device), preset, loop)
        with torch.no_grad():
            warm(data[0])
        del warm
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    import quantlib  # noqa: F401  (imports are not calibration memory: both libraries load before rss0)

    if lib == "modelopt":
        import modelopt.torch.quantization  # noqa: F401
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    file0 = rss_file()
    loop(model)  # warm-up of torch itself (threads, allocator), the same before (a) and (b)

    def quantize_time(m: nn.Module) -> float:  # the model is built before the clock starts
        return timed(lambda: quantize_with(lib, m, preset, loop), device, repeat=1)

    if what == "bare":
        out = {"time": timed(lambda: loop(model), device)}
    else:
        first = quantize_time(model)
        out = {"time": first, "first": first}
    out["model_bytes"] = model_bytes
    if device.startswith("cuda"):
        out["peak_extra"] = torch.cuda.max_memory_allocated() - base_mem
    else:
        out["peak_extra"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
        out["code_pages"] = rss_file() - file0
    if what == "quantize":
        # best of 3 quantizations of fresh models, alternated with 3 bare loops measured here too: the
        # ratio of the two is then immune to the machine's speed drifting between processes
        bare_model, out["bare_loop"] = build(args.dim, args.blocks, device), float("inf")
        for i in range(3):
            out["bare_loop"] = min(out["bare_loop"], timed(lambda: loop(bare_model), device, repeat=1))
            if i < 2:
                out["time"] = min(out["time"], quantize_time(build(args.dim, args.blocks, device)))
        del bare_model
        out["fwd"], out["bare_fwd"] = forward_pair(args, model, data[0])
    return out


def forward_pair(args, model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(c): one eval forward of the quantized model and of a bare one, alternated, best of 10 each."""
    with torch.no_grad():
        bare = build(args.dim, args.blocks, args.device)
        model(x)  # warm-up (fills the weight cache)
        bare(x)
        return timed_pair(lambda: model(x), lambda: bare(x), args.device)


def forward_phase(args, lib: str, preset: str) -> dict:
    """(c) alone, in a process whose allocator is as the user's (see ``in_subprocess``)."""
    model = build(args.dim, args.blocks, args.device)
    data = batches(args.batches, args.tokens, args.dim, args.device)
    model = quantize_with(lib, model, preset, forward_loop(data))
    fwd, bare_fwd = forward_pair(args, model, data[0])
    return {"fwd": fwd, "bare_fwd": bare_fwd}


def timed_pair(f, g, device: str, repeat: int = 10) -> tuple[float, float]:
    """Best times of ``f`` and ``g`` run alternately, so that a noisy neighbour slows both alike."""
    tf = tg = float("inf")
    for _ in range(repeat):
        tf = min(tf, timed(f, device, repeat=1))
        tg = min(tg, timed(g, device, repeat=1))
    return tf, tg


def in_subprocess(args, lib: str, preset: str, what: str, malloc: str = "fixed") -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", lib, preset, what, "--device", args.device, "--dim", str(args.dim),
           "--blocks", str(args.blocks), "--tokens", str(args.tokens), "--batches",
           str(args.batches)] + (["--warmup"] if args.warmup else [])
    # a fixed mmap threshold: glibc's sliding one keeps freed activations in the heap at random, which
    # made peak RSS of the same run vary 2x; with it, RSS follows the live memory (runs agree to 0.1 MiB)
    # --reuse-freed-memory instead keeps everything in glibc's heap: no page faults on fresh outputs
    # (peak RSS is then the heap's high-water mark)
    # malloc "default" leaves glibc as users have it (sliding threshold: freed activations mostly reused)
    big = str(2**30)
    if args.reuse_freed_memory and malloc == "fixed":
        malloc = "reuse"
    settings = {"fixed": dict(MALLOC_MMAP_THRESHOLD_="65536"), "reuse": dict(MALLOC_MMAP_THRESHOLD_=big, MALLOC_TRIM_THRESHOLD_=big),
                "default": {}}
    env = dict(os.environ, **settings[malloc])
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        print(f"  {lib} {preset} {what} failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}",
              file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def modelopt_available() -> str | None:
    try:
        import modelopt

        return modelopt.__version__
    except Exception:
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--phase", nargs=3)
    p.add_argument("--warmup", action="store_true", help="quantize once untimed first (GPU: JIT compile, autotune)")
    p.add_argument("--no-modelopt", action="store_true")
    p.add_argument("--reuse-freed-memory", action="store_true", help="CPU: glibc keeps freed memory for reuse (no page faults)")
    p.add_argument("--presets", nargs="*", default=list(PRESETS))
    args = p.parse_args()
    if args.phase:
        lib, preset, what = args.phase
        print(json.dumps(forward_phase(args, lib, preset) if what == "forward" else phase(args, lib, preset, what)))
        return
    mo = None if args.no_modelopt else modelopt_available()
    print(f"# bench_calibrate: {args.blocks} blocks of {args.dim}->{4 * args.dim}->{args.dim}, {args.batches} batches of {args.tokens} "
          f"tokens, fp32, device {args.device}")
    print(f"# torch {torch.__version__}, python {platform.python_version()}, ModelOpt {mo or 'not installed'}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus")
    bare = in_subprocess(args, "quantlib", "INT8", "bare")
    print(f"\n(a) bare forward loop: {bare['time'] * 1e3:.1f} ms; model {bare['model_bytes'] / 2**20:.1f} MiB; peak extra memory "
          f"{bare['peak_extra'] / 2**20:.1f} MiB\n")
    # on the CPU, (c) is also timed with glibc as users have it: the fixed mmap threshold that steadies
    # peak RSS makes every fresh activation page-fault, which a quantized forward has more of
    own_malloc = not args.device.startswith("cuda") and not args.reuse_freed_memory
    extra = " (c)/bare fwd, default malloc |" if own_malloc else ""
    # peak RSS includes pages of libraries' code first touched by (b) (aminmax, the C++ kernels): a fixed
    # few MiB, whatever the model's size; "data" leaves them out of both (a) and (b)
    data_col = " peak (b)/(a), data |" if own_malloc else ""
    print("| preset | lib | (a) in the same process ms | (b) quantize ms | (b)/(a) | first (b) ms | (c) fwd ms | (c)/bare fwd | target (c) "
          "| peak (b)/(a) | peak (b) extra / model |" + data_col + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if own_malloc else ""))
    for preset in args.presets:
        libs = ["quantlib"] + (["modelopt"] if mo and (args.device.startswith("cuda") or preset in MODELOPT_CPU) else [])
        for lib in libs:
            r = in_subprocess(args, lib, preset, "quantize")
            if r is None:
                print(f"| {preset} | {lib} | failed | | | | | | | | |")
                continue
            target = 1.05 if preset in WEIGHT_ONLY else 1.15
            print(
                f"| {preset} | {lib} | {r['bare_loop'] * 1e3:.1f} | {r['time'] * 1e3:.1f} | {r['time'] / r['bare_loop']:.3f} | "
                f"{r['first'] * 1e3:.1f} | {r['fwd'] * 1e3:.2f} | {r['fwd'] / r['bare_fwd']:.3f} | <= {target} |"
                f" {max(r['peak_extra'], 1) / max(bare['peak_extra'], 1):.3f} | {r['peak_extra'] / bare['model_bytes']:.3f} |"
                + (f" {max(r['peak_extra'] - r['code_pages'], 1) / max(bare['peak_extra'] - bare['code_pages'], 1):.3f} |"
                   + own(args, lib, preset) if own_malloc else ""),
                flush=True,
            )


def own(args, lib: str, preset: str) -> str:
    f = in_subprocess(args, lib, preset, "forward", malloc="default")
    return " failed |" if f is None else f" {f['fwd'] / f['bare_fwd']:.3f} |"


if __name__ == "__main__":
    main()
