"""One progress bar (tqdm) per stage of a run, and the wall time of each stage."""

from __future__ import annotations

import time
from typing import Optional

from tqdm.auto import tqdm


class Stage:
    """A running stage: its bar (``total`` steps, or a spinner when None) and its start time."""

    def __init__(self, name: str, total: Optional[int], show: bool) -> None:
        self.name = name
        self.start = time.perf_counter()
        self.bar = tqdm(total=total, desc=name, unit="step", leave=True, dynamic_ncols=True) if show else None

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def describe(self, text: str) -> None:
        """Say what the stage is doing now (``calibrate layer 3/32``)."""
        if self.bar is not None:
            self.bar.set_description(text)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.start


class Stages:
    """The run's stages in order, with their wall times in seconds."""

    def __init__(self, show: bool = True) -> None:
        self.show = show
        self.times: dict[str, float] = {}
        self._open: Optional[Stage] = None

    def begin(self, name: str, total: Optional[int] = None) -> Stage:
        self.end()
        self._open = Stage(name, total, self.show)
        return self._open

    def end(self) -> None:
        if self._open is not None:
            name = self._open.name
            self.times[name] = self.times.get(name, 0.0) + self._open.close()
            self._open = None
