"""Peak memory of layer-by-layer calibration of a model 4x a memory budget: CPU (peak RSS) or CUDA
(peak device memory).

A transformers Llama whose decoder layers weigh ``--factor`` x ``--budget-mib`` (fp32) is written to an
offload folder one layer at a time (it never exists whole in memory), then two fresh processes:

- ``sequential``: the model skeleton on ``meta`` with its embeddings / norm / head loaded (onto the GPU
  with ``--device cuda``), then ``quantize(..., sequential=SequentialOptions(offload_folder=...))``; with
  ``--device cuda`` also ``device="cuda"``: each layer is loaded from the folder onto the GPU, calibrated,
  and sent back to ``meta``;
- ``in-memory``: the whole model loaded (onto the GPU with ``--device cuda``), then the usual ``quantize``;
- each reports its peak memory above what it held before loading any layer and its amax; the amax of
  the two must be bit-identical. CPU: peak RSS (VmHWM reset through ``/proc/self/clear_refs``). CUDA:
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (and the reserved memory, and
  the RSS, for information).

    python benchmarks/bench_sequential.py                       # 64 MiB budget, a 256 MiB model
    python benchmarks/bench_sequential.py --budget-mib 128 --factor 4 --allocator fixed --json out.json
    python benchmarks/bench_sequential.py --device cuda         # 512 MiB budget, a 2 GiB model
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

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=num_layers,
                       num_attention_heads=HEADS,
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


class _Meter:
    """Peak memory above what the process holds at :meth:`start`: RSS on the CPU, and device memory
    (allocated, as the budget counts; reserved by the caching allocator, for information) on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.allocated0, self.reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        self.rss0 = _status("VmRSS")
        _reset_peak()

    def peaks(self) -> dict:
        rss = _status("VmHWM") - self.rss0
        if not self.cuda:
            return {"peak_extra": rss}
        torch.cuda.synchronize()
        return {"peak_extra": torch.cuda.max_memory_allocated() - self.allocated0,
                "peak_reserved_extra": torch.cuda.max_memory_reserved() - self.reserved0, "peak_rss_extra": rss}  # fmt: skip


def _warm(device: str) -> None:
    """Run, before the baseline, the library's first call and, on CUDA, a GEMM and an attention: cuBLAS's
    workspace is allocated at its first use and held for the life of the process."""
    import quantlib as ql

    ql.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)).to(device), ql.FP8_DEFAULT_CFG, lambda m: m(torch.randn(2, 4, device=device)))
    if device == "cpu":
        return  # as the CPU results were measured
    x = torch.randn(2, 128, HIDDEN, device=device)
    torch.nn.functional.linear(x, torch.randn(INTER, HIDDEN, device=device))
    q = x.view(2, 128, HEADS, HIDDEN // HEADS).transpose(1, 2)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def run(mode: str, folder: str, num_layers: int, out: str, device: str) -> None:
    """One calibration in this (fresh) process on ``device``; writes the peak memory above the start, the
    seconds and the amax (on the CPU) to ``out``."""
    import quantlib as ql
    from quantlib.calib.sequential import SequentialOptions, layer_file
    from quantlib.model_quant import iter_leaf_quantizers

    model = skeleton(num_layers)
    # the rotary buffers are computed, not saved: build them on the CPU
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
    model.load_state_dict(torch.load(os.path.join(folder, "resident.pt"), weights_only=True), strict=False, assign=True)
    for name, child in list(model.model.named_children()) + [("lm_head", model.lm_head)]:
        if name != "layers":  # the resident part goes where the layers run; the layers stay on meta
            child.to(device)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (2, 128), generator=g).to(device) for _ in range(4)]

    def loop(m):
        for x in data:
            m(x, use_cache=False)

    cfg = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    _warm(device)
    meter = _Meter(device)
    meter.start()
    t0 = time.perf_counter()
    if mode == "in-memory":
        for i, layer in enumerate(model.model.layers):
            layer.load_state_dict(torch.load(layer_file(folder, f"model.layers.{i}"), map_location=device, weights_only=True), assign=True)
        ql.quantize(model, cfg, loop)
    else:
        # on the CPU the layers run where they are loaded (device=None), as the CPU results were measured
        opts = SequentialOptions(offload_folder=folder, device=None if device == "cpu" else device)
        ql.quantize(model, cfg, loop, sequential=opts)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    amax = {n: q.amax.cpu() for n, q in iter_leaf_quantizers(model) if q.amax is not None}
    torch.save({**meter.peaks(), "seconds": seconds, "amax": amax}, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the layers run and whose peak memory is measured")
    p.add_argument("--budget-mib", type=float, help="default: 64 on the CPU, 512 on CUDA")
    p.add_argument("--factor", type=float, default=4.0, help="the model's layers weigh factor x budget")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--allocator", choices=("default", "fixed"), default="default",
                   help="fixed: glibc serves every block over 64 KiB by mmap (freed memory goes back at once; without it the heap "
                        "keeps some of each pass's activations and the sequential peak grows slowly with the layer count)")
    p.add_argument("--_child", nargs=5, metavar=("MODE", "FOLDER", "LAYERS", "OUT", "DEVICE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        mode, folder, layers, out, device = args._child
        run(mode, folder, int(layers), out, device)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        skipped = f"bench_sequential: skipped --device cuda: no CUDA GPU here (torch {torch.__version__}, cuda.is_available() False)"
        print(skipped)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": "cuda", "skipped": skipped}, f, indent=2)
        return
    budget = args.budget_mib if args.budget_mib is not None else (64.0 if args.device == "cpu" else 512.0)
    num_layers = max(2, round(args.factor * budget * MIB / layer_bytes()))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.allocator == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = {"device": args.device, "allocator": args.allocator, "budget_mib": budget, "layers": num_layers,
               "model_layers_mib": num_layers * layer_bytes() / MIB, "torch": torch.__version__}  # fmt: skip
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        write(folder, num_layers)
        for mode in ("sequential", "in-memory"):
            out = os.path.join(folder, f"{mode}.pt")
            child = [sys.executable, os.path.abspath(__file__), "--_child", mode, folder, str(num_layers), out, args.device]
            subprocess.run(child, check=True, env=env)
            r = torch.load(out, weights_only=True)
            results[mode] = {k[: -len("_extra")] + "_extra_mib": v / MIB for k, v in r.items() if k.endswith("_extra")}
            results[mode]["seconds"] = r["seconds"]
            results[mode + "_amax"] = r["amax"]
    a, b = results.pop("sequential_amax"), results.pop("in-memory_amax")
    results["amax_identical"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    results["quantizers"] = len(a)
    results["sequential_under_budget"] = results["sequential"]["peak_extra_mib"] <= budget
    results["total_seconds"] = time.perf_counter() - t0
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
