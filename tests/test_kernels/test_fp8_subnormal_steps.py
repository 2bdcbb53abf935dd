"""The subnormal rounding of the C++ CPU kernels' FP8 / FP6 codes (``fp8_subnormal_steps`` in
csrc/cpu/numerics.h: one fp32 addition of a power of two whose ulp is the subnormal step), run on the
host: tests/test_kernels/fp8_subnormal_check.cpp includes the header and compares the kernel's count
of steps with |y| / step rounded to nearest even in double precision, for every 7th fp32 magnitude
below the smallest normal of E4M3, E5M2, E3M2 and E2M3 and every one of the 2^16 at each end (all of
them, ``fp8_subnormal_check 1``, passed when the addition replaced the significand shift). Skips
without a host compiler.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_name("fp8_subnormal_check.cpp")
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")


def test_every_subnormal_magnitude_rounds_to_the_nearest_even_step(tmp_path):
    exe = tmp_path / "fp8_subnormal_check"
    # the flags of the CPU extension (setup.py): IEEE fp32, no contraction
    cmd = [CXX, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", f"-I{ROOT / 'csrc' / 'cpu'}", str(SOURCE),
           "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe), "7"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
