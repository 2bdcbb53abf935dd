"""The sender's side of a weight sync: ``(key, tensor)`` pairs grouped into buckets of ONE dtype (and
device) under a byte budget, each one flat buffer with the metadata a broadcast or CUDA-IPC receiver
needs to cut it back into named tensors (an IPC handle shares one typed storage per buffer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .types import ExportError

Pair = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a bucket: ``buffer[offset : offset + numel].view(shape)`` (offsets in elements)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype packed end to end into ``buffer`` (1-D, on their device), described by ``entries``."""

    buffer: torch.Tensor
    entries: tuple[BucketEntry, ...]

    @property
    def dtype(self) -> torch.dtype:
        """The one dtype of every tensor in the bucket."""
        return self.buffer.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return self.buffer.numel() * self.buffer.element_size()

    def tensors(self, buffer: torch.Tensor | None = None) -> list[Pair]:
        """``(name, view)`` of every entry, cut from ``buffer`` (default: this bucket's; a receiver
        passes the buffer it received)."""
        buf = self.buffer if buffer is None else buffer
        return [(e.name, buf.narrow(0, e.offset, e.numel).view(e.shape)) for e in self.entries]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def chunks_by_dtype(pairs: Iterable[Pair], chunk_bytes: int) -> Iterator[list[Pair]]:
    """Lists of pairs of one dtype and device, each of at most ``chunk_bytes`` bytes (a larger tensor
    alone), in the order their lists fill; a list is yielded as soon as the next tensor of its dtype
    would overflow it, so at most one partial list per dtype is held."""
    if chunk_bytes <= 0:
        raise ExportError(f"chunk_bytes must be positive, got {chunk_bytes}")
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[Pair], list[int]]] = {}
    for name, t in pairs:
        key = (t.dtype, t.device)
        chunk, total = open_.setdefault(key, ([], [0]))
        n = _nbytes(t)
        if chunk and total[0] + n > chunk_bytes:
            yield list(chunk)
            chunk.clear()
            total[0] = 0
        chunk.append((name, t))
        total[0] += n
    for chunk, _ in open_.values():
        if chunk:
            yield chunk


def _flat(t: torch.Tensor) -> torch.Tensor:
    # 1-byte float8 dtypes are concatenated as bytes (torch.cat lacks some of them on some devices)
    float8 = t.dtype.itemsize == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool)
    return t.reshape(-1).view(torch.uint8) if float8 else t.reshape(-1)


def bucket_by_dtype(pairs: Iterable[Pair], bucket_bytes: int) -> Iterator[Bucket]:
    """:func:`chunks_by_dtype` as :class:`Bucket`s: one concatenation on the tensors' device per bucket,
    no read back to the host."""
    for chunk in chunks_by_dtype(pairs, bucket_bytes):
        dtype = chunk[0][1].dtype
        entries, offset = [], 0
        for name, t in chunk:
            entries.append(BucketEntry(name, tuple(t.shape), dtype, offset, t.numel()))
            offset += t.numel()
        buffer = torch.cat([_flat(t) for _, t in chunk])
        if buffer.dtype != dtype:
            buffer = buffer.view(dtype)
        yield Bucket(buffer, tuple(entries))
