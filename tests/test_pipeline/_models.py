"""Tiny transformers models written to disk as model directories (no downloads), with quantlib's byte-level
tokenizer, and small calibration text files."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import torch

from quantlib.pipeline.model import EMBEDDED_DIR

_SHAPE = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "eos_token_id",
          "pad_token_id")
with open(os.path.join(EMBEDDED_DIR, "config.json")) as _f:
    #: the embedded model's shape and tokens (its byte tokenizer fits every family), two layers
    COMMON = {k: v for k, v in json.load(_f).items() if k in _SHAPE} | dict(num_hidden_layers=2, max_position_embeddings=128)
#: small options of a run: a few short windows
FAST = dict(num_samples=2, eval_samples=2, seq_len=32, batch_size=2, progress=False)


def build(family: str):
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=256, **COMMON))
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(intermediate_size=256, **COMMON))
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, experts_implementation="eager", **COMMON
        )
        return tf.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":  # experts under other checkpoint names: block_sparse_moe.experts.{e}.w1 / w3 / w2
        cfg = tf.MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **COMMON)
        return tf.MixtralForCausalLM(cfg)
    raise ValueError(family)


def write_model(root: Path, family: str, tokenizer: bool = True) -> Path:
    """``root/family``: config.json, model.safetensors and (unless ``tokenizer`` is False) the byte-level tokenizer."""
    path = root / family
    build(family).eval().save_pretrained(path)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(EMBEDDED_DIR, name), path / name)
    return path


def stdlib_text(n_bytes: int = 40_000) -> str:
    """Real text: the start of the interpreter's ``textwrap`` and ``csv`` sources."""
    root = sysconfig.get_paths()["stdlib"]
    text = "".join(open(os.path.join(root, f), encoding="utf-8").read() for f in ("textwrap.py", "csv.py", "string.py"))
    return text[:n_bytes]


def write_text(path: Path, n_bytes: int = 40_000) -> Path:
    path.write_text(stdlib_text(n_bytes))
    return path


def write_jsonl(path: Path, field: str = "text", n_docs: int = 20) -> Path:
    text = stdlib_text()
    step = len(text) // n_docs
    with open(path, "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({field: text[i * step : (i + 1) * step], "id": i}) + "\n")
    return path


def write_disk(root: Path) -> dict[str, Path]:
    """Everything the pipeline tests read: the three model families, one without a tokenizer, a text and a JSONL file."""
    return {
        "root": root,
        "text": write_text(root / "calib.txt"),
        "jsonl": write_jsonl(root / "calib.jsonl"),
        "no_tok": write_model(root / "no_tokenizer", "llama", tokenizer=False),
        **{f: write_model(root, f) for f in ("llama", "qwen3", "qwen3_moe")},
    }
