"""Cost of quantlib's quantized Megatron-Core ``SequentialMLP`` (all experts as grouped GEMMs, no host read)
against the same layer unquantized (Megatron's loop over experts) and against Megatron's loop over the same
quantized experts (what quantlib ran before), in one process of one rank.

The layer: ``SequentialMLP`` of E local experts (Megatron's local ``ColumnParallelLinear`` /
``RowParallelLinear``, swiglu), hidden H, expert width I, fed as Megatron's allgather dispatcher feeds it:
the rows of ``tokens`` tokens routed top-k, sorted by expert, their counts on the host, their routing
probabilities. Each preset is applied by ``quantlib.quantize`` (max calibration on the batch, not timed).
Timed, median of ``--reps``: forward without grad (the weight cache) and forward + backward (QAT).

    python benchmarks/bench_moe_megatron.py --device cuda --json moe_megatron.json   # E=64 and 128, top-8, bf16
    python benchmarks/bench_moe_megatron.py --small                                   # CPU-sized, fp32
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import quantlib as ql  # noqa: E402
from benchmarks.bench_moe import PRESETS, SHAPES, SMALL_SHAPES, layer_args, timed  # noqa: E402


def setup(device: str) -> None:
    """One rank, TP = EP = 1. On the CPU: the calls Megatron-Core 0.16 makes to CUDA answered for the CPU."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if device == "cpu":
        torch.cuda.current_device = lambda: torch.device("cpu")  # (benchmark only, as the tests' shims)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=device == "cpu")


def build_layer(experts: int, hidden: int, width: int, top_k: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A SequentialMLP of swiglu experts with random weights (std 0.02)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=width, moe_ffn_hidden_size=width, num_attention_heads=8,
                            num_moe_experts=experts, moe_router_topk=top_k, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            use_cpu_initialization=device == "cpu")  # fmt: skip
    torch.manual_seed(0)
    layer = SequentialMLP(experts, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                          pg_collection=get_default_pg_collection())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    return layer.to(device=device, dtype=dtype)


def routed_rows(experts: int, hidden: int, tokens: int, top_k: int, dtype: torch.dtype, device: str):
    """(rows sorted by expert, their counts on the host, their probabilities) of ``tokens`` tokens routed top-k at random."""
    g = torch.Generator().manual_seed(1)
    choice = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    counts = torch.bincount(choice.flatten(), minlength=experts)
    x = torch.randn(int(counts.sum()), hidden, generator=g).to(device, dtype)
    return x, counts, torch.rand(x.shape[0], generator=g).to(device)


def measure(layer: torch.nn.Module, inputs: tuple, device: str, reps: int) -> dict:
    x, counts, probs = inputs

    def fwd():
        with torch.no_grad():
            layer(x, counts, probs)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        layer(x, counts, probs)[0].float().square().mean().backward()

    layer.eval()
    out = {"fwd": timed(fwd, device, reps)}
    layer.train()
    out["fwd_bwd"] = timed(fwd_bwd, device, reps)
    return out


def main() -> None:
    p = layer_args(__doc__)
    args = p.parse_args()
    dtype = torch.float32 if args.small else torch.bfloat16
    tokens, reps = args.tokens or (128 if args.small else 4096), args.reps or (5 if args.small else 20)
    setup(args.device)
    from quantlib.plugins import megatron as qm

    rows, real = [], qm.grouped_refusal
    for shape in SMALL_SHAPES if args.small else SHAPES:
        inputs = routed_rows(shape[0], shape[1], tokens, args.top_k, dtype, args.device)
        base = measure(build_layer(*shape, args.top_k, dtype, args.device), inputs, args.device, reps)
        print(f"E={shape[0]} H={shape[1]} I={shape[2]} top-{args.top_k} tokens={tokens} {dtype} {args.device}: unquantized "
              f"(Megatron's loop) fwd {base['fwd'] * 1e3:.2f} ms, fwd+bwd {base['fwd_bwd'] * 1e3:.2f} ms")
        for preset in args.presets:
            name, _, weight_only = PRESETS[preset]
            layer = ql.quantize(build_layer(*shape, args.top_k, dtype, args.device), ql.PRESETS[name], lambda m, i=inputs: m(*i))
            grouped = measure(layer, inputs, args.device, reps)
            qm.grouped_refusal = lambda *a: "benchmark: Megatron's loop"
            try:
                looped = measure(layer, inputs, args.device, reps)
            finally:
                qm.grouped_refusal = real
            row = {"experts": shape[0], "hidden": shape[1], "width": shape[2], "top_k": args.top_k, "tokens": tokens, "dtype": str(dtype),
                   "device": args.device, "preset": preset, "weight_only": weight_only, "unquantized": base, "quantlib": grouped,
                   "quantized_loop": looped}  # fmt: skip
            rows.append(row)
            print(f"  {preset}: quantlib fwd {grouped['fwd'] * 1e3:.2f} ms ({grouped['fwd'] / base['fwd']:.2f}x), fwd+bwd "
                  f"{grouped['fwd_bwd'] * 1e3:.2f} ms ({grouped['fwd_bwd'] / base['fwd_bwd']:.2f}x); Megatron's loop of the quantized "
                  f"experts {looped['fwd'] * 1e3:.2f} / {looped['fwd_bwd'] * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    print("\n| E | H | I | preset | unquantized fwd / fwd+bwd ms | quantlib fwd / fwd+bwd ms | vs unquantized "
          "| quantized loop fwd / fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, q, lo = r["unquantized"], r["quantlib"], r["quantized_loop"]
        print(f"| {r['experts']} | {r['hidden']} | {r['width']} | {r['preset']}{' (W only)' if r['weight_only'] else ''} | "
              f"{b['fwd'] * 1e3:.2f} / {b['fwd_bwd'] * 1e3:.2f} | {q['fwd'] * 1e3:.2f} / {q['fwd_bwd'] * 1e3:.2f} | "
              f"{q['fwd'] / b['fwd']:.2f}x / {q['fwd_bwd'] / b['fwd_bwd']:.2f}x | {lo['fwd'] * 1e3:.2f} / {lo['fwd_bwd'] * 1e3:.2f} |")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
