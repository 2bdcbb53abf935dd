"""Perplexity of trained small LMs after quantization: every preset x calibration algorithm, quantlib
next to ModelOpt 0.47 on the same model, config dict and calibration data, in one run.

Models (benchmarks/quality_models.py, trained here on the CPU with a fixed seed on Python
standard-library sources; weights cached in ``benchmarks/data/quality_{dense,moe}.pt``, retrained only
when missing or with ``--retrain``): a dense byte-level decoder (d=256, 4 blocks, RMSNorm, SwiGLU,
~3.2 M parameters) and a tiny transformers Qwen3-MoE (2 blocks, top-2 of 4 fused experts).

Each row quantizes the model with one ModelOpt preset dict (``lm_head`` and router stay in full
precision; integers full range, ModelOpt's default) and one algorithm, given alike to both libraries.
``W4A16_NVFP4_CFG:static`` is that preset with static weight block scales, the form on which ``mse``
searches each block's amax and ``mse_fp8_sweep`` (``{"method": "mse", "fp8_scale_sweep": True}``,
the algorithm of ModelOpt's NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG) tries every E4M3 block scale; its
max row is its own baseline (fused siblings share one global amax there, so it is not the dynamic
preset's max). Perplexity is over ``--windows`` evenly spaced, disjoint held-out windows.
Calibration is repeated on ``--seeds`` disjoint draws of training windows; per row: held-out
perplexity (mean over the draws), its difference from the same draw's ``max`` row in percent (mean
and sample std: a claim "better than max" is only as good as this std), the mean KL divergence per
byte from the fp32 model's next-byte distribution, and the calibration time (best over the draws).
ModelOpt runs where its fake quant runs on the device (its NVFP4 needs CUDA).

    python benchmarks/bench_quality.py [--quick] [--model dense|moe|both] [--device cpu|cuda] [--count-ops] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import quality_models as qm  # noqa: E402

import quantlib as ql  # noqa: E402

ALL = ["max", "mse", "awq_lite", "awq_clip", "awq_full"]
#: INT4 blocks and static NVFP4 blocks also get GPTQ (ModelOpt's ``{"method": "gptq"}``: perc_damp 0.01,
#: block_size 128; its weight scales are fixed from the weights first, which dynamic NVFP4 blocks are not)
WITH_GPTQ = ALL + ["gptq"]
#: NVFP4 weights with static block scales (the W4A16 preset's weight blocks made ``"static"``): max, the
#: multiplier search of each block's amax, and ModelOpt's E4M3 scale sweep (its
#: NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG algorithm, here weight-only)
STATIC = ["max", "mse", "mse_fp8_sweep", "gptq"]
# (preset, algorithms) per model: max first, the baseline each algorithm must beat
ROWS = {
    "dense": [
        ("INT4_AWQ_CFG", WITH_GPTQ),
        ("W4A16_NVFP4_CFG", ALL),
        ("W4A16_NVFP4_CFG:static", STATIC),
        ("W4A8_AWQ_BETA_CFG", ["max", "awq_lite", "gptq"]),
        ("INT8_SMOOTHQUANT_CFG", ["max", "smoothquant"]),
    ],
    "moe": [("INT4_AWQ_CFG", WITH_GPTQ), ("W4A16_NVFP4_CFG", ALL), ("W4A16_NVFP4_CFG:static", STATIC)],
}
QUICK_ROWS = {"dense": [("INT4_AWQ_CFG", ["max", "awq_lite"])], "moe": [("INT4_AWQ_CFG", ["max", "awq_lite"])]}
#: algorithm dicts beyond ``{"method": name}``
ALGORITHMS = {"mse_fp8_sweep": {"method": "mse", "fp8_scale_sweep": True}}
#: presets whose fake quant ModelOpt runs on the CPU (its NVFP4 / MX need CUDA)
MODELOPT_CPU = {"INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG", "INT8_SMOOTHQUANT_CFG"}
BUILDERS: dict[str, Callable[..., nn.Module]] = {"dense": qm.dense_model, "moe": qm.moe_model}


def static_weight_blocks(cfg: dict) -> dict:
    """``cfg`` with its weight quantizers' dynamic block scales made static (ModelOpt's list form of
    ``quant_cfg`` or quantlib's dict form), in place."""
    qc = cfg["quant_cfg"]
    pairs = [(e.get("quantizer_name", ""), e.get("cfg")) for e in qc] if isinstance(qc, list) else list(qc.items())
    for name, attrs in pairs:
        for a in attrs if isinstance(attrs, list) else [attrs]:
            if name.endswith("weight_quantizer") and isinstance(a, dict) and (a.get("block_sizes") or {}).get("type") == "dynamic":
                a["block_sizes"]["type"] = "static"
    return cfg


def configs(preset: str, algorithm: str) -> tuple[dict, dict | None]:
    """(quantlib config, ModelOpt config or None) of ``preset`` (``NAME`` or ``NAME:static``, static
    weight block scales) and ``algorithm``: ModelOpt's preset dict when ModelOpt imports."""
    name, _, variant = preset.partition(":")
    algo = copy.deepcopy(ALGORITHMS.get(algorithm, {"method": algorithm}))
    try:
        import modelopt.torch.quantization as mtq
    except ImportError:
        cfg = copy.deepcopy(ql.PRESETS[name])
        cfg["algorithm"] = algo
        return (static_weight_blocks(cfg) if variant == "static" else cfg), None
    mo = copy.deepcopy(getattr(mtq, name))
    mo["algorithm"] = algo
    if variant == "static":
        static_weight_blocks(mo)
    ours = copy.deepcopy(mo)
    for entry in ours["quant_cfg"]:
        for attrs in entry.get("cfg") if isinstance(entry.get("cfg"), list) else [entry.get("cfg")]:
            if isinstance(attrs, dict) and isinstance(attrs.get("num_bits"), int):
                attrs.setdefault("narrow_range", False)  # ModelOpt's integers are full range
    return ours, mo


@torch.no_grad()
def evaluate(model: nn.Module, held: torch.Tensor, ref_logp: torch.Tensor | None = None,
             windows: int = 64) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(held-out perplexity, mean KL(reference || model) per byte in nats, log-probs, mean NLL per
    window); ``windows=0`` evaluates every disjoint window of the held-out text."""
    device = next(model.parameters()).device
    batch = qm.spaced_windows(held, windows or held.numel() // (qm.CTX + 1)).to(device)
    logp = torch.cat([F.log_softmax(model(b[:, :-1]).float(), dim=-1) for b in batch.split(16)])
    nll = -logp.gather(-1, batch[:, 1:, None]).squeeze(-1).double()
    kl = 0.0 if ref_logp is None else float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    return math.exp(nll.mean().item()), kl, logp, nll.mean(1)


def paired(nll: torch.Tensor, base: torch.Tensor) -> dict:
    """The held-out sample's noise on a difference from ``base`` (the same draw's max row), from the
    per-window mean NLL of both on the same windows: the standard error of the perplexity ratio in
    percent (delta method: d ppl / ppl = d mean NLL) and how many windows got a lower NLL."""
    d = nll - base
    return {"se_pct": 100 * float(d.std() / math.sqrt(d.numel())), "windows_better": int((d < 0).sum()), "windows": d.numel()}


def calibration(text: torch.Tensor, seed: int, batches: int, device: str) -> list[torch.Tensor]:
    """``batches`` batches of 4 training windows; draw ``seed`` (disjoint seeds give disjoint draws)."""
    return [qm.windows(text, 4, seed=10_000 * (seed + 1) + i)[:, :-1].to(device) for i in range(batches)]


def _calibrate(quantize: Callable, model: nn.Module, cfg: dict, data: list[torch.Tensor]) -> tuple[nn.Module, float]:
    def loop(m: nn.Module) -> None:
        for b in data:
            m(b)

    sync = torch.cuda.synchronize if data and data[0].is_cuda else (lambda: None)  # GPU work is timed to its end
    sync()
    t = time.perf_counter()
    q = quantize(copy.deepcopy(model), copy.deepcopy(cfg), loop)
    sync()
    return q, time.perf_counter() - t


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it (on a GPU, a small model's calibration is launch-bound:
    its time follows this count)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(quantize: Callable, model: nn.Module, cfg: dict, data: list[torch.Tensor]) -> int:
    """The aten ops one calibration of a copy of ``model`` dispatches (untimed)."""
    with _OpCounter() as counter:
        _calibrate(quantize, model, cfg, data)
    return counter.ops


def run_model(name: str, rows: list, seeds: int, batches: int, device: str, windows: int, retrain: bool, ops: bool = False) -> list[dict]:
    """One record per (preset, algorithm, library, seed) for model ``name``; ``ops``: also count the
    aten ops of draw 0's calibration."""
    model = BUILDERS[name](retrain=retrain).to(device)
    train_text, held = qm.corpus()
    ppl, _, ref, _ = evaluate(model, held, windows=windows)
    out = [{"model": name, "preset": "fp32", "algorithm": "-", "lib": "torch", "seed": 0, "ppl": ppl, "kl": 0.0}]
    ppl, kl, _, _ = evaluate(copy.deepcopy(model).bfloat16(), held, ref, windows)
    out.append({"model": name, "preset": "bf16", "algorithm": "-", "lib": "torch", "seed": 0, "ppl": ppl, "kl": kl})
    max_nll: dict[tuple, torch.Tensor] = {}
    for preset, algos in rows:
        for algo in algos:
            ours, mo = configs(preset, algo)
            libs = [("quantlib", ql.quantize, ours)]
            if mo is not None and (device == "cuda" or preset.partition(":")[0] in MODELOPT_CPU):
                import modelopt.torch.quantization as mtq

                libs.append(("modelopt", mtq.quantize, mo))
            for seed in range(seeds):
                data = calibration(train_text, seed, batches, device)
                for lib, quantize, cfg in libs:
                    q, secs = _calibrate(quantize, model, cfg, data)
                    ppl, kl, _, nll = evaluate(q, held, ref, windows)
                    rec = {"model": name, "preset": preset, "algorithm": algo, "lib": lib, "seed": seed, "ppl": ppl, "kl": kl,
                           "calib_s": secs}
                    if ops and seed == 0:
                        rec["ops"] = count_ops(quantize, model, cfg, data)
                    if algo == "max":
                        max_nll[preset, lib, seed] = nll
                    elif (preset, lib, seed) in max_nll:
                        rec.update(paired(nll, max_nll[preset, lib, seed]))
                    out.append(rec)
                    print(json.dumps(rec), file=sys.stderr)
    return out


def summarize(records: list[dict]) -> list[dict]:
    """One row per (model, preset, algorithm, library): mean ppl, ppl vs max in % (mean, std), mean KL, best time."""
    base = {(r["model"], r["preset"], r["lib"], r["seed"]): r["ppl"] for r in records if r["algorithm"] == "max"}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["preset"], r["algorithm"], r["lib"]), []).append(r)
    rows = []
    for (model, preset, algo, lib), rs in groups.items():
        row = {"model": model, "preset": preset, "algorithm": algo, "lib": lib, "seeds": len(rs)}
        row["ppl"] = statistics.fmean(r["ppl"] for r in rs)
        row["kl"] = statistics.fmean(r["kl"] for r in rs)
        if "calib_s" in rs[0]:
            row["calib_s"] = min(r["calib_s"] for r in rs)
        diffs = [100 * (r["ppl"] / base[(model, preset, lib, r["seed"])] - 1) for r in rs if (model, preset, lib, r["seed"]) in base]
        if diffs and algo != "max":
            row["vs_max_pct"] = statistics.fmean(diffs)
            row["vs_max_std"] = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        if "ops" in rs[0]:
            row["ops"] = rs[0]["ops"]
        if all("se_pct" in r for r in rs):
            row["se_pct"] = statistics.fmean(r["se_pct"] for r in rs)
            row["windows_better"] = f"{sum(r['windows_better'] for r in rs)}/{sum(r['windows'] for r in rs)}"
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: quantlib and ModelOpt side by side per (model, preset, algorithm)."""
    by = {(r["model"], r["preset"], r["algorithm"], r["lib"]): r for r in rows}
    keys = list(dict.fromkeys((r["model"], r["preset"], r["algorithm"]) for r in rows))
    out = [
        "| model | preset | algorithm | ppl quantlib | vs max % quantlib | held-out SE % | windows better | ppl ModelOpt | vs max % "
        "ModelOpt | KL quantlib (mnat) | KL ModelOpt (mnat) | calib s quantlib | calib s ModelOpt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, preset, algo in keys:
        ours = by.get((model, preset, algo, "quantlib")) or by.get((model, preset, algo, "torch"))
        mo = by.get((model, preset, algo, "modelopt"), {})

        def cell(r: dict, key: str) -> str:
            if key not in r:
                return "-"
            if key == "vs_max_pct":
                return f"{r[key]:+.2f} ± {r['vs_max_std']:.2f}"
            if key == "windows_better":
                return r[key]
            return f"{r[key] * 1e3:.3f}" if key == "kl" else f"{r[key]:.4f}" if key == "ppl" else f"{r[key]:.2f}"

        cells = [cell(ours, "ppl"), cell(ours, "vs_max_pct"), cell(ours, "se_pct"), cell(ours, "windows_better"), cell(mo, "ppl"),
                 cell(mo, "vs_max_pct"), cell(ours, "kl"), cell(mo, "kl"), cell(ours, "calib_s"), cell(mo, "calib_s")]
        out.append(f"| {model} | {preset} | {algo} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ops_table(rows: list[dict]) -> str:
    """Markdown: aten ops of one calibration per row, both libraries (empty without ``--count-ops``)."""
    by = {(r["model"], r["preset"], r["algorithm"], r["lib"]): r["ops"] for r in rows if "ops" in r}
    keys = list(dict.fromkeys(k[:3] for k in by))
    if not keys:
        return ""
    out = ["| model | preset | algorithm | aten ops quantlib | aten ops ModelOpt | ratio |", "|---|---|---|---|---|---|"]
    for k in keys:
        ours, mo = by.get((*k, "quantlib")), by.get((*k, "modelopt"))
        ratio = f"{ours / mo:.2f}" if ours and mo else "-"
        out.append(f"| {' | '.join(k)} | {ours if ours is not None else '-'} | {mo if mo is not None else '-'} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; print the table (and write the records and rows with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["dense", "moe", "both"], default="both")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", type=int, default=3, help="calibration draws (ppl vs max: mean and std over them)")
    parser.add_argument("--batches", type=int, default=8, help="calibration batches of 4 x 128 bytes per draw")
    parser.add_argument("--windows", type=int, default=256, help="held-out windows of 128 bytes evaluated (evenly spaced); 0: every "
                                                                 "disjoint one")
    parser.add_argument("--quick", action="store_true", help="INT4 max and awq_lite only, one draw of 4 batches, 16 windows")
    parser.add_argument("--retrain", action="store_true", help="train the models again and overwrite the cache")
    parser.add_argument("--presets", nargs="+", default=None, help="only these rows' presets (e.g. W4A16_NVFP4_CFG "
                                                                   "'W4A16_NVFP4_CFG:static')")
    parser.add_argument("--algorithms", nargs="+", default=None, help="only these algorithms of each row (max is kept: the baseline)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--count-ops", action="store_true", help="also count the aten ops of each row's first calibration (a proxy for "
                                                                 "launch-bound GPU time)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.getLogger("quantlib").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.seeds, args.windows, args.batches = 1, 16, 4
    models = ["dense", "moe"] if args.model == "both" else [args.model]
    records = []
    for name in models:
        rows = [r for r in (QUICK_ROWS if args.quick else ROWS)[name] if args.presets is None or r[0] in args.presets]
        if args.algorithms is not None:
            rows = [(preset, [a for a in algos if a == "max" or a in args.algorithms]) for preset, algos in rows]
        records += run_model(name, rows, args.seeds, args.batches, args.device, args.windows, args.retrain, ops=args.count_ops)
    rows = summarize(records)
    print(table(rows))
    if args.count_ops:
        print("\n" + ops_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records, "rows": rows, "args": vars(args)}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
