"""The launcher's autotuning on CUDA tensors: once per size bucket (the next power of two of each size), not per
shape, and never a config outside the call's own candidates. Runs without a GPU: the tuner and the launch are
recorded, not run."""

from __future__ import annotations

import pytest
import torch

from quantlib.kernels.triton import _launch


class _Kernel:
    class fn:  # noqa: N801  (what triton's JIT function exposes: the wrapped function)
        __name__ = "probe"


@pytest.fixture
def recorded(monkeypatch):
    calls = {"tune": [], "run": []}
    monkeypatch.setattr(_launch, "_BEST", {})
    monkeypatch.setattr(_launch, "_tune", lambda kernel, grid, args, consts, cands: calls["tune"].append(args) or cands[-1])
    monkeypatch.setattr(_launch, "_run", lambda kernel, grid, args, consts, cfg: calls["run"].append((args, cfg)))
    return calls


def _go(rows: int, cands: list[dict], flag: bool = False) -> None:
    args = (object(), rows, 4096, flag)
    _launch.launch(_Kernel, lambda meta: (1,), args, {"BP": 32}, cands, torch.device("cuda", 0), _launch.TUNE_MIN_NUMEL)


def test_tunes_once_per_size_bucket(recorded):
    cands = [{"ROWS": 4, "num_warps": 4}, {"ROWS": 8, "num_warps": 8}]
    for rows in (1025, 1500, 2048, 1800):  # one bucket (2048): one tuning
        _go(rows, cands)
    assert len(recorded["tune"]) == 1
    assert [cfg for _, cfg in recorded["run"]] == [cands[-1]] * 4
    _go(2049, cands)  # the next bucket tunes again
    _go(2049, cands, flag=True)  # a runtime flag is kept exact
    assert len(recorded["tune"]) == 3


def test_a_kept_config_is_one_of_the_calls_candidates(recorded):
    _go(1500, [{"ROWS": 4, "num_warps": 4}, {"ROWS": 8, "num_warps": 8}])
    other = [{"ROWS": 2, "num_warps": 2}, {"ROWS": 16, "num_warps": 8}]
    _go(1600, other)  # same bucket, other candidates: tuned among its own
    assert recorded["run"][-1][1] == other[-1] and len(recorded["tune"]) == 2
