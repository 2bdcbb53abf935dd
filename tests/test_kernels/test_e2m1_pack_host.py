"""The E2M1 rounding and packing of the CUDA casts (csrc/cuda/e2m1_pack.cuh), run on the CPU: the header
is compiled with g++ into tests/test_kernels/e2m1_pack_check.cpp, so what is checked here is the code
the kernels inline. Every fp32 magnitude below 8 against quantlib/formats/e2m1.py's thresholds, the
word packing (codes summed at their nibbles, signs by byte permutes) against one code at a time, and
the codes of every bf16 value and of the fp32 neighbours of each rounding threshold against torch's
``e2m1_encode`` itself, and the one-correction quotient NVFP4 uses for bf16 inputs against the codes
of the correctly rounded quotient. Skips without a host compiler.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from quantlib.formats.e2m1 import e2m1_encode

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_name("e2m1_pack_check.cpp")
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("e2m1") / "e2m1_pack_check"
    # the flags of the CPU extension's numerics: no contraction of a * b + c into an FMA
    cmd = [CXX, "-O2", "-std=c++17", "-ffp-contract=off", "-fopenmp", f"-I{ROOT / 'csrc' / 'cuda'}", str(SOURCE), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def _run(exe: Path, *args: str) -> None:
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_every_fp32_magnitude_rounds_as_the_reference(checker):
    _run(checker, "every")


def test_word_packing_matches_one_code_at_a_time(checker):
    _run(checker, "pack", "300000")


def test_one_correction_bf16_quotients_give_the_codes_of_the_rounded_quotient(checker):
    # every 61st divisor mantissa here (about 2 s); all of them (`e2m1_pack_check div 1`, about two
    # CPU minutes) passed when the kernel started using it
    _run(checker, "div", "61")


def _probe() -> torch.Tensor:
    bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    near = [t]
    up, down = t.clone(), t.clone()
    for _ in range(4):
        up, down = torch.nextafter(up, torch.tensor(np.inf)), torch.nextafter(down, torch.tensor(0.0))
        near += [up, down]
    near = torch.cat(near)
    special = torch.tensor([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, 7.0, 8.0, 1e9])
    rand = torch.randn(200000, generator=torch.Generator().manual_seed(0)) * 3
    return torch.cat([bf16, near, -near, special, rand]).float()


def test_codes_equal_torch_e2m1_encode(checker, tmp_path):
    y = _probe()
    src, dst = tmp_path / "y.f32", tmp_path / "codes.u8"
    y.numpy().astype(np.float32).tofile(src)
    _run(checker, "file", str(src), str(dst))
    got = torch.from_numpy(np.fromfile(dst, dtype=np.uint8))
    want = e2m1_encode(y)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(y[i]), int(got[i]), int(want[i])) for i in bad[:10]]
