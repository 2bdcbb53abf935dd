"""The Triton combine compiled for a Hopper GPU without one (Triton's compiler to PTX and cubin on the CPU): it builds
for every dtype the grouped forward launches it with, and no fused multiply-add skips the product's rounding (the
interpreter tests, tests/test_kernels/test_triton_combine.py, hold its bits; a GPU runs the same comparison compiled in
tests/test_plugins/test_expert_dispatch.py)."""

from __future__ import annotations

import os
import re

import pytest

from . import _interpreted

#: false where another module of this process switched triton to its interpreter before it was imported
#: (tests/test_kernels/_interpreted.py): its @triton.jit functions cannot compile here, so the module runs in a subprocess
_FRESH = os.environ.get("TRITON_INTERPRET") != "1"

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from quantlib.kernels.triton.combine import combine_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _compiling_triton(request):
    _interpreted.skip_unless_fresh(request, _FRESH, "this process's triton is interpreted: the module runs in a subprocess")


def test_module_in_a_fresh_interpreter():
    _interpreted.run_in_subprocess(__file__, _FRESH, interpret=False)


#: (rows, weight, output) pointer types as combine_rows passes them on CUDA (bf16 rows read as int16), their dtype codes
VARIANTS = {
    "bf16-f32w-bf16": ("*i16", "*fp32", "*bf16", dict(ROW_DT=2, W_DT=0, PROD_RND=0, OUT_RND=2, OUT_DT=1)),
    "bf16-bf16w-bf16": ("*i16", "*i16", "*bf16", dict(ROW_DT=2, W_DT=2, PROD_RND=2, OUT_RND=2, OUT_DT=1)),
    "f16-f16w-f16": ("*fp16", "*fp16", "*fp16", dict(ROW_DT=1, W_DT=1, PROD_RND=1, OUT_RND=1, OUT_DT=3)),
    "f32-f32w-f32": ("*fp32", "*fp32", "*fp32", dict(ROW_DT=0, W_DT=0, PROD_RND=0, OUT_RND=0, OUT_DT=0)),
}


def _ptx(rows: str, weight: str, out: str, codes: dict, sentinels: bool, fusion: bool = False) -> str:
    names = combine_kernel.arg_names
    sig = dict(zip(names, [rows, weight, "*i1", "*i64", out, "i32", "i32", "i32"]))
    consts = {"K": 8, "BLOCK_H": 1024, **codes, "HAS_W": True, "HAS_VALID": sentinels}
    sig.update({k: "constexpr" for k in consts})
    src = compiler.ASTSource(fn=combine_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=backends.GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion, "num_warps": 4})
    return kernel.asm["ptx"]


@pytest.mark.parametrize("sentinels", [False, True], ids=["local", "sentinels"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_combine_compiles_for_sm90_with_every_product_and_add_rounded(variant, sentinels):
    rows, weight, out, codes = VARIANTS[variant]
    ptx = _ptx(rows, weight, out, codes, sentinels)
    assert not re.search(r"\bfma\.", ptx), "a fused multiply-add would skip the rounding of rows * weight"
    # fp16: the compiler narrows fp32 ops on fp16 values to fp16 ones, the same bits (fp32 has over 2 x 11 + 2 bits)
    assert re.search(r"\bmul\.rn\.f(32|16)", ptx) and re.search(r"\badd\.rn\.f(32|16)", ptx)


def test_the_check_sees_a_fused_multiply_add():
    """With fusion on, the same kernel's product and add contract into an FMA: what the test above would catch."""
    assert re.search(r"\bfma\.", _ptx(*VARIANTS["f32-f32w-f32"], sentinels=False, fusion=True))
