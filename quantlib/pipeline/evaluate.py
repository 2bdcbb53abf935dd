"""Perplexity on held-out windows, with the standard error over windows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .options import PipelineError
from .stages import Stage


@dataclass
class Perplexity:
    """exp(mean NLL per token) over windows; ``stderr``: the standard error of that perplexity (delta method
    on the mean of the windows' NLL)."""

    ppl: float
    stderr: float
    windows: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.ppl:.4g} ± {self.stderr:.2g}"

    def as_dict(self) -> dict:
        return {"perplexity": self.ppl, "stderr": self.stderr, "windows": self.windows, "tokens": self.tokens}


@torch.no_grad()
def perplexity(model: nn.Module, batches: list[torch.Tensor], device: torch.device, stage: Stage) -> Perplexity:
    """Perplexity of ``model`` on ``batches`` (each [b, seq_len] token ids; every window scored on its own)."""
    per_window: list[torch.Tensor] = []
    for batch in batches:
        ids = batch.to(device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        per_window.append(nll.view(ids.shape[0], -1).mean(dim=1).cpu())
        stage.advance()
    nll = torch.cat(per_window).double()
    mean = nll.mean().item()
    se = nll.std().item() / math.sqrt(nll.numel()) if nll.numel() > 1 else float("nan")
    ppl = math.exp(mean)
    if not math.isfinite(mean):
        raise PipelineError(f"perplexity: the model gave a non-finite loss ({mean}) on the held-out text")
    return Perplexity(ppl, ppl * se, nll.numel(), nll.numel() * (batches[0].shape[1] - 1))
