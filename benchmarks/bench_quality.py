"""Perplexity of a small decoder LM after quantization: every calibration algorithm, quantlib next to
ModelOpt 0.47 on the same model, config and data, in one run.

The model: a byte-level decoder (2 blocks, d=128, 4 heads, context 128, ~0.4 M parameters) trained
here with a fixed seed on Python standard-library sources (``json``, ``email``, ``http``, ``xml``
packages of the running interpreter, files sorted by name; the last 10% of the bytes are held out).
Training is deterministic on the CPU; the weights are cached in ``benchmarks/data/quality_lm.pt``
(delete it to retrain: 300 steps of 16 x 128 bytes, ~4 min on one core). Calibration: 16 batches of 8 x 128 bytes of the training
text; evaluation over 64 held-out windows of 128 bytes, in fp32: perplexity, and the mean KL divergence
per byte of the quantized model's next-byte distribution from the fp32 model's (what calibration
tries to keep small; perplexity of a model this small moves by less than the quantization noise).

Each row quantizes the model's linears (not the head) with one ModelOpt preset and one algorithm,
through ModelOpt's own preset dict (integers full range, ModelOpt's default) given to both libraries.
ModelOpt runs where its fake quant runs on the device (its NVFP4 needs CUDA).

    python benchmarks/bench_quality.py [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import quantlib as ql  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = os.path.join(HERE, "data", "quality_lm.pt")
CTX, DIM, HEADS, LAYERS = 128, 128, 4, 2
# (preset, algorithms): max first, the baseline each algorithm must beat
ROWS = [
    ("INT4_AWQ_CFG", ["max", "mse", "awq_lite", "awq_clip", "awq_full"]),
    ("W4A8_AWQ_BETA_CFG", ["max", "awq_lite"]),
    ("INT8_SMOOTHQUANT_CFG", ["max", "smoothquant"]),
    ("W4A16_NVFP4_CFG", ["max", "awq_lite", "awq_clip", "awq_full"]),
]
MODELOPT_CPU = {"INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG", "INT8_SMOOTHQUANT_CFG"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Byte-level decoder; ``lm_head`` stays unquantized in every preset."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, DIM)
        self.pos = nn.Parameter(torch.zeros(CTX, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln(x))


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) bytes of the interpreter's json/email/http/xml sources."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for pkg in ("json", "email", "http", "xml"):
        for dirpath, _, names in os.walk(os.path.join(root, pkg)):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    data = b"".join(open(f, "rb").read() for f in sorted(files))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(0.9 * t.numel())
    return t[:cut], t[cut:]


def windows(t: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, t.numel() - CTX - 1, (n,), generator=g)
    return torch.stack([t[s : s + CTX + 1] for s in starts.tolist()])


def train(text: torch.Tensor, steps: int = 300) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(steps):
        batch = windows(text, 16, seed=step)
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"  step {step}: loss {loss.item():.3f}", file=sys.stderr)
    return model.eval()


@torch.no_grad()
def evaluate(model: nn.Module, held: torch.Tensor, device: str, ref_logp: torch.Tensor | None = None) -> tuple[float, float, torch.Tensor]:
    """(held-out perplexity, mean KL(reference || model) per byte in nats, log-probs)."""
    batch = windows(held, 64, seed=12345).to(device)
    logp = F.log_softmax(model(batch[:, :-1]).float(), dim=-1)
    ppl = math.exp(F.nll_loss(logp.reshape(-1, 256), batch[:, 1:].reshape(-1)).item())
    kl = 0.0 if ref_logp is None else float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    return ppl, kl, logp


def configs(preset: str, algorithm: str) -> tuple[dict, dict | None]:
    """(quantlib config, ModelOpt config or None): ModelOpt's preset dict when ModelOpt imports."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError:
        cfg = copy.deepcopy(ql.PRESETS[preset])
        cfg["algorithm"] = algorithm
        return cfg, None
    mo = copy.deepcopy(getattr(mtq, preset))
    mo["algorithm"] = {"method": algorithm}
    ours = copy.deepcopy(mo)
    for entry in ours["quant_cfg"]:
        for attrs in entry.get("cfg") if isinstance(entry.get("cfg"), list) else [entry.get("cfg")]:
            if isinstance(attrs, dict) and isinstance(attrs.get("num_bits"), int):
                attrs.setdefault("narrow_range", False)  # ModelOpt's integers are full range
    return ours, mo


def run(device: str, repeat: int = 1) -> list[dict]:
    train_text, held = corpus()
    if os.path.exists(WEIGHTS):
        model = TinyLM()
        model.load_state_dict(torch.load(WEIGHTS, weights_only=True))
        model.eval()
    else:
        model = train(train_text)
        os.makedirs(os.path.dirname(WEIGHTS), exist_ok=True)
        torch.save(model.state_dict(), WEIGHTS)
    model = model.to(device)
    calib = [windows(train_text, 8, seed=1000 + i)[:, :-1].to(device) for i in range(16)]

    def loop(m: nn.Module) -> None:
        for b in calib:
            m(b)

    ppl, _, ref = evaluate(model, held, device)
    rows = [{"preset": "fp32", "algorithm": "-", "quantlib": ppl}]
    ppl, kl, _ = evaluate(copy.deepcopy(model).bfloat16(), held, device, ref)
    rows.append({"preset": "bf16", "algorithm": "-", "quantlib": ppl, "quantlib_kl": kl})
    for preset, algos in ROWS:
        for algo in algos:
            ours_cfg, mo_cfg = configs(preset, algo)
            row = {"preset": preset, "algorithm": algo}
            times = []
            for _ in range(repeat):  # best of ``repeat``: the machine's other load inflates single runs
                t = time.perf_counter()
                q = ql.quantize(copy.deepcopy(model), ours_cfg, loop)
                times.append(time.perf_counter() - t)
            row["quantlib_s"] = min(times)
            row["quantlib"], row["quantlib_kl"], _ = evaluate(q, held, device, ref)
            if mo_cfg is not None and (device == "cuda" or preset in MODELOPT_CPU) and not (algo == "mse" and preset != "INT4_AWQ_CFG"):
                import modelopt.torch.quantization as mtq

                times = []
                for _ in range(repeat):
                    t = time.perf_counter()
                    m = mtq.quantize(copy.deepcopy(model), mo_cfg, loop)
                    times.append(time.perf_counter() - t)
                row["modelopt_s"] = min(times)
                row["modelopt"], row["modelopt_kl"], _ = evaluate(m, held, device, ref)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| preset | algorithm | ppl quantlib | ppl ModelOpt | KL quantlib (mnat) | KL ModelOpt (mnat) | calib s quantlib | calib s ModelOpt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = lambda k, fmt, scale=1.0: (fmt % (r[k] * scale)) if k in r else "-"  # noqa: E731
        out.append(
            f"| {r['preset']} | {r['algorithm']} | {f('quantlib', '%.4f')} | {f('modelopt', '%.4f')} | {f('quantlib_kl', '%.3f', 1e3)} | "
            f"{f('modelopt_kl', '%.3f', 1e3)} | {f('quantlib_s', '%.3f')} | {f('modelopt_s', '%.3f')} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeat", type=int, default=3, help="calibration timings: best of this many")
    args = parser.parse_args()
    logging.getLogger("quantlib").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run(args.device, args.repeat)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
