"""Cost of quantlib's quantized MoE layer against the same layer unquantized and against ModelOpt, in one run.

The layer is transformers' ``Qwen3MoeSparseMoeBlock`` (router + fused experts, ``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I)) built from a config: E experts, top-k, hidden H, expert width I. The unquantized
layer runs transformers' own experts implementation (``grouped_mm`` on an accelerator, ``eager`` on the
CPU, or ``--baseline``: the name is in the table). Each preset is applied to a copy by ``quantlib.quantize`` and by
ModelOpt's ``mtq.quantize`` (same preset name, max calibration on one batch, not timed). Timed, median of
``--reps``: forward without grad (quantlib reuses its fake-quantized weights: the weight cache) and
forward + backward (QAT: weights fake-quantized every step). Ratios: to the unquantized layer, and
ModelOpt's time over quantlib's. ModelOpt runs in a child process per preset (its plugin re-registers
transformers' experts class process-wide).

    python benchmarks/bench_moe.py --device cuda --json moe.json      # E=64 and E=128, top-8, bf16
    python benchmarks/bench_moe.py --small --json moe_cpu.json        # CPU-sized layer, fp32
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


def timed(fn, device: str, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (device-synchronised)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(layer: torch.nn.Module, x: torch.Tensor, device: str, reps: int) -> dict:
    """Forward (no grad) and forward + backward seconds of ``layer`` on ``x``."""
    layer.eval()

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        layer(x).float().square().mean().backward()

    out = {"fwd": timed(fwd, device, reps)}
    layer.train()
    out["fwd_bwd"] = timed(fwd_bwd, device, reps)
    layer.eval()
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
        return impl, measure(layer, x, args.device, args.reps)
    raise RuntimeError("no experts implementation of transformers runs forward + backward here")


def run_quantlib(shape: tuple, args, name: str, x: torch.Tensor) -> dict:
    layer = build_layer(*shape, args.top_k, "eager", args.dtype, args.device)
    ql.quantize(layer, ql.PRESETS[name], lambda m: m(x))
    return measure(layer, x, args.device, args.reps)


def run_modelopt(shape: tuple, args, name: str, x: torch.Tensor) -> dict:
    """ModelOpt's numbers, measured in a child process: its HF plugin re-registers transformers' experts
    class process-wide, which would change every layer built after it in this process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--modelopt-child", name, ",".join(map(str, shape)), "--device", args.device,
           "--top-k", str(args.top_k), "--reps", str(args.reps), "--tokens", str(x.shape[1])]  # fmt: skip
    cmd += ["--small"] if args.small else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("MODELOPT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1][len("MODELOPT ") :])


def modelopt_child(args) -> None:
    """In the child process: quantize the layer with ModelOpt and print its times."""
    import modelopt.torch.quantization as mtq

    shape = tuple(int(v) for v in args.shape.split(","))
    x = torch.randn(1, args.tokens, shape[1], generator=torch.Generator().manual_seed(1)).to(args.device, args.dtype)
    layer = build_layer(*shape, args.top_k, "eager", args.dtype, args.device)
    mtq.quantize(layer, copy.deepcopy(getattr(mtq, args.modelopt_child)), lambda m: m(x))
    print("MODELOPT " + json.dumps(measure(layer, x, args.device, args.reps)))


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


def main() -> None:
    p = layer_args(__doc__)
    p.add_argument("--baseline", choices=["grouped_mm", "batched_mm", "eager"], default=None, help="transformers' experts implementation "
                                                                                                   "of the unquantized layer")
    p.add_argument("--no-modelopt", action="store_true")
    p.add_argument("--modelopt-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("shape", nargs="?", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = torch.float32 if args.small else torch.bfloat16
    tokens = args.tokens or (128 if args.small else 4096)
    args.reps = args.reps or (5 if args.small else 20)
    if args.modelopt_child:
        args.tokens = tokens
        modelopt_child(args)
        return
    rows = []
    for shape in SMALL_SHAPES if args.small else SHAPES:
        x = torch.randn(1, tokens, shape[1], generator=torch.Generator().manual_seed(1)).to(args.device, args.dtype)
        impl, base = baseline(shape, args, x)
        print(f"E={shape[0]} H={shape[1]} I={shape[2]} top-{args.top_k} tokens={tokens} {args.dtype} {args.device}: unquantized ({impl}) "
              f"fwd {base['fwd'] * 1e3:.2f} ms, fwd+bwd {base['fwd_bwd'] * 1e3:.2f} ms")
        for preset in args.presets:
            ours_name, theirs_name, weight_only = PRESETS[preset]
            row = {"experts": shape[0], "hidden": shape[1], "width": shape[2], "top_k": args.top_k, "tokens": tokens,
                   "dtype": str(args.dtype), "device": args.device,
                   "preset": preset, "weight_only": weight_only, "baseline_impl": impl, "unquantized": base}  # fmt: skip
            row["quantlib"] = run_quantlib(shape, args, ours_name, x)
            if not args.no_modelopt:
                try:
                    row["modelopt"] = run_modelopt(shape, args, theirs_name, x)
                except Exception as exc:  # report and go on: one library's failure is a result too
                    print(f"  ModelOpt {preset}: {type(exc).__name__}: {str(exc)[:200]}")
                    row["modelopt_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            report(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "rows": rows}, f, indent=1)
    print_table(rows)


def report(row: dict) -> None:
    q, b = row["quantlib"], row["unquantized"]
    mo = row.get("modelopt")
    extra = (f", ModelOpt fwd {mo['fwd'] * 1e3:.2f} / fwd+bwd {mo['fwd_bwd'] * 1e3:.2f} ms" if mo
             else f", ModelOpt: {row.get('modelopt_error', 'not run')}")
    print(f"  {row['preset']}: quantlib fwd {q['fwd'] * 1e3:.2f} ms ({q['fwd'] / b['fwd']:.2f}x), fwd+bwd {q['fwd_bwd'] * 1e3:.2f} ms "
          f"({q['fwd_bwd'] / b['fwd_bwd']:.2f}x){extra}")


def print_table(rows: list[dict]) -> None:
    print("\n| E | H | I | preset | unquantized fwd / fwd+bwd ms | quantlib fwd / fwd+bwd ms | vs unquantized | ModelOpt fwd / fwd+bwd ms "
          "| ModelOpt / quantlib |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, q, mo = r["unquantized"], r["quantlib"], r.get("modelopt")
        mo_t = f"{mo['fwd'] * 1e3:.2f} / {mo['fwd_bwd'] * 1e3:.2f}" if mo else r.get("modelopt_error", "-")[:40]
        mo_r = f"{mo['fwd'] / q['fwd']:.2f}x / {mo['fwd_bwd'] / q['fwd_bwd']:.2f}x" if mo else "-"
        print(f"| {r['experts']} | {r['hidden']} | {r['width']} | {r['preset']}{' (W only)' if r['weight_only'] else ''} | "
              f"{b['fwd'] * 1e3:.2f} / {b['fwd_bwd'] * 1e3:.2f} ({r['baseline_impl']}) "
              f"| {q['fwd'] * 1e3:.2f} / {q['fwd_bwd'] * 1e3:.2f} | {q['fwd'] / b['fwd']:.2f}x / {q['fwd_bwd'] / b['fwd_bwd']:.2f}x | "
              f"{mo_t} | {mo_r} |")  # fmt: skip


if __name__ == "__main__":
    main()
