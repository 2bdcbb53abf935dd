"""Export throughput: quantlib's in-memory iterator and checkpoint writer against ModelOpt's HF export.

    python benchmarks/bench_export.py [--hidden 1024] [--layers 4] [--runs 3] [--device cpu] [--out FILE]

A transformers Llama in bf16 (no downloads) is quantized by quantlib and, separately, by ModelOpt with the
same recipe (FP8 per tensor W8A8, and FP8 128x128 weight blocks), calibrated on the same batch. Timed
(median of ``--runs``, each on a fresh copy because ModelOpt's export edits the model): quantlib's
``iter_packed`` consuming every tensor in memory and ``export_checkpoint`` to a temporary directory;
ModelOpt's in-memory ``_export_transformers_checkpoint`` and ``export_hf_checkpoint``; a bf16 copy of every
weight as the bandwidth baseline. GB/s = bytes of the model's bf16 weights / time. Prints a markdown table
(and writes it, with machine and versions, to ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import tempfile
import time
import warnings
from typing import Callable, Optional

import torch

import quantlib as ql
from quantlib.export import export_checkpoint, iter_packed, layout_for, share_sibling_amax
from quantlib.export.formats import packer
from quantlib.export.plan import make_plan


def build(hidden: int, layers: int, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 128 * 128, num_hidden_layers=layers, num_attention_heads=hidden // 128,
                      num_key_value_heads=hidden // 128, max_position_embeddings=256, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])  # fmt: skip
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def timed(fn: Callable[[], object], runs: int, fresh: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        arg = fresh()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(arg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def consume(model: torch.nn.Module, fmt: str) -> None:
    for pw in iter_packed(model, fmt):
        for t in pw.tensors.values():
            t.data_ptr()  # every tensor materialized (they are, by construction)


def modelopt_quantized(base: torch.nn.Module, cfg_name: str, ids: torch.Tensor) -> Optional[torch.nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq

    model = copy.deepcopy(base)
    cfg = copy.deepcopy(getattr(mtq, cfg_name))
    try:
        mtq.quantize(model, cfg, lambda m: m(ids))
    except Exception as exc:  # NVFP4 / MX / some blockwise paths need CUDA in ModelOpt 0.47
        print(f"ModelOpt {cfg_name} does not run here: {type(exc).__name__}: {exc}")
        return None
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    base = build(args.hidden, args.layers, args.device)
    ids = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(1)).to(args.device)
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    rows = [("bf16 copy of every weight", timed(lambda m: [p.clone() for p in m.parameters()], args.runs, lambda: base), None)]
    recipes = [("FP8 per tensor W8A8", ql.FP8_DEFAULT_CFG, "modelopt_fp8", "FP8_DEFAULT_CFG"), ("FP8 128x128 weights", ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, "modelopt_fp8_pb", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG")]
    for label, cfg, fmt, mo_cfg in recipes:
        ours = copy.deepcopy(base)
        ql.quantize(ours, cfg, lambda m: m(ids))
        ql.disable_quantizer(ours, "*lm_head*")
        share_sibling_amax(ours)
        rows.append((f"{label}: quantlib checks only (make_plan)", timed(lambda m: make_plan(m, packer(fmt), layout_for(m)), args.runs, lambda: ours), None))
        rows.append((f"{label}: quantlib iter_packed (memory)", timed(lambda m: consume(m, fmt), args.runs, lambda: ours), None))
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((f"{label}: quantlib export_checkpoint (disk)", timed(lambda m: export_checkpoint(m, f"{tmp}/q", fmt, overwrite=True), args.runs, lambda: ours), None))
        theirs = modelopt_quantized(base, mo_cfg, ids)
        if theirs is None:
            continue
        from modelopt.torch.export import export_hf_checkpoint
        from modelopt.torch.export.unified_export_hf import _export_transformers_checkpoint

        rows.append((f"{label}: ModelOpt _export_transformers_checkpoint (memory)", timed(_export_transformers_checkpoint, args.runs, lambda: copy.deepcopy(theirs)), None))
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((f"{label}: ModelOpt export_hf_checkpoint (disk)", timed(lambda m: export_hf_checkpoint(m, export_dir=f"{tmp}/m"), args.runs, lambda: copy.deepcopy(theirs)), None))
    lines = [f"{datetime.date.today()} {platform.node()} {args.device} torch {torch.__version__} threads {torch.get_num_threads()}; Llama hidden {args.hidden}, {args.layers} layers, {nbytes / 1e6:.0f} MB bf16 weights; median of {args.runs}", "",
             "| what | seconds | GB/s of bf16 weights |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {name} | {t:.3f} | {nbytes / t / 1e9:.2f} |" for name, t, _ in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
