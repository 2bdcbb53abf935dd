"""Export throughput: quantlib's in-memory iterator (and checkpoint writer) against ModelOpt's HF export.

    python benchmarks/bench_export.py                       # GPU: Llama hidden 8192 / 28672, 3 layers (5.1 GB)
    python benchmarks/bench_export.py --device cpu --small  # smoke run: a tiny Llama on the CPU
    python benchmarks/bench_export.py --model moe           # GPU: Qwen3-MoE hidden 2048, 128 experts of 768, 4 layers (5.0 GB)
    options: --layers N --hidden H --intermediate I --experts E --moe-intermediate I --runs R
             --formats fp8_block,mxfp8,fp8,nvfp4 --disk --profile [--trace DIR] --out FILE

``--model moe`` builds a Qwen3-MoE (every layer sparse, experts as transformers keeps them: 3-D
``gate_up_proj`` / ``down_proj`` parameters) whose bf16 expert and attention weights are ~5 GB by default;
the sync sends its experts as vLLM's stacked fused-MoE parameters (``w13_*`` / ``w2_*``), ModelOpt exports
the same experts one by one.

A transformers Llama is built in bf16 directly on ``--device`` (no CPU init of GBs, no downloads) and
quantized by quantlib and, separately, by ModelOpt with the same recipe, calibrated on the same batch:
FP8 128x128 weight blocks (quantlib format ``hf_fp8_block``, HF fine-grained FP8; ModelOpt FP8_PB_WO),
MXFP8 (``hf_mxfp8``; ModelOpt MXFP8), FP8 per tensor W8A8 (``modelopt_fp8``; ModelOpt FP8), NVFP4 W4A4
(``modelopt_nvfp4``; ModelOpt NVFP4) and INT4 AWQ (``ct_int_pack``, every pre_quant_scale folded into the norms and
v_proj / up_proj rows), also timed on the same model without its pre_quant_scale (the fold's cost).

Timed (median of ``--runs`` after one warm-up run, which compiles and tunes the kernels), each with one
device synchronisation at the end only: ``iter_packed`` with a consumer that drops every tensor without
reading it; the RL weight sync ``sync_pairs`` (scales computed from the weights being sent, as after
optimizer steps) with the same consumer; a bf16 copy (``clone``) of every packed weight, measured the same way (the "copy
bandwidth"); ModelOpt's in-memory ``_export_transformers_checkpoint`` on a fresh copy each run (it edits
the model); with ``--disk`` also ``export_checkpoint`` and ModelOpt's ``export_hf_checkpoint``. GB/s =
bytes of the bf16 linear weights that are packed / time (embeddings, norms and lm_head pass through
unpacked and are not counted). On CUDA, the peak device memory above the model during the iterator
(``max_memory_allocated``) is printed next to the largest module's packed tensors; ``--profile`` prints
the summed device-kernel time of one iteration and of one sync (what the GPU itself spends), and with ``--trace DIR``
writes that sync's profile as a Chrome trace and prints where the device waited in it (before its first kernel, between
kernels).
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import quantlib as ql
from quantlib.export import export_checkpoint, iter_packed, layout_for, share_pre_quant_scale, share_sibling_amax, sync_pairs
from quantlib.export.modules import ModuleWalk
from quantlib.export.plan import make_plan
from quantlib.export.writers import packer

#: recipe key -> (label, quantlib preset, quantlib format, ModelOpt preset name or None)
RECIPES = {
    "fp8_block": ("FP8 128x128 weights (HF fine-grained FP8)", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "hf_fp8_block",
                  "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"),
    "mxfp8": ("MXFP8 W8A8 (HF mxfp8)", "MXFP8_DEFAULT_CFG", "hf_mxfp8", "MXFP8_DEFAULT_CFG"),
    "fp8": ("FP8 per tensor W8A8 (ModelOpt FP8)", "FP8_DEFAULT_CFG", "modelopt_fp8", "FP8_DEFAULT_CFG"),
    "nvfp4": ("NVFP4 W4A4 (ModelOpt NVFP4)", "NVFP4_DEFAULT_CFG", "modelopt_nvfp4", "NVFP4_DEFAULT_CFG"),
    # ModelOpt writes AWQ as W4A16_AWQ, not compressed-tensors: not the same work, so no ModelOpt row
    "int4_awq": ("INT4 AWQ W4A16 (compressed-tensors pack-quantized, pre_quant_scale folded)", "INT4_AWQ_CFG", "ct_int_pack", None),
}
#: recipes whose calibration sets pre_quant_scale: also timed on the same model without it (the fold's cost)
AWQ = ("int4_awq",)


def build(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, device: str,
          experts: int = 0, moe_intermediate: int = 0) -> torch.nn.Module:
    """A random bf16 Llama (``experts == 0``) or Qwen3-MoE (every layer ``experts`` experts of ``moe_intermediate``,
    top 8, heads of 128 as every Qwen3) created on ``device`` (parameters are allocated and initialised there)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256, tie_word_embeddings=False)
    if experts:
        cfg = Qwen3MoeConfig(**common, head_dim=128, num_experts=experts, num_experts_per_tok=min(8, experts),
                             moe_intermediate_size=moe_intermediate, architectures=["Qwen3MoeForCausalLM"])
        cls = Qwen3MoeForCausalLM
    else:
        cfg, cls = LlamaConfig(**common, architectures=["LlamaForCausalLM"]), LlamaForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=torch.bfloat16).eval()


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights every recipe packs: the decoder's linear layers (lm_head stays bf16) and the experts' 3-D
    projections (the router is not quantized)."""
    out = [m.weight for n, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and "lm_head" not in n and not n.endswith("mlp.gate")]
    return out + [p for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[object], object], runs: int, fresh: Callable[[], object], device: str, warmup: int = 3) -> float:
    """Median seconds of ``fn(fresh())``, synchronised once before and once after each run, with the
    garbage collector paused (as timeit does) and three warm-ups: with one warm-up and the collector on,
    a recipe timed first ran slower than the same recipe timed second (benchmarks/RESULTS_export_h200.md)."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + runs):
            arg = fresh()
            sync(device)
            t0 = time.perf_counter()
            fn(arg)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            del arg
    finally:
        gc.enable()
    return statistics.median(times)


def drop_all(model: torch.nn.Module, fmt: str) -> None:
    """The consumer of the in-memory benchmark: takes every packed tensor and drops it (no device read)."""
    for pw in iter_packed(model, fmt):
        del pw


def without_pre_quant_scale(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every ``pre_quant_scale`` dropped: the same weights, amax and formats, nothing to fold."""
    plain = copy.deepcopy(model)
    for q in plain.modules():
        if isinstance(q, ql.TensorQuantizer) and q.pre_quant_scale is not None:
            q.pre_quant_scale = None
    return plain


class _Traffic(TorchDispatchMode):
    """Bytes that the aten ops (views excepted) read from and write to tensors of at least ``min_numel`` elements, and
    the aten ops by name (views included: each is a dispatcher call the host pays for)."""

    VIEWS = frozenset({"view", "_unsafe_view", "alias", "as_strided", "detach", "expand", "unsqueeze", "squeeze", "reshape", "t",
                       "transpose", "permute", "slice", "select"})

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel, self.read, self.written = min_numel, 0, 0
        self.ops: collections.Counter = collections.Counter()

    def _bytes(self, tree) -> int:
        return sum(t.nbytes for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.__name__] += 1
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.read += self._bytes((args, kwargs))
            self.written += self._bytes(out)
        return out


def weight_traffic(fn: Callable[[], object], min_numel: int) -> tuple[int, int]:
    """(bytes read, bytes written) by ``fn()``'s aten ops on tensors of at least ``min_numel`` elements: a count of the
    passes over the weights (kernels outside aten, e.g. Triton's, are not seen)."""
    fn()  # caches (layout, plan) out of the count
    with _Traffic(min_numel) as count:
        fn()
    return count.read, count.written


def plan_only(model: torch.nn.Module, fmt: str) -> None:
    """The plan as ``iter_packed`` makes it before its first kernel: the layout and the checks, one module walk."""
    walk = ModuleWalk(model)
    make_plan(model, packer(fmt), layout_for(model, walk), modules=walk)


def sync_all(model: torch.nn.Module, fmt: str) -> None:
    """The RL weight-sync consumer: every ``(key, tensor)`` of :func:`sync_pairs` (scales from the weights
    being sent), dropped without a device read."""
    for kv in sync_pairs(model, fmt):
        del kv


def copy_all(weights: list[torch.Tensor]) -> None:
    for w in weights:
        w.clone()


def peak_extra(model: torch.nn.Module, fmt: str, device: str) -> tuple[int, int]:
    """(peak device bytes allocated above the model while iterating, largest module's packed bytes)."""
    largest = max(pw.nbytes for pw in iter_packed(model, fmt))
    return peak_of(lambda: drop_all(model, fmt), device), largest


def sync_peak_extra(model: torch.nn.Module, fmt: str, device: str) -> tuple[int, int]:
    """(peak device bytes above the model during :func:`sync_all`, the largest tensor it yields): the tensor a
    sender's chunk must hold at least (stacked experts: one projection of every expert of a layer)."""
    largest = max(t.nbytes for _, t in sync_pairs(model, fmt))
    return peak_of(lambda: sync_all(model, fmt), device), largest


def peak_of(fn: Callable[[], object], device: str) -> int:
    """Peak device bytes allocated during ``fn()`` above what was allocated before it."""
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() - base


def kernel_seconds(fn: Callable[[], object], device: str, trace: Optional[str] = None) -> Optional[float]:
    """Summed device-kernel time of one ``fn()`` (torch profiler), None where there is no device; with ``trace``, the
    profile is also written there as a Chrome trace (on the CPU too: its host ops alone)."""
    if not device.startswith("cuda") and trace is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    if trace is not None:
        prof.export_chrome_trace(trace)
    if not cuda:
        return None
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
    return total / 1e6


def timeline(trace: str) -> Optional[str]:
    """Where the device waits in a Chrome trace of one call: from the first host op to the last kernel's end, the kernels'
    busy time, the wait before the first kernel, the gaps between kernels (their sum and the largest, with the kernel
    after it). None where the trace holds no kernel (a CPU run)."""
    with open(trace) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")) for e in events if e.get("cat") == "kernel")
    host = [float(e["ts"]) for e in events if e.get("cat") == "cpu_op"]
    if not kernels or not host:
        return None
    t0 = min(host)
    busy, end, gaps = 0.0, kernels[0][0], []
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    widest = max(gaps, default=(0.0, ""))
    return (f"{(end - t0) / 1e3:.3f} ms from the first host op to the last kernel's end: kernels busy {busy / 1e3:.3f} ms, "
            f"{(kernels[0][0] - t0) / 1e3:.3f} ms before the first kernel, {len(gaps)} gaps between kernels of "
            f"{sum(g for g, _ in gaps) / 1e3:.3f} ms (widest {widest[0]:.1f} us, before {widest[1][:60]})")


def modelopt_quantized(base: torch.nn.Module, cfg_name: str, ids: torch.Tensor) -> Optional[torch.nn.Module]:
    """``base`` quantized by ModelOpt with its preset ``cfg_name``; None (said why) where it cannot run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import modelopt.torch.quantization as mtq
    except Exception as exc:  # noqa: BLE001 - not installed, or an import that fails on this torch
        print(f"ModelOpt skipped: {type(exc).__name__}: {exc}")
        return None
    model = copy.deepcopy(base)
    try:
        mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg_name)), lambda m: m(ids))
    except Exception as exc:  # noqa: BLE001 - some blockwise / MX paths need CUDA in ModelOpt 0.47
        print(f"ModelOpt {cfg_name} does not run here: {type(exc).__name__}: {exc}")
        return None
    return model


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=("llama", "moe"), default="llama", help="dense Llama or Qwen3-MoE (3-D stacked experts)")
    ap.add_argument("--small", action="store_true", help="a tiny model (hidden 256, 2 layers): a smoke run")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--experts", type=int, help="experts per layer (--model moe)")
    ap.add_argument("--moe-intermediate", type=int, help="each expert's intermediate size (--model moe)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--formats", default="fp8_block,mxfp8,fp8", help=f"comma-separated, of {sorted(RECIPES)}")
    ap.add_argument("--disk", action="store_true", help="also time export_checkpoint and ModelOpt's export_hf_checkpoint")
    ap.add_argument("--no-modelopt", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the summed device-kernel time of one iteration and of one sync")
    ap.add_argument("--trace", metavar="DIR", help="with --profile: write each format's profiled sync as DIR/sync_<format>.json (a Chrome "
                    "trace) and print where the device waits in it")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    # hidden, intermediate, layers, heads, kv heads, experts, expert intermediate: 5.1 GB Llama; Qwen3-30B-A3B's layers (5.0 GB)
    sizes = {"llama": (8192, 28672, 3, 64, 8, 0, 0), "moe": (2048, 6144, 4, 32, 4, 128, 768)}[args.model]
    if args.small:
        sizes = (256, 512, 2, 2, 2, 8 if args.model == "moe" else 0, 128)
        args.vocab = 512
    names = ("hidden", "intermediate", "layers", "heads", "kv_heads", "experts", "moe_intermediate")
    if args.model == "llama" and (args.experts or args.moe_intermediate):
        ap.error("--experts / --moe-intermediate need --model moe")
    if args.trace and not args.profile:
        ap.error("--trace needs --profile")
    for name, default in zip(names, sizes):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    return args


class _Shown(list):
    """A list that hands each item to ``show`` as it is appended (a run cut short keeps what it printed)."""

    def __init__(self, show: Callable[[object], None]) -> None:
        super().__init__()
        self.show = show

    def append(self, item: object) -> None:
        super().append(item)
        self.show(item)


def bench_recipe(key: str, base: torch.nn.Module, ids: torch.Tensor, nbytes: int, args: argparse.Namespace,
                 show_row: Callable[[tuple], None] = lambda row: None, show_note: Callable[[str], None] = lambda note: None,
                 ) -> tuple[list[tuple], list[str]]:
    """The rows (label, seconds, quantlib's seconds where this is ModelOpt's) and notes of one recipe, each handed to
    ``show_row`` / ``show_note`` as soon as it is measured."""
    label, ql_cfg, fmt, mo_cfg = RECIPES[key.strip()]
    dev, rows, notes = args.device, _Shown(show_row), _Shown(show_note)
    ours = copy.deepcopy(base)
    ql.quantize(ours, getattr(ql, ql_cfg), lambda m: m(ids))
    ql.disable_quantizer(ours, "*lm_head*")
    if key.strip() in AWQ:
        share_pre_quant_scale(ours, lambda m: m(ids))  # q/k/v, gate/up and GQA heads on one scale: everything folds
    share_sibling_amax(ours)
    rows.append((f"{label}: quantlib checks only (make_plan)", timed(lambda m: plan_only(m, fmt), args.runs, lambda: ours, dev), None))
    ours_s = timed(lambda m: drop_all(m, fmt), args.runs, lambda: ours, dev)
    rows.append((f"{label}: quantlib iter_packed (memory)", ours_s, None))
    if key.strip() in AWQ:
        plain = without_pre_quant_scale(ours)
        plain_s = timed(lambda m: drop_all(m, fmt), args.runs, lambda: plain, dev)
        rows.append((f"{label}: the same model without pre_quant_scale, quantlib iter_packed (memory)", plain_s, None))
        notes.append(f"{label}: the folded export takes {ours_s / plain_s:.2f}x the time of the same model's without pre_quant_scale")
        (r0, w0), (r1, w1) = (weight_traffic(lambda m=m: drop_all(m, fmt), min(w.numel() for w in linear_weights(m)) // 4)
                              for m in (ours, plain))
        plain = None
        notes.append(f"{label}: the fold's extra traffic on weight-sized tensors: {(r0 - r1) / nbytes:.2f}x the bf16 weight bytes read, "
                     f"{(w0 - w1) / nbytes:.2f}x written (target: at most one extra pass over the weights, 1.00x each)")
    sync_s = timed(lambda m: sync_all(m, fmt), args.runs, lambda: ours, dev)
    rows.append((f"{label}: quantlib sync_pairs, scales from the weights (memory)", sync_s, None))
    if dev.startswith("cuda"):
        peak, largest = peak_extra(ours, fmt, dev)
        notes.append(f"{label}: peak device memory above the model while iterating {peak / 1e6:.1f} MB; largest module's packed tensors "
                     f"{largest / 1e6:.1f} MB")
        peak, largest = sync_peak_extra(ours, fmt, dev)
        notes.append(f"{label}: peak device memory above the model during sync_pairs {peak / 1e6:.1f} MB; largest tensor it yields "
                     f"{largest / 1e6:.1f} MB ({peak / largest:.2f}x)")
    if args.profile:
        k = kernel_seconds(lambda: drop_all(ours, fmt), dev)
        if k is not None:
            notes.append(f"{label}: device kernels of one iteration {k * 1e3:.3f} ms ({nbytes / k / 1e9:.0f} GB/s of bf16 weights) against "
                         f"{ours_s * 1e3:.3f} ms end to end")
        trace = os.path.join(args.trace, f"sync_{key.strip()}.json") if args.trace else None
        k = kernel_seconds(lambda: sync_all(ours, fmt), dev, trace)  # below the end-to-end time: the host's work bounds the sync
        if k is not None:
            notes.append(f"{label}: device kernels of one sync_pairs {k * 1e3:.3f} ms ({nbytes / k / 1e9:.0f} GB/s of bf16 weights) "
                         f"against {sync_s * 1e3:.3f} ms end to end")
        where = trace and timeline(trace)
        if where:
            notes.append(f"{label}: one sync_pairs under the profiler: {where}")
    if args.disk:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((f"{label}: quantlib export_checkpoint (disk)",
                         timed(lambda m: export_checkpoint(m, f"{tmp}/q", fmt, overwrite=True), args.runs, lambda: ours, dev), None))
    ours = None  # free its device memory before ModelOpt's copies
    theirs = None if args.no_modelopt or mo_cfg is None else modelopt_quantized(base, mo_cfg, ids)
    if theirs is None:
        return rows, notes
    from modelopt.torch.export.unified_export_hf import _export_transformers_checkpoint

    try:
        mo_s = timed(_export_transformers_checkpoint, args.runs, lambda: copy.deepcopy(theirs), dev)
    except Exception as exc:  # noqa: BLE001 - a format ModelOpt cannot export here is reported, not fatal
        print(f"ModelOpt _export_transformers_checkpoint ({mo_cfg}) fails here: {type(exc).__name__}: {exc}")
        return rows, notes
    rows.append((f"{label}: ModelOpt _export_transformers_checkpoint (memory)", mo_s, ours_s))
    notes.append(f"{label}: ModelOpt's in-memory export takes {mo_s / sync_s:.1f}x the time of quantlib's weight sync with dynamic scales")
    if args.disk:
        from modelopt.torch.export import export_hf_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            rows.append((f"{label}: ModelOpt export_hf_checkpoint (disk)", timed(lambda m: export_hf_checkpoint(m, export_dir=f"{tmp}/m"),
                                                                                 args.runs, lambda: copy.deepcopy(theirs), dev), None))
    return rows, notes


def main(argv: Optional[list[str]] = None) -> list[tuple]:
    """Run the benchmark; returns the rows (label, seconds, GB/s, ratio to copy, speed-up over ModelOpt)."""
    args = parse(argv)
    dev = args.device
    base = build(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab, dev, args.experts,
                 args.moe_intermediate)
    # MoE: enough tokens that every expert sees some (its input quantizers calibrate)
    shape = (4, 256) if args.experts else (2, 64)
    ids = torch.randint(0, args.vocab, shape, generator=torch.Generator().manual_seed(1)).to(dev)
    weights = linear_weights(base)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    copy_s = timed(copy_all, args.runs, lambda: weights, dev)
    gpu = f" ({torch.cuda.get_device_name()})" if dev.startswith("cuda") else ""
    what = (f"Qwen3-MoE hidden {args.hidden}, {args.experts} experts of {args.moe_intermediate}" if args.experts else
            f"Llama hidden {args.hidden}, intermediate {args.intermediate}")
    lines = [
        (f"{datetime.date.today()} {platform.node()} {dev}{gpu} torch {torch.__version__} threads {torch.get_num_threads()}; {what}, "
         f"{args.layers} layers, {nbytes / 1e6:.0f} MB of bf16 linear weights packed; median of "
         f"{args.runs} after three warm-ups (garbage collector paused), one device sync a run"),
        "",
        "| what | ms | GB/s of bf16 weights | of the copy | quantlib's speed-up |",
        "|---|---|---|---|---|",
    ]
    out: list[tuple] = []
    notes: list[str] = []

    def add(row: tuple) -> None:
        # printed as soon as it is measured: a run cut short (a time limit on a lent GPU) keeps its rows
        name, t, ours_t = row
        speedup = f"{t / ours_t:.1f}x" if ours_t else ""
        lines.append(f"| {name} | {t * 1e3:.3f} | {nbytes / t / 1e9:.1f} | {copy_s / t:.0%} | {speedup} |")
        out.append((name, t, nbytes / t / 1e9, copy_s / t, t / ours_t if ours_t else None))
        print(lines[-1], flush=True)

    print("\n".join(lines), flush=True)
    add(("bf16 copy of every packed weight (clone)", copy_s, None))
    for key in args.formats.split(","):
        notes += bench_recipe(key, base, ids, nbytes, args, add, lambda note: print(f"- {note}", flush=True))[1]
    text = "\n".join(lines + [""] + notes)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return out


if __name__ == "__main__":
    main()
