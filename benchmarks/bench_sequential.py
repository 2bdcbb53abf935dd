"""Peak memory of layer-by-layer calibration of a model 4x a memory budget, on the CPU (peak RSS).

A transformers Llama whose decoder layers weigh ``--factor`` x ``--budget-mib`` (fp32) is written to an
offload folder one layer at a time (it never exists whole in memory), then three fresh processes:

- ``sequential``: the model skeleton on ``meta`` with its embeddings / norm / head loaded, then
  ``quantize(..., sequential=SequentialOptions(offload_folder=...))``;
- ``in-memory``: the whole model loaded, then the usual ``quantize``;
- each reports its peak RSS above the RSS it had before loading any layer (VmHWM reset through
  ``/proc/self/clear_refs``) and its amax; the amax of the two must be bit-identical.

    python benchmarks/bench_sequential.py                       # 64 MiB budget, a 256 MiB model
    python benchmarks/bench_sequential.py --budget-mib 128 --factor 4 --allocator fixed --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

MIB = 1 << 20
HIDDEN, INTER, HEADS, VOCAB = 512, 1536, 8, 512


def llama_config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=num_layers, num_attention_heads=HEADS,
                       num_key_value_heads=HEADS, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip


def layer_bytes() -> int:
    return 4 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN)


def skeleton(num_layers: int):
    """The model on ``meta``, eval mode."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(num_layers))
    return model.eval()


def _init(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def write(folder: str, num_layers: int) -> None:
    """Every layer materialized, initialized and offloaded in turn; the resident part saved whole."""
    from quantlib.calib.sequential import layer_file, offload_layer

    model = skeleton(num_layers)
    for i, layer in enumerate(model.model.layers):
        layer.to_empty(device="cpu")
        _init(layer, 100 + i)
        offload_layer(layer, layer_file(folder, f"model.layers.{i}"))
    for seed, module in enumerate((model.model.embed_tokens, model.model.norm, model.lm_head), start=1):
        module.to_empty(device="cpu")
        _init(module, seed)
    resident = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.") and "rotary" not in k}
    torch.save(resident, os.path.join(folder, "resident.pt"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def run(mode: str, folder: str, num_layers: int, out: str) -> None:
    """One calibration in this (fresh) process; writes peak RSS above the start and the amax to ``out``."""
    import quantlib as ql
    from quantlib.calib.sequential import SequentialOptions, layer_file
    from quantlib.model_quant import iter_leaf_quantizers

    model = skeleton(num_layers)
    # the rotary buffers are computed, not saved: build them on the CPU
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
    model.load_state_dict(torch.load(os.path.join(folder, "resident.pt"), weights_only=True), strict=False, assign=True)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (2, 128), generator=g) for _ in range(4)]

    def loop(m):
        for x in data:
            m(x, use_cache=False)

    cfg = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    ql.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), ql.FP8_DEFAULT_CFG, lambda m: m(torch.randn(2, 4)))  # warm the library
    rss0 = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if mode == "in-memory":
        for i, layer in enumerate(model.model.layers):
            layer.load_state_dict(torch.load(layer_file(folder, f"model.layers.{i}"), weights_only=True), assign=True)
        ql.quantize(model, cfg, loop)
    else:
        ql.quantize(model, cfg, loop, sequential=SequentialOptions(offload_folder=folder))
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - rss0
    amax = {n: q.amax for n, q in iter_leaf_quantizers(model) if q.amax is not None}
    torch.save({"peak_extra": peak, "seconds": seconds, "amax": amax}, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-mib", type=float, default=64.0)
    p.add_argument("--factor", type=float, default=4.0, help="the model's layers weigh factor x budget")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--allocator", choices=("default", "fixed"), default="default",
                   help="fixed: glibc serves every block over 64 KiB by mmap (freed memory goes back at once; without it the heap "
                        "keeps some of each pass's activations and the sequential peak grows slowly with the layer count)")
    p.add_argument("--_child", nargs=4, metavar=("MODE", "FOLDER", "LAYERS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        mode, folder, layers, out = args._child
        run(mode, folder, int(layers), out)
        return
    num_layers = max(2, round(args.factor * args.budget_mib * MIB / layer_bytes()))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.allocator == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = {"allocator": args.allocator, "budget_mib": args.budget_mib, "layers": num_layers, "model_layers_mib": num_layers * layer_bytes() / MIB, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as folder:
        write(folder, num_layers)
        for mode in ("sequential", "in-memory"):
            out = os.path.join(folder, f"{mode}.pt")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", mode, folder, str(num_layers), out], check=True, env=env)
            r = torch.load(out, weights_only=True)
            results[mode] = {"peak_extra_mib": r["peak_extra"] / MIB, "seconds": r["seconds"]}
            results[mode + "_amax"] = r["amax"]
    a, b = results.pop("sequential_amax"), results.pop("in-memory_amax")
    results["amax_identical"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    results["quantizers"] = len(a)
    results["sequential_under_budget"] = results["sequential"]["peak_extra_mib"] <= args.budget_mib
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
