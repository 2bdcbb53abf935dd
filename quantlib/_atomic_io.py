"""Atomic ``torch.save``: a temp file in the target's folder, fsync, rename; no half-written file on disk."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, Union

import torch
from torch.utils.serialization import config as serialization_config


def atomic_torch_save(obj: Any, path: Union[str, os.PathLike], *, crc32: bool = True) -> None:
    """``torch.save(obj)`` to ``path`` atomically; a symlink at ``path`` stays a link and its target gets the
    file. ``crc32`` forces the archive's CRC-32 checksums on, even where a user turned torch's off."""
    # like open(path, "wb"), write through a symlink (renaming onto the link would replace it by a file)
    path = os.path.realpath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".quantlib-{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    # created like open(path, "wb") would (mode 0o666 & ~umask), not 0o600 as tempfile.mkstemp does
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    checksums = serialization_config.patch({"save.compute_crc32": True}) if crc32 else contextlib.nullcontext()
    try:
        with os.fdopen(fd, "wb") as f, checksums:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
