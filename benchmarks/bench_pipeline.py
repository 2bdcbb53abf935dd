"""Wall time of each stage of ``quantlib quantize`` against ModelOpt's flow on the same model, recipe and data.

quantlib: :func:`quantlib.oneshot` (load, evaluate before, calibrate, evaluate after, export, check: the
export reloaded by its consumer, compared weight by weight, and evaluated). ModelOpt 0.47: the same
transformers load, the same perplexity function before and after, ``mtq.quantize`` with the same-named
recipe on the same calibration windows, and ``export_hf_checkpoint`` (its unified HF export); it has no
check stage. The import of each library is timed apart (ModelOpt's pulls in Megatron-Core's modules).

    python benchmarks/bench_pipeline.py                               # the embedded model, FP8_DEFAULT_CFG, CPU
    python benchmarks/bench_pipeline.py --device cuda                 # both flows on the GPU
    python benchmarks/bench_pipeline.py --model DIR --preset NVFP4_DEFAULT_CFG --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def _now(device: torch.device) -> float:
    """perf_counter after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def modelopt_flow(model_dir: str, preset: str, windows, batch_size: int, out_dir: str, device: torch.device) -> dict[str, float]:
    """Stage -> seconds of ModelOpt's flow on ``device`` (the pipeline's own load and perplexity, so only calibrate
    and export differ)."""
    from quantlib.pipeline.evaluate import perplexity
    from quantlib.pipeline.model import load_model
    from quantlib.pipeline.stages import Stages

    times: dict[str, float] = {}
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    times["import"] = time.perf_counter() - t
    stages = Stages(show=False)
    t = _now(device)
    model = load_model(model_dir, "auto", False).to(device)
    times["load"] = _now(device) - t
    held_out = windows.batches("held_out", batch_size)
    t = _now(device)
    before = perplexity(model, held_out, device, stages.begin("e"))
    times["evaluate before"] = _now(device) - t
    calib = windows.batches("calib", batch_size)

    def loop(m):
        for b in calib:
            m(input_ids=b.to(device), use_cache=False)

    t = _now(device)
    mtq.quantize(model, copy.deepcopy(getattr(mtq, preset)), loop)
    times["calibrate"] = _now(device) - t
    t = _now(device)
    after = perplexity(model, held_out, device, stages.begin("e"))
    times["evaluate after"] = _now(device) - t
    t = _now(device)
    export_hf_checkpoint(model, export_dir=out_dir)
    times["export"] = _now(device) - t
    stages.end()
    print(f"ModelOpt: perplexity before {before}, after {after}")
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: quantlib's embedded model)")
    ap.add_argument("--preset", default="FP8_DEFAULT_CFG", help="a preset both libraries name alike")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="where both flows run: cpu, cuda, cuda:1")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    import quantlib as ql
    from quantlib.pipeline.data import load_windows
    from quantlib.pipeline.model import EMBEDDED_DIR, EMBEDDED_TEXT, load_tokenizer

    ours = {"import": time.perf_counter() - t}
    model_dir = args.model or EMBEDDED_DIR
    sizes = dict(num_samples=args.num_samples, eval_samples=args.eval_samples, seq_len=args.seq_len, batch_size=args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        # ModelOpt first: its import is then timed cold, and the check of a ModelOpt-format export (which
        # dequantizes with ModelOpt's qtensors) does not pay for that import
        windows = load_windows(
            load_tokenizer(model_dir, False),
            None,
            EMBEDDED_TEXT if model_dir == EMBEDDED_DIR else None,
            "text",
            args.num_samples,
            args.eval_samples,
            args.seq_len,
        )
        device = torch.device(args.device)
        theirs = modelopt_flow(model_dir, args.preset, windows, args.batch_size, os.path.join(tmp, "mo"), device)
        report = ql.oneshot(args.model, preset=args.preset, device=args.device, out=os.path.join(tmp, "ql"), progress=False, **sizes)
        ours.update(report["stage_seconds"])
    rows = sorted(set(ours) | set(theirs), key=lambda k: list(ours).index(k) if k in ours else 99)
    print(f"{'stage':28s} {'quantlib s':>10s} {'ModelOpt s':>10s}")
    for k in rows:
        a, b = ours.get(k), theirs.get(k)
        print(f"{k:28s} {'' if a is None else f'{a:10.2f}':>10s} {'' if b is None else f'{b:10.2f}':>10s}")
    print(
        f"quantlib: perplexity before {report['perplexity']['before']['perplexity']:.4f}, after "
        f"{report['perplexity']['after']['perplexity']:.4f}, "
        f"reloaded {report['perplexity']['reloaded']['perplexity']:.4f}; {report['check']['summary']}"
    )
    result = {
        "quantlib": ours,
        "modelopt": theirs,
        "preset": args.preset,
        "model": model_dir,
        "sizes": sizes,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device)),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
