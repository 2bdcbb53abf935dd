"""Cost of a quantized model whose quantizers are all disabled, against transformers' own eager forward.

For a small Qwen3-MoE (fused experts, transformers' eager expert loop) and a dense Llama, both built
from configs (no downloads), it times one eval forward of (a) the unconverted model and (b) a copy
quantized with FP8_DEFAULT_CFG and then ``disable_quantizer(model, "*")``, alternating a and b so
that drift of the machine hits both alike, and reports the median of each and the ratio b / a. The
same is done for (a) against an unconverted deep copy of itself: that ratio's distance from 1 is the
noise floor of the machine. The outputs are checked equal before timing.

    python benchmarks/bench_overhead.py                    # CPU defaults
    python benchmarks/bench_overhead.py --repeats 400 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def build(family: str, hidden: int, layers: int, experts: int) -> torch.nn.Module:
    """A ``family`` ("qwen3_moe" or "llama") causal LM with random weights, eager experts and attention."""
    import transformers as T

    common = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=hidden // 8,
                  max_position_embeddings=512, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(**common, intermediate_size=4 * hidden, moe_intermediate_size=hidden, num_experts=experts,
                               num_experts_per_tok=2, experts_implementation="eager")
        return T.Qwen3MoeForCausalLM(cfg).eval()
    return T.LlamaForCausalLM(T.LlamaConfig(**common, intermediate_size=4 * hidden)).eval()


def time_alternating(a, b, x: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per forward of ``a`` and ``b``, alternated, after two warm-up calls each."""
    ta, tb = [], []
    with torch.no_grad():
        for _ in range(2):
            a(x), b(x)
        for _ in range(repeats):
            for model, out in ((a, ta), (b, tb)):
                t0 = time.perf_counter()
                model(x)
                out.append(time.perf_counter() - t0)
    return ta, tb


def run(family: str, args: argparse.Namespace) -> dict:
    import quantlib as ql

    eager = build(family, args.hidden, args.layers, args.experts)
    x = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    quantized = ql.quantize(copy.deepcopy(eager), ql.FP8_DEFAULT_CFG, lambda m: m(x))
    disabled = ql.disable_quantizer(quantized, "*")
    with torch.no_grad():
        if not torch.equal(quantized(x).logits, eager(x).logits):
            raise SystemExit(f"{family}: the disabled quantized model's output differs from the eager model's")
    ta, tb = time_alternating(eager, quantized, x, args.repeats)
    ma, mb = statistics.median(ta), statistics.median(tb)
    ca, cb = time_alternating(eager, copy.deepcopy(eager), x, args.repeats)
    control = statistics.median(cb) / statistics.median(ca)
    return {"family": family, "quantizers_disabled": disabled, "eager_ms": 1e3 * ma, "disabled_ms": 1e3 * mb, "ratio": mb / ma,
            "control_ratio": control}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    import transformers

    results = [run(f, args) for f in ("qwen3_moe", "llama")]
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "args": vars(args)}
    for r in results:
        print(f"{r['family']:10s} eager {r['eager_ms']:8.3f} ms   all {r['quantizers_disabled']} quantizers disabled "
              f"{r['disabled_ms']:8.3f} ms   ratio {r['ratio']:.3f}   (eager copy / eager: {r['control_ratio']:.3f})")
    print(json.dumps(meta))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
