"""Models and data of the quality benchmark (benchmarks/bench_quality.py): a dense byte-level decoder
LM and a tiny Qwen3-MoE, both trained here on the CPU, deterministically, on Python standard-library
sources of the running interpreter; weights cached under ``benchmarks/data``.

The dense model builds attention and MLP from ``nn.Linear`` (q/k/v/o, SwiGLU gate/up/down) so that
every preset reaches the same GEMMs a transformers decoder has. The MoE model is transformers' own
``Qwen3MoeForCausalLM`` (fused 3-D experts, top-2 of 4) from a tiny config, so the per-expert search
runs on the class users quantize.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
DENSE_WEIGHTS = os.path.join(HERE, "data", "quality_dense.pt")
MOE_WEIGHTS = os.path.join(HERE, "data", "quality_moe.pt")
CTX, VOCAB = 128, 256
#: stdlib packages whose ``.py`` files are the text (sorted by path; the last 10% of bytes held out)
PACKAGES = ("json", "email", "http", "xml", "logging", "urllib", "concurrent", "importlib")
#: training threads: fixed so the float reductions, hence the weights, repeat from run to run
THREADS = 2


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (the gain is what SmoothQuant folds into)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(dim), Attention(dim, heads)
        self.post_attention_layernorm, self.mlp = RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseLM(nn.Module):
    """Byte-level pre-norm decoder (learned positions); ``lm_head`` stays unquantized in every preset."""

    def __init__(self, dim: int = 256, layers: int = 4, heads: int = 4, hidden: int = 640) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(CTX, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        for name, p in self.named_parameters():  # GPT-2's init: torch's default trained to a worse loss
            if p.dim() == 2 and name != "pos":
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class LogitsOnly(nn.Module):
    """A transformers causal LM seen as ``ids -> logits`` (the benchmark's one calling convention)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits


def moe_lm() -> nn.Module:
    """A tiny transformers Qwen3-MoE (2 layers, hidden 128, 4 experts of 128, top-2), byte vocabulary."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=CTX, tie_word_embeddings=False, experts_implementation="eager",
    )  # fmt: skip
    return LogitsOnly(Qwen3MoeForCausalLM(config))


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) bytes of the interpreter's sources of :data:`PACKAGES`."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for pkg in PACKAGES:
        for dirpath, _, names in os.walk(os.path.join(root, pkg)):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    data = b"".join(open(f, "rb").read() for f in sorted(files))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(0.9 * t.numel())
    return t[:cut], t[cut:]


def windows(text: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``n`` random windows of ``CTX + 1`` bytes of ``text`` (input and shifted target)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - CTX - 1, (n,), generator=g)
    return torch.stack([text[s : s + CTX + 1] for s in starts.tolist()])


def spaced_windows(text: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` windows of ``CTX + 1`` bytes evenly spaced over ``text`` (disjoint inputs while ``n`` is at
    most ``len(text) / CTX``): the held-out set, covered instead of sampled."""
    starts = torch.linspace(0, text.numel() - CTX - 1, n).long()
    return torch.stack([text[s : s + CTX + 1] for s in starts.tolist()])


def train(model: nn.Module, text: torch.Tensor, steps: int, batch: int = 16, lr: float = 3e-3, weight_decay: float = 0.01) -> nn.Module:
    """AdamW with warm-up and cosine decay on random windows of ``text``; seeded, so repeatable."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    for step in range(steps):
        w = windows(text, batch, seed=step)
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f}", file=sys.stderr)
    return model.eval()


def load_or_train(build: Callable[[], nn.Module], path: str, steps: int, retrain: bool = False, lr: float = 3e-3,
                  weight_decay: float = 0.01) -> nn.Module:
    """The model ``build`` makes, with the cached weights at ``path`` (trained and cached when missing
    or ``retrain``); stored in bf16 to halve the file, computed in fp32."""
    torch.manual_seed(0)
    model = build()
    if os.path.exists(path) and not retrain:
        state = torch.load(path, weights_only=True)
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        train(model, corpus()[0], steps, lr=lr, weight_decay=weight_decay)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():  # the cached weights are the ones every run evaluates
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({k: v.bfloat16() if v.is_floating_point() else v for k, v in model.state_dict().items()}, path)
    return model


def dense_model(retrain: bool = False, steps: int = 1000) -> nn.Module:
    """The trained dense LM (d=256, 4 blocks, ~3.2 M parameters): 1000 steps (2 M bytes) at a larger
    rate without weight decay, so that 4-bit weights cost perplexity (after 300 steps at 2e-3 with
    decay, INT4 cost +0.12%: too little to rank the algorithms)."""
    return load_or_train(DenseLM, DENSE_WEIGHTS, steps, retrain, lr=3e-3, weight_decay=0.0)


def moe_model(retrain: bool = False, steps: int = 300) -> nn.Module:
    """The trained tiny Qwen3-MoE (2 blocks, top-2 of 4 experts)."""
    return load_or_train(moe_lm, MOE_WEIGHTS, steps, retrain)
