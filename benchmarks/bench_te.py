"""Cost of quantlib's fake quantization inside Transformer Engine layers, against the same layer
unquantized and against ModelOpt's TE plugin on the same layer and preset, in one run (GPU, TE's binding).

Layers: ``te.GroupedLinear`` (E experts, hidden -> ffn) and Megatron-Core's ``TEGroupedMLP`` (fc1, GELU,
fc2 as TE grouped linears; TP = EP = 1), bf16, the tokens split evenly over the experts. For each preset:
forward (no grad: quantlib reuses its fake-quantized weights) and forward + backward (QAT: weights
quantized every step; the straight-through backward passes the gradient everywhere in both libraries,
their default, or zeroes it where ``|x| > amax`` in both with ``--clipped-ste``), median of
``triton.testing.do_bench``; ratios to the unquantized layer, and
quantlib's speed-up over ModelOpt. Calibration (max, on two batches) is not timed. Each library runs
in child processes of its own (ModelOpt's plugin patches TE process-wide); ``--profile FP8`` prints the
top CUDA kernels of a preset's GroupedLinear forward + backward and its host time per step against the
wall time (the unquantized layer's too), which says whether the step is host-bound.

The first section measures what TE's GEMM does with fp32 inputs (TF32 or not): the cause of the
difference between TE's GroupedLinear and a torch fp32 reference (issue 14).

    python benchmarks/bench_te.py --json out.json            # needs a GPU and transformer_engine
    python benchmarks/bench_te.py --no-modelopt --presets FP8 INT4-block
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

#: preset -> (quantlib name, ModelOpt name); ModelOpt has FP8 128x128 weight blocks only for weight-only
#: quantization: its input quantizer entry is replaced by quantlib's dynamic 1x128 blocks (modelopt_config)
PRESETS = {
    "FP8": ("FP8_DEFAULT_CFG", "FP8_DEFAULT_CFG"),
    "FP8-block": ("FP8_BLOCKWISE_CFG", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"),
    "NVFP4": ("NVFP4_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"),
    "MXFP8": ("MXFP8_DEFAULT_CFG", "MXFP8_DEFAULT_CFG"),
    "INT8": ("INT8_DEFAULT_CFG", "INT8_DEFAULT_CFG"),
    "INT4-block": ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"),
    "W4A8": ("W4A8_AWQ_BETA_CFG", "W4A8_AWQ_BETA_CFG"),
}
WEIGHT_ONLY = {"INT4-block"}


def gemm_precision() -> dict:
    """Max |error| against float64 of: TE's fp32 GroupedLinear GEMM, torch fp32 matmul with TF32 off, and on."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    m = te.GroupedLinear(2, 256, 128, bias=False, params_dtype=torch.float32, device="cuda")
    x = torch.randn(512, 256, device="cuda")
    splits = [256, 256]
    ws = [getattr(m, f"weight{i}").detach() for i in range(2)]
    ref = torch.cat([xs.double() @ w.double().t() for xs, w in zip(torch.split(x, splits), ws)])
    out = {}
    with torch.no_grad():
        out["te_fp32"] = (m(x, splits).double() - ref).abs().max().item()
        old = torch.backends.cuda.matmul.allow_tf32
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            y = torch.cat([xs @ w.t() for xs, w in zip(torch.split(x, splits), ws)])
            out[f"torch_fp32_tf32_{'on' if tf32 else 'off'}"] = (y.double() - ref).abs().max().item()
        torch.backends.cuda.matmul.allow_tf32 = old
    return out


def init_megatron() -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        import socket

        with socket.socket() as sock:  # a free port: the children run one after another
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


class Layer:
    """One benchmarked layer: ``build()`` a fresh unquantized one, ``args`` its forward inputs."""

    def __init__(self, kind: str, experts: int, hidden: int, ffn: int, tokens: int) -> None:
        self.kind, self.experts, self.hidden, self.ffn, self.tokens = kind, experts, hidden, ffn, tokens
        g = torch.Generator(device="cuda").manual_seed(1)
        self.x = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        self.splits = [tokens // experts] * experts
        self.splits[-1] += tokens - sum(self.splits)

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        if self.kind == "GroupedLinear":
            import transformer_engine.pytorch as te

            return te.GroupedLinear(self.experts, self.hidden, self.ffn, bias=False, params_dtype=torch.bfloat16, device="cuda")
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear, TERowParallelGroupedLinear
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

        cfg = TransformerConfig(
            num_layers=1, hidden_size=self.hidden, ffn_hidden_size=self.ffn, moe_ffn_hidden_size=self.ffn, num_attention_heads=8,
            num_moe_experts=self.experts, moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16, add_bias_linear=False,
            use_cpu_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        subs = GroupedMLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear)
        return TEGroupedMLP(self.experts, cfg, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda()

    def args(self, i: int) -> tuple:
        if self.kind == "GroupedLinear":
            return (self.x[i], self.splits)
        probs = torch.ones(self.tokens, device="cuda", dtype=torch.float32)
        return (self.x[i], torch.tensor(self.splits), probs)

    def loop(self, model) -> None:
        with torch.no_grad():
            for i in range(2):
                model(*self.args(i))


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def quantized(lib: str, layer: Layer, preset: str, clipped_ste: bool = False) -> torch.nn.Module:
    model = layer.build()
    ours, theirs = PRESETS[preset]
    if lib == "quantlib":
        import quantlib as ql

        cfg = copy.deepcopy(getattr(ql, ours))
        return ql.quantize(model, clipped(cfg) if clipped_ste else cfg, layer.loop)
    import modelopt.torch.quantization as mtq

    cfg = modelopt_config(preset)
    return mtq.quantize(model, clipped(cfg) if clipped_ste else cfg, layer.loop)


def clipped(cfg: dict) -> dict:
    """``cfg`` (ModelOpt's dict or list form) with ``pass_through_bwd=False`` in every quantizer config
    that sets more than ``enable``: the straight-through gradient zeroed where ``|x| > amax``."""

    def clip(c):
        if isinstance(c, list):
            return [clip(m) for m in c]
        if not isinstance(c, dict) or set(c) <= {"enable"}:
            return c
        if any(isinstance(v, dict) for k, v in c.items() if k not in ("block_sizes", "bias")):
            return {k: clip(v) for k, v in c.items()}  # a class-scoped entry: {pattern: config}
        return {**c, "pass_through_bwd": False}

    qc = cfg["quant_cfg"]
    if isinstance(qc, dict):
        cfg["quant_cfg"] = {k: clip(v) for k, v in qc.items()}
    else:
        cfg["quant_cfg"] = [{**e, "cfg": clip(e["cfg"])} if e.get("cfg") is not None else e for e in qc]
    return cfg


def modelopt_config(preset: str) -> dict:
    """ModelOpt's config of ``preset`` (its list form), calibrated by max as quantlib's."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, PRESETS[preset][1]))
    cfg["algorithm"] = "max"  # (W4A8's AWQ search is not what is timed: both libraries calibrate by max)
    if preset == "FP8-block":
        entry = {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}}}
        cfg["quant_cfg"] = [entry if e.get("quantizer_name") == "*input_quantizer" else e for e in cfg["quant_cfg"]]
    return cfg


def time_layer(model: torch.nn.Module, layer: Layer) -> tuple[float, float]:
    """(forward ms, forward + backward ms), medians."""
    from triton.testing import do_bench

    args = layer.args(2)
    model.eval()

    def fwd():
        with torch.no_grad():
            model(*args)

    x = args[0].detach().requires_grad_(True)
    grad = None

    def fwd_bwd():
        nonlocal grad
        y = _out(model(x, *args[1:]))
        if grad is None:
            grad = torch.randn_like(y)
        y.backward(grad)

    model.train()
    fwd_bwd()  # warm (and TE's first-microbatch paths)
    t_fb = do_bench(fwd_bwd, warmup=25, rep=150, return_mode="median", grad_to_none=[x] + list(model.parameters()))
    model.eval()
    fwd()
    t_f = do_bench(fwd, warmup=25, rep=150, return_mode="median")
    return t_f, t_fb


def profile(model: torch.nn.Module, layer: Layer, label: str) -> None:
    """Print the 15 CUDA kernels that take the most time over 5 forward + backward steps, then over 5
    forward steps without grad (with the host time)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    x = layer.args(2)[0].detach().requires_grad_(True)
    model.train()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            y = _out(model(x, *layer.args(2)[1:]))
            y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
    print(f"--- profile: {label}, 5 forward + backward steps", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70), flush=True)
    model.eval()
    args = layer.args(2)
    with torch.no_grad(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            model(*args)
        torch.cuda.synchronize()
    print(f"--- profile: {label}, 5 forward steps (no grad)", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70), flush=True)
    print(f"--- host: {label}: {host_times(model, layer)}", flush=True)


def host_times(model: torch.nn.Module, layer: Layer, steps: int = 20) -> str:
    """Host time per step (Python and launches, up to the last launch: no sync inside the loop) against
    wall time per step (to the GPU's end): equal numbers mean the step is host-bound. The profiler's
    CPU columns count torch ops only, not the Python between them."""
    import time

    args = layer.args(2)
    x = args[0].detach().requires_grad_(True)
    out = []
    for name, grad in (("no-grad fwd", False), ("fwd+bwd", True)):
        model.train(grad)
        for _ in range(3):
            _step(model, args, x, grad)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            _step(model, args, x, grad)
        t_host = time.perf_counter() - t0
        torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        out.append(f"{name} host {1e3 * t_host / steps:.3f} ms, wall {1e3 * t_all / steps:.3f} ms")
    model.eval()
    return "; ".join(out)


def _step(model, args, x, grad: bool) -> None:
    if grad:
        y = _out(model(x, *args[1:]))
        y.backward(torch.ones_like(y))
    else:
        with torch.no_grad():
            model(*args)


def child(args) -> None:
    """One process: one layer kind and library, the presets given; a JSON row per line to ``--rows``.
    Each library runs in processes of its own: ModelOpt's TE plugin patches TE's autograd functions
    process-wide (a quantlib layer built after it would run ModelOpt's patch) and keeps device memory
    across models."""
    kind, lib, presets = args._child[0], args._child[1], args._child[2:]
    if kind == "TEGroupedMLP":
        init_megatron()
    layer = Layer(kind, args.experts, args.hidden, args.ffn, args.tokens)

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(args.rows, "a") as f:
            f.write(json.dumps(row) + "\n")

    if lib == "bf16":
        model = layer.build()
        t = time_layer(model, layer)
        if args.profile and kind == "GroupedLinear":
            print(f"--- host: bf16 {kind}: {host_times(model, layer)}", flush=True)
        emit({"layer": kind, "preset": "none", "lib": "bf16", "fwd_ms": t[0], "fwd_bwd_ms": t[1]})
        return
    for preset in presets:
        row = {"layer": kind, "preset": preset, "lib": lib}
        try:
            model = quantized(lib, layer, preset, args.clipped_ste)
            row.update(zip(("fwd_ms", "fwd_bwd_ms"), time_layer(model, layer)))
            if preset in args.profile and kind == "GroupedLinear":
                profile(model, layer, f"{lib} {kind} {preset}")
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        emit(row)
        model = None
        torch.cuda.empty_cache()


def run(args) -> dict:
    """The parent: versions, the GEMM precision check, then one child process per (layer, library)
    (per preset for ModelOpt); a child that fails or times out leaves its rows as errors."""
    import tempfile

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    import transformer_engine

    results["transformer_engine"] = transformer_engine.__version__
    try:
        results["gemm_precision"] = gemm_precision()
    except Exception as exc:
        results["gemm_precision"] = {"error": f"{type(exc).__name__}: {exc}"}
    jobs = []
    for kind in args.layers:
        jobs += [(kind, "bf16", []), (kind, "quantlib", list(args.presets))]
        if not args.no_modelopt:
            jobs += [(kind, "modelopt", [p]) for p in args.presets]
    for name in ("modelopt", "megatron.core"):
        try:
            module = __import__(name, fromlist=["__version__"])
            results[name.replace(".", "_")] = module.__version__
        except Exception as exc:
            results[name.replace(".", "_")] = f"unavailable: {type(exc).__name__}: {exc}"
    sizes = ["--experts", str(args.experts), "--hidden", str(args.hidden), "--ffn", str(args.ffn), "--tokens", str(args.tokens)]
    sizes += ["--clipped-ste"] if args.clipped_ste else []
    for kind, lib, presets in jobs:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as rows:
            cmd = [sys.executable, os.path.abspath(__file__), *sizes, "--rows", rows.name, "--profile", *args.profile, "--_child", kind,
                   lib, *presets]
            try:
                done = subprocess.run(cmd, timeout=args.child_timeout).returncode
            except subprocess.TimeoutExpired:
                done = f"timed out after {args.child_timeout} s"
            got = [json.loads(line) for line in rows.read().splitlines() if line.strip()]
        seen = {r["preset"] for r in got}
        got += [{"layer": kind, "preset": p, "lib": lib, "error": f"child process: {done}"} for p in (presets or ["none"]) if p not in seen]
        results["rows"] += got
        if args.json:  # after every child: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(add_ratios(results), f, indent=1)
    return add_ratios(results)


def add_ratios(results: dict) -> dict:
    """Each quantized row's ratios to the unquantized layer of its kind."""
    base = {r["layer"]: r for r in results["rows"] if r["lib"] == "bf16" and "fwd_ms" in r}
    for r in results["rows"]:
        b = base.get(r["layer"])
        if r["lib"] != "bf16" and b and "fwd_ms" in r:
            r["fwd_ratio"], r["fwd_bwd_ratio"] = r["fwd_ms"] / b["fwd_ms"], r["fwd_bwd_ms"] / b["fwd_bwd_ms"]
    return results


def table(results: dict) -> str:
    rows = {(r["layer"], r["preset"], r["lib"]): r for r in results["rows"]}
    lines = [
        "| layer | preset | fwd ms (bf16 / quantlib / ModelOpt) | fwd x bf16 quantlib (target) | fwd x bf16 ModelOpt | fwd+bwd x bf16 "
        "quantlib / ModelOpt | quantlib speed-up fwd / fwd+bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for (layer, preset, lib), r in rows.items():
        if lib != "quantlib":
            continue
        b, m = rows[(layer, "none", "bf16")], rows.get((layer, preset, "modelopt"), {})
        if "error" in r:
            lines.append(f"| {layer} | {preset} | error: {r['error'][:80]} | | | | |")
            continue
        target = "<= 1.05" if preset in WEIGHT_ONLY else "<= 1.15"
        mo_f = f"{m['fwd_ms']:.3f}" if "fwd_ms" in m else "-"
        mo_ratio = f"{m['fwd_ratio']:.3f}" if "fwd_ratio" in m else (m.get("error", "-")[:40] if m else "-")
        mo_fb = f"{m['fwd_bwd_ratio']:.3f}" if "fwd_bwd_ratio" in m else "-"
        speed = f"{m['fwd_ms'] / r['fwd_ms']:.2f} / {m['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}" if "fwd_ms" in m else "-"
        lines.append(
            f"| {layer} | {preset} | {b['fwd_ms']:.3f} / {r['fwd_ms']:.3f} / {mo_f} | {r['fwd_ratio']:.3f} ({target}) | {mo_ratio} "
            f"| {r['fwd_bwd_ratio']:.3f} / {mo_fb} | {speed} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--layers", nargs="+", default=["GroupedLinear", "TEGroupedMLP"], choices=["GroupedLinear", "TEGroupedMLP"])
    p.add_argument("--no-modelopt", action="store_true")
    p.add_argument("--clipped-ste", action="store_true", help="both libraries with pass_through_bwd=False (gradient zeroed where |x| > "
                                                              "amax); default: both pass through, ModelOpt 0.47's default")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", nargs="*", default=[], choices=list(PRESETS), help="print the top CUDA kernels of these presets' "
                                                                                   "GroupedLinear forward + backward")
    p.add_argument("--child-timeout", type=int, default=300, help="seconds one child process may take")
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_te.py needs a CUDA GPU")
    if args._child:
        child(args)
        return
    results = run(args)
    results["args"] = vars(args)
    print(json.dumps(results.get("gemm_precision")))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
