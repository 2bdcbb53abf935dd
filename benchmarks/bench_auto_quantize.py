"""auto_quantize at an effective-bits budget against uniform formats and budget-matched mixes chosen without
sensitivity, on the trained small LMs of bench_quality.py (dense and MoE), with ModelOpt's auto_quantize on the
same model, candidates, data and budget where its fake quant runs (its NVFP4 needs CUDA).

Rows per model: uniform NVFP4 (4.5 bits) and FP8 (8 bits), NVFP4_DEFAULT_CFG / FP8_DEFAULT_CFG as ModelOpt ships
them; "first FP8" / "last FP8": FP8 for the first (last) decisions in module order until the budget is spent,
NVFP4 for the rest (a mix at the same bits, without any measurement); quantlib's and ModelOpt's auto_quantize
with both candidates (and "no quantization") at the budget. Perplexity over ``--windows`` evenly spaced held-out windows,
the effective bits each reached, and the search's wall time.

    python benchmarks/bench_auto_quantize.py [--bits 6.0] [--model dense|moe|both] [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_quality as bq  # noqa: E402
import quality_models as qm  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.auto_quantize import NONE  # noqa: E402

CANDIDATES = ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]


def batches(text: torch.Tensor, n: int, device: str) -> list[torch.Tensor]:
    """``n`` batches of 4 training windows (input and shifted target)."""
    return [qm.windows(text, 4, seed=777 + i).to(device) for i in range(n)]


def step(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b[:, :-1])


def loss(out: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), b[:, 1:].reshape(-1))


def mix(state: dict, reverse: bool) -> dict:
    """NVFP4 everywhere but FP8 on the first (or last) decisions in module order, as many as the budget of
    ``state`` allows: the same bits as auto_quantize's choice, chosen without measuring anything."""
    cfg = copy.deepcopy(ql.NVFP4_DEFAULT_CFG)
    fp8 = ql.FP8_DEFAULT_CFG["quant_cfg"]
    decisions = state["decisions"][::-1] if reverse else state["decisions"]
    total = sum(d["numel"] for d in decisions)
    budget = state["best"]["constraints"]["effective_bits"] * total
    spent = sum(d["bits"]["NVFP4_DEFAULT_CFG"] * d["numel"] for d in decisions)
    for d in decisions:
        extra = (d["bits"]["FP8_DEFAULT_CFG"] - d["bits"]["NVFP4_DEFAULT_CFG"]) * d["numel"]
        if spent + extra > budget:
            continue
        spent += extra
        for name in d["modules"]:
            cfg["quant_cfg"][f"{name}.weight_quantizer"] = copy.deepcopy(fp8["*weight_quantizer"])
            cfg["quant_cfg"][f"{name}.input_quantizer"] = copy.deepcopy(fp8["*input_quantizer"])
    return cfg, spent / total


def run(name: str, bits: float, device: str, calib: int, score: int, windows: int) -> list[dict]:
    model = bq.BUILDERS[name]().to(device)
    train, held = qm.corpus()
    data = batches(train, max(calib, score), device)
    ref_ppl, _, ref, _ = bq.evaluate(model, held, windows=windows)
    rows = [{"model": name, "row": "fp32", "bits": 16.0, "ppl": ref_ppl}]

    def ev(row: str, m: torch.nn.Module, b: float, secs: float | None = None) -> None:
        ppl, kl, _, _ = bq.evaluate(m, held, ref, windows=windows)
        rows.append({"model": name, "row": row, "bits": round(b, 3), "ppl": ppl, "kl": kl, "search_s": secs})
        print(json.dumps(rows[-1]), file=sys.stderr)

    def loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for b in data[:calib]:
                step(m, b)

    excluded = ["*lm_head*", "*router*", "*gate"]  # as the presets leave them (the MoE router is `gate`)
    t = time.perf_counter()
    ours, state = ql.auto_quantize(copy.deepcopy(model), {"effective_bits": bits}, CANDIDATES, data, step, loss,
                                   disabled_layers=excluded, num_calib_steps=calib, num_score_steps=score)
    secs = time.perf_counter() - t
    for cand, b in (("NVFP4_DEFAULT_CFG", 4.5), ("FP8_DEFAULT_CFG", 8.0)):
        cfg = copy.deepcopy(getattr(ql, cand))
        cfg["quant_cfg"].update({p: {"enable": False} for p in excluded})
        ev(f"uniform {cand}", ql.quantize(copy.deepcopy(model), cfg, loop), b)
    for reverse in (False, True):
        cfg, b = mix(state, reverse)
        cfg["quant_cfg"].update({p: {"enable": False} for p in excluded})
        ev("last FP8" if reverse else "first FP8", ql.quantize(copy.deepcopy(model), cfg, loop), b)
    ev("quantlib auto_quantize", ours, state["best"]["effective_bits"], secs)
    rows[-1]["choice"] = {k: v for k, v in state["best"]["recipe"].items() if v != NONE}
    try:
        import modelopt.torch.quantization as mtq

        if device != "cuda":
            raise RuntimeError("ModelOpt's NVFP4 fake quant needs CUDA")
        t = time.perf_counter()
        theirs, mstate = mtq.auto_quantize(copy.deepcopy(model), constraints={"effective_bits": bits}, quantization_formats=CANDIDATES,
                                           data_loader=data, forward_step=step, loss_func=loss, disabled_layers=excluded,
                                           num_calib_steps=calib, num_score_steps=score)
        ev("modelopt auto_quantize", theirs, float(mstate["best"]["constraints"]["effective_bits"]), time.perf_counter() - t)
    except Exception as exc:  # noqa: BLE001 - not installed, or its NVFP4 off CUDA
        rows.append({"model": name, "row": "modelopt auto_quantize", "skipped": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=float, default=6.0)
    ap.add_argument("--model", choices=["dense", "moe", "both"], default="both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--score", type=int, default=8)
    ap.add_argument("--windows", type=int, default=256, help="held-out windows evaluated (evenly spaced); 0: every disjoint one")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name in ["dense", "moe"] if args.model == "both" else [args.model]:
        rows += run(name, args.bits, args.device, args.calib, args.score, args.windows)
    print(f"# {datetime.date.today()} {platform.node()} torch {torch.__version__} device {args.device} budget {args.bits} bits")
    print("| model | row | bits | ppl | KL/byte | search s |\n|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['model']} | {r['row']} | skipped: {r['skipped']} | | | |")
        else:
            secs = "" if r.get("search_s") is None else f"{r['search_s']:.2f}"
            print(f"| {r['model']} | {r['row']} | {r['bits']} | {r['ppl']:.4f} | {r.get('kl', 0):.5f} | {secs} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
