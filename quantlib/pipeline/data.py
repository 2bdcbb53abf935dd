"""Calibration and held-out text: read from a text / JSONL / Parquet file, a directory of them, or a cached
Hugging Face dataset; tokenized with the model's tokenizer and packed into windows of ``seq_len`` tokens."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from .model import quiet_transformers
from .options import PipelineError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")


@dataclass
class TextWindows:
    """``calib`` [num_samples, seq_len] and the disjoint ``held_out`` [eval_samples, seq_len] token ids."""

    calib: torch.Tensor
    held_out: torch.Tensor
    source: str
    tokens_read: int

    def batches(self, which: str, batch_size: int) -> list[torch.Tensor]:
        """``calib`` or ``held_out`` in batches of ``batch_size`` windows."""
        t = getattr(self, which)
        return [t[i : i + batch_size] for i in range(0, t.shape[0], batch_size)]


def _jsonl_texts(path: str, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PipelineError(f"--data {path}: line {n} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise PipelineError(f"--data {path}: line {n} has no text field {text_field!r} (it has {keys}); pass --text-field NAME")
            yield str(row[text_field])


def _parquet_texts(path: str, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PipelineError(f"--data {path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    if text_field not in table.column_names:
        raise PipelineError(f"--data {path}: no text column {text_field!r} (columns: {table.column_names}); pass --text-field NAME")
    yield from (str(t) for t in table.column(text_field).to_pylist())


def _file_texts(path: str, text_field: str) -> Iterator[str]:
    if path.endswith((".jsonl", ".json")):
        yield from _jsonl_texts(path, text_field)
    elif path.endswith(".parquet"):
        yield from _parquet_texts(path, text_field)
    else:
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()
        except UnicodeDecodeError:
            raise PipelineError(f"--data {path}: not UTF-8 text; pass a text, JSONL or Parquet file") from None


def _dataset_texts(name: str, text_field: str) -> Iterator[str]:
    """A Hugging Face dataset ``name[:config][:split]`` from the local cache only (never a download, so never a hang)."""
    try:
        import datasets
    except ImportError:
        raise PipelineError(
            f"--data {name}: no such file or directory, and the `datasets` package (for Hugging Face datasets) is not installed"
        ) from None
    parts = name.split(":")
    ds_name, config, split = parts[0], parts[1] if len(parts) > 1 and parts[1] else None, parts[2] if len(parts) > 2 else "train"
    # offline first, in-process for this call only: a dataset not in the cache fails in seconds instead of hanging
    # (datasets' load reads HF_HUB_OFFLINE in recent releases, HF_DATASETS_OFFLINE in older ones)
    flags = [f for f in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(datasets.config, f)]
    saved = {f: getattr(datasets.config, f) for f in flags}
    for f in flags:
        setattr(datasets.config, f, True)
    try:
        ds = datasets.load_dataset(ds_name, config, split=split, download_mode="reuse_cache_if_exists")
    except Exception as exc:
        raise PipelineError(
            f"--data {name}: not a file, and not a Hugging Face dataset in the local cache ({type(exc).__name__}); download it first or "
            "pass a file"
        ) from None
    finally:
        for f, v in saved.items():
            setattr(datasets.config, f, v)
    if text_field not in ds.column_names:
        raise PipelineError(f"--data {name}: no text field {text_field!r} (columns: {ds.column_names}); pass --text-field NAME")
    for row in ds:
        yield str(row[text_field])


def iter_texts(source: str, text_field: str = "text") -> Iterator[str]:
    """The documents of ``source``: a file, a directory (its files, sorted), or a cached HF dataset name."""
    if os.path.isdir(source):
        files = sorted(
            os.path.join(d, n)
            for d, _, names in os.walk(source)
            for n in names
            if n.endswith(TEXT_SUFFIXES + (".jsonl", ".json", ".parquet"))
        )
        if not files:
            raise PipelineError(
                f"--data {source}: a directory with no text, JSONL or Parquet files ({', '.join(TEXT_SUFFIXES)}, .jsonl, .parquet)"
            )
        for f in files:
            yield from _file_texts(f, text_field)
    elif os.path.isfile(source):
        yield from _file_texts(source, text_field)
    else:
        yield from _dataset_texts(source, text_field)


def pack(tokenizer: Any, texts: Iterator[str], source: str, num_samples: int, eval_samples: int, seq_len: int) -> TextWindows:
    """Tokenize documents (separated by the EOS token) until ``(num_samples + eval_samples) * seq_len``
    tokens, then cut windows: the first ``num_samples`` calibrate, the next ``eval_samples`` are held out."""
    need = (num_samples + eval_samples) * seq_len
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for text in texts:
        if not text:
            continue
        with quiet_transformers():  # "longer than the model's maximum length": we cut windows ourselves
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise PipelineError(
            f"--data {source}: {len(ids)} tokens, fewer than the {need} the run needs ((--num-samples {num_samples} + --eval-samples "
            f"{eval_samples}) x --seq-len {seq_len}); "
            "pass more text or lower those options"
        )
    t = torch.tensor(ids[:need], dtype=torch.long).view(num_samples + eval_samples, seq_len)
    return TextWindows(t[:num_samples], t[num_samples:], source, len(ids))


def load_windows(
    tokenizer: Any, source: Optional[str], builtin: Optional[str], text_field: str, num_samples: int, eval_samples: int, seq_len: int
) -> TextWindows:
    """Windows of --data, or of the model's built-in text ``builtin`` when --data is not given."""
    if source is None:
        if builtin is None:
            raise PipelineError(
                "--data is required for a model without built-in text: pass a text / JSONL / Parquet file, a directory, or a cached "
                "dataset name"
            )
        source = builtin
    return pack(tokenizer, iter_texts(source, text_field), source, num_samples, eval_samples, seq_len)
