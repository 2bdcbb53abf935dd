"""Cost of quantlib's quantized MoE layer against the same layer unquantized and against ModelOpt, in one run.

The layer is transformers' ``Qwen3MoeSparseMoeBlock`` (router + fused experts, ``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I)) built from a config: E experts, top-k, hidden H, expert width I. The unquantized
layer runs transformers' own experts implementation (``grouped_mm`` on an accelerator, ``eager`` on the
CPU, or ``--baseline``: the name is in the table). Each preset is applied to a copy by ``quantlib.quantize`` and by
ModelOpt's ``mtq.quantize`` (same preset name, max calibration on one batch, not timed). Timed, median of
``--reps`` (each a call then a device sync):

- ``fwd``: eval forward without grad; quantlib reuses its fake-quantized weights (the weight cache), and
  quantizes the activations as the preset says;
- ``fwd_host``: of ``fwd``, the time until the call returned, before the device sync: the host's share
  (where it is near ``fwd``, the layer is bound by its launches, not by the device);
- ``fwd_graph``: ``fwd`` captured once in a CUDA graph and replayed (CUDA only): the device time alone;
- ``fwd_w``: the same with the input quantizers disabled: weight-only with the weight cache (the preset's
  own number for a weight-only preset);
- ``fwd_qat``: training-mode forward with autograd recording (QAT: the weights fake-quantized every call);
- ``fwd_bwd``: that forward and its backward.

Ratios: to the unquantized layer's same column, and ModelOpt's time over quantlib's. ModelOpt runs last, in
one child process for all its rows (its plugin re-registers transformers' experts class process-wide),
with fewer repetitions and a time limit per row and for the whole child (``--modelopt-limit``): it is 11-38x
slower. The JSON (``--json``) is rewritten after every row, so a run cut short keeps what it measured.

    python benchmarks/bench_moe.py --device cuda --json moe.json        # E=64 and E=128, top-8, bf16: ~4 min on an H100
    python benchmarks/bench_moe.py --small --device cpu --json moe_cpu.json   # CPU-sized layers, fp32
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import quantlib as ql  # noqa: E402

#: preset -> (quantlib name, ModelOpt name, weight-only)
PRESETS = {
    "FP8": ("FP8_DEFAULT_CFG", "FP8_DEFAULT_CFG", False),
    "NVFP4": ("NVFP4_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", False),
    "INT4-block": ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", True),
}
#: (experts, hidden, expert width): Qwen1.5/2-MoE-like (64 experts) and Qwen3-30B-A3B-like (128)
SHAPES = [(64, 2048, 1408), (128, 2048, 768)]
SMALL_SHAPES = [(16, 256, 128), (32, 256, 64)]


def build_layer(experts: int, hidden: int, width: int, top_k: int, impl: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A Qwen3-MoE sparse block with random weights (std 0.02), its experts run by transformers' ``impl``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=True, experts_implementation=impl)
    torch.manual_seed(0)
    layer = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    return layer.to(device=device, dtype=dtype)


def timed(fn, device: str, reps: int, warmup: int = 2, limit_s: float = float("inf"), host: Optional[list] = None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (device-synchronised); fewer (at least one) where the
    warm-ups and runs would pass ``limit_s``. ``host`` gets each run's seconds until ``fn`` returned (the
    launches, before the device caught up)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if host is not None:
            host.append(time.perf_counter() - t)
        sync()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start + times[-1] > limit_s:
            break
    return statistics.median(times)


def graphed(fn, device: str, reps: int) -> float:
    """Median seconds of replaying ``fn`` captured in one CUDA graph (no host work: the device's time, as a
    serving engine's graphs see it); NaN off CUDA or where the capture fails (the reason printed)."""
    if device != "cuda":
        return float("nan")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        print(f"  CUDA graph capture failed: {str(exc)[:200]}", flush=True)
        return float("nan")
    return timed(graph.replay, device, reps)


def measure(layer: torch.nn.Module, x: torch.Tensor, device: str, reps: int, limit_s: float = float("inf"),
            weight_only: Optional[Callable[[], object]] = None, qat_forward: bool = True, graph: bool = True) -> dict:
    """Seconds of ``layer`` on ``x``: ``fwd`` (eval, no grad; ``fwd_host`` its launches alone, ``fwd_graph``
    replayed as a CUDA graph, if ``graph``), ``fwd_w`` (the same after ``weight_only()`` disabled
    the input quantizers), ``fwd_qat`` (train mode, autograd recording; if ``qat_forward``) and ``fwd_bwd``;
    each column within ``limit_s`` (see :func:`timed`)."""

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        layer(x).float().square().mean().backward()

    layer.eval()
    host: list = []
    out = {"fwd": timed(fwd, device, reps, limit_s=limit_s, host=host), "fwd_host": statistics.median(host)}
    layer.train()
    if qat_forward:
        out["fwd_qat"] = timed(lambda: layer(x), device, reps, limit_s=limit_s)
    out["fwd_bwd"] = timed(fwd_bwd, device, reps, limit_s=limit_s)
    layer.zero_grad(set_to_none=True)
    layer.eval()
    # last but the weight-only column: a capture that fails spoils no other column of this layer
    out["fwd_graph"] = graphed(fwd, device, reps) if graph else float("nan")
    if weight_only is not None:
        weight_only()
        out["fwd_w"] = timed(fwd, device, reps, limit_s=limit_s)
    return out


def baseline(shape: tuple, args, x: torch.Tensor) -> tuple[str, dict]:
    """The unquantized layer with transformers' experts implementation (``--baseline``; else ``grouped_mm`` on
    an accelerator, ``eager`` on the CPU, where torch's ``_grouped_mm`` is slower than a loop of BLAS calls),
    the next one where its backward does not run here."""
    first = args.baseline or ("eager" if args.device == "cpu" else "grouped_mm")
    for impl in dict.fromkeys((first, "grouped_mm", "eager")):
        layer = build_layer(*shape, args.top_k, impl, args.dtype, args.device)
        try:
            layer(x).float().sum().backward()
        except RuntimeError as exc:
            print(f"  unquantized {impl}: backward fails here ({str(exc)[:80]}); next implementation")
            continue
        times = measure(layer, x, args.device, args.reps)
        return impl, {**times, "fwd_w": times["fwd"]}
    raise RuntimeError("no experts implementation of transformers runs forward + backward here")


def run_quantlib(shape: tuple, args, name: str, x: torch.Tensor, weight_only: bool) -> dict:
    layer = build_layer(*shape, args.top_k, "eager", args.dtype, args.device)
    ql.quantize(layer, ql.PRESETS[name], lambda m: m(x))
    inputs_off = None if weight_only else (lambda: ql.disable_quantizer(layer, "*input_quantizer"))
    times = measure(layer, x, args.device, args.reps, weight_only=inputs_off)
    return times if not weight_only else {**times, "fwd_w": times["fwd"]}


#: ModelOpt presets whose fake quant runs on CUDA only (its NVFP4 kernels)
MODELOPT_CUDA_ONLY = {"NVFP4_DEFAULT_CFG"}


def run_modelopt(jobs: list[tuple], args) -> dict:
    """ModelOpt's numbers for ``jobs`` ((shape, preset name) pairs), measured in one child process: its HF
    plugin re-registers transformers' experts class process-wide, which would change every layer built after
    it in this process. Rows print as they finish; what the time limit cut off is reported by name."""
    spec = ";".join(f"{','.join(map(str, shape))}:{name}" for shape, name in jobs)
    cmd = [sys.executable, os.path.abspath(__file__), "--modelopt-child", spec, "--device", args.device, "--top-k", str(args.top_k),
           "--reps", str(args.modelopt_reps), "--tokens", str(args.tokens), "--row-limit", str(args.row_limit)]  # fmt: skip
    cmd += ["--small"] if args.small else []
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.modelopt_limit)
        stdout, why = done.stdout, "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired as exc:
        stdout, why = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), \
            f"time limit {args.modelopt_limit:.0f} s of the ModelOpt child"
    results = {}
    for line in stdout.splitlines():
        if line.startswith("MODELOPT "):
            row = json.loads(line[len("MODELOPT "):])
            results[(tuple(row.pop("shape")), row.pop("preset"))] = row
    for job in jobs:
        results.setdefault((tuple(job[0]), job[1]), {"error": why or "no output"})
    return results


def modelopt_child(args) -> None:
    """In the child process: quantize each (shape, preset) layer with ModelOpt and print its times."""
    import modelopt.torch.quantization as mtq

    for job in args.modelopt_child.split(";"):
        shape_s, name = job.split(":")
        shape = tuple(int(v) for v in shape_s.split(","))
        row = {"shape": shape, "preset": name}
        if args.device != "cuda" and name in MODELOPT_CUDA_ONLY:
            row["error"] = f"skipped: ModelOpt's {name} fake quant needs CUDA"
        else:
            x = torch.randn(1, args.tokens, shape[1], generator=torch.Generator().manual_seed(1)).to(args.device, args.dtype)
            layer = build_layer(*shape, args.top_k, "eager", args.dtype, args.device)
            try:
                mtq.quantize(layer, copy.deepcopy(getattr(mtq, name)), lambda m, x=x: m(x))
                # (no CUDA graph: a failed capture could leave the next columns' stream unusable)
                row.update(measure(layer, x, args.device, args.reps, limit_s=args.row_limit, qat_forward=False, graph=False))
            except Exception as exc:  # report and go on: one library's failure is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            del layer
        print("MODELOPT " + json.dumps(row), flush=True)


def layer_args(doc: str) -> argparse.ArgumentParser:
    """The options every MoE-layer benchmark takes (device, sizes, presets, repetitions, JSON output)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="CPU-sized layers (16 and 32 experts, hidden 256), fp32")
    p.add_argument("--tokens", type=int, default=None, help="tokens per forward (default 4096; --small: 128)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; --small: 5)")
    p.add_argument("--json", default=None, help="write the rows here")
    return p


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the benchmark (``argv``: the command line's arguments) and return its rows."""
    p = layer_args(__doc__)
    p.add_argument("--baseline", choices=["grouped_mm", "batched_mm", "eager"], default=None, help="transformers' experts implementation "
                                                                                                   "of the unquantized layer")
    p.add_argument("--no-modelopt", action="store_true")
    p.add_argument("--modelopt-reps", type=int, default=5, help="timed repetitions of ModelOpt's layers")
    p.add_argument("--row-limit", type=float, default=20.0, help="seconds for each of ModelOpt's timed columns (fewer reps past it)")
    p.add_argument("--modelopt-limit", type=float, default=240.0, help="seconds for the whole ModelOpt child process")
    p.add_argument("--modelopt-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = torch.float32 if args.small else torch.bfloat16
    args.tokens = args.tokens or (128 if args.small else 4096)
    args.reps = args.reps or (5 if args.small else 20)
    if args.modelopt_child:
        modelopt_child(args)
        return []
    meta = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "top_k": args.top_k, "tokens": args.tokens, "dtype": str(args.dtype)}
    rows = []
    for shape in SMALL_SHAPES if args.small else SHAPES:
        x = torch.randn(1, args.tokens, shape[1], generator=torch.Generator().manual_seed(1)).to(args.device, args.dtype)
        impl, base = baseline(shape, args, x)
        print(f"E={shape[0]} H={shape[1]} I={shape[2]} top-{args.top_k} tokens={args.tokens} {args.dtype} {args.device}: unquantized "
              f"({impl}) " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in base.items()), flush=True)
        for preset in args.presets:
            ours_name, theirs_name, weight_only = PRESETS[preset]
            row = {"experts": shape[0], "hidden": shape[1], "width": shape[2], "preset": preset, "modelopt_name": theirs_name,
                   "weight_only": weight_only, "baseline_impl": impl, "unquantized": base}  # fmt: skip
            try:
                row["quantlib"] = run_quantlib(shape, args, ours_name, x, weight_only)
            except Exception as exc:  # report and go on: the other rows still count
                row["quantlib_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"  {preset}: quantlib failed: {row['quantlib_error']}", flush=True)
            rows.append(row)
            if "quantlib" in row:
                report(row)
            dump(args.json, meta, rows)
    if not args.no_modelopt:
        theirs = run_modelopt([((r["experts"], r["hidden"], r["width"]), r["modelopt_name"]) for r in rows], args)
        for r in rows:
            got = theirs[((r["experts"], r["hidden"], r["width"]), r["modelopt_name"])]
            r["modelopt" if "error" not in got else "modelopt_error"] = got if "error" not in got else got["error"]
        dump(args.json, meta, rows)
    print_table(rows)
    return rows


def dump(path: Optional[str], meta: dict, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


#: (column, its heading): the times every row reports, in the table's order
COLUMNS = (("fwd", "fwd W+A (cache)"), ("fwd_host", "its host time"), ("fwd_graph", "fwd W+A (cache), CUDA graph"),
           ("fwd_w", "fwd W only (cache)"), ("fwd_qat", "fwd QAT"), ("fwd_bwd", "fwd+bwd QAT"))


def report(row: dict) -> None:
    q, b = row["quantlib"], row["unquantized"]
    print(f"  {row['preset']}: quantlib " + ", ".join(f"{k} {q[k] * 1e3:.2f} ms ({q[k] / b[k]:.2f}x)" for k, _ in COLUMNS), flush=True)


def print_table(rows: list[dict]) -> None:
    """Markdown tables: quantlib against the unquantized layer, then against ModelOpt."""
    print("\n| E | H | I | preset | " + " | ".join(f"{h} ms: unquantized / quantlib (x)" for _, h in COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    for r in (r for r in rows if "quantlib" in r):
        b, q = r["unquantized"], r["quantlib"]
        cells = [f"{b[k] * 1e3:.2f} / {q[k] * 1e3:.2f} ({q[k] / b[k]:.2f}x)" for k, _ in COLUMNS]
        print(f"| {r['experts']} | {r['hidden']} | {r['width']} | {r['preset']}{' (W only)' if r['weight_only'] else ''} "
              f"({r['baseline_impl']}) | " + " | ".join(cells) + " |")
    print("\n| E | H | I | preset | ModelOpt fwd / fwd+bwd ms | quantlib fwd / fwd+bwd ms | ModelOpt / quantlib fwd, fwd+bwd |")
    print("|---|---|---|---|---|---|---|")
    for r in (r for r in rows if "quantlib" in r):
        q, mo = r["quantlib"], r.get("modelopt")
        if mo is None:
            theirs, ratio = str(r.get("modelopt_error", "not run"))[:60], "-"
        else:
            theirs = f"{mo['fwd'] * 1e3:.2f} / {mo['fwd_bwd'] * 1e3:.2f}"
            ratio = f"{mo['fwd'] / q['fwd']:.1f}x, {mo['fwd_bwd'] / q['fwd_bwd']:.1f}x"
        print(f"| {r['experts']} | {r['hidden']} | {r['width']} | {r['preset']} | {theirs} | {q['fwd'] * 1e3:.2f} / "
              f"{q['fwd_bwd'] * 1e3:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
