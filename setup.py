"""Build of quantlib: the pure-Python package plus the optional compiled extension ``quantlib._C``.

The C++ CPU kernels (csrc/cpu) are always built; the CUDA kernels (csrc/cuda) when the installed torch
has CUDA, nvcc is found, and a GPU is visible or TORCH_CUDA_ARCH_LIST names the architectures. Install with
``pip install --no-build-isolation .`` so the build uses the torch already installed (an isolated build would fetch another torch).
"""

import glob
import os

from setuptools import find_packages, setup


def extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # metadata-only builds (e.g. sdist) need no torch
        return [], {}
    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp")) + sorted(glob.glob("csrc/*.cpp"))
    if not cpu_sources:
        return [], {}
    # No fast-math and no FMA contraction: the kernels must round every fp32 operation as torch does.
    # -fno-trapping-math (as torch's own build) only lets the compiler vectorize selects; results stay IEEE.
    cxx = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math"]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    # torch picks the CUDA architectures from the visible GPUs or TORCH_CUDA_ARCH_LIST (its documented build
    # variable); with neither (a CUDA build of torch on a CPU machine) it has none and the build fails
    use_cuda = use_cuda and (torch.cuda.is_available() or bool(os.environ.get("TORCH_CUDA_ARCH_LIST")))
    kwargs = dict(name="quantlib._C", extra_link_args=["-fopenmp"])
    if use_cuda:
        ext = cpp_extension.CUDAExtension(
            sources=cpu_sources + cuda_sources,
            extra_compile_args={"cxx": cxx + ["-DQUANTLIB_WITH_CUDA"], "nvcc": ["-O3", "-std=c++17", "-DQUANTLIB_WITH_CUDA",
                                                                                "--fmad=false"]},
            **kwargs,
        )
    else:
        ext = cpp_extension.CppExtension(sources=cpu_sources, extra_compile_args=cxx, **kwargs)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(no_python_abi_suffix=False)}


ext_modules, cmdclass = extensions()

# triton: a range, not a pin: torch's CUDA builds require their own triton (torch 2.13.0's: 3.7.1), and an
# exact pin made pip trade the user's torch for an older release. 3.6-3.8 pass the interpreter tests;
# 3.9.0's interpreter refuses our kernels' masks ("mask has unsupported dtype", 2026-12-03)
# ruff: pinned, as a newer release adds findings of its own (tests/test_lint.py runs it on the tree)
TEST = ["pytest", "pytest-xdist", "hypothesis", "triton>=3.6.0,<3.9; platform_system == 'Linux' and platform_machine == 'x86_64'",
        "ruff==0.17.6",
        # the calibration-data readers of quantlib quantize: Parquet files and cached Hugging Face datasets
        "pyarrow", "datasets"]
# psutil: Megatron-Core 0.16.1's dist checkpointing needs it but does not declare it (it hangs without)
MEGATRON = ["megatron-core==0.16.1; python_version < '3.12'", "megatron-core>=0.16.1; python_version >= '3.12'", "psutil"]
TRANSFORMERS = ["transformers>=5.14"]
# export consumers the CPU tests load exports with (tests/export): compressed-tensors' decompressors, transformers'
# fine-grained FP8 loader (needs accelerate), ModelOpt's qtensors (0.47 imports requests without declaring it)
# the README's first command (quantlib quantize) loads its export back with transformers' fine-grained FP8 loader
# (which needs accelerate) and compressed-tensors' own decompressor: extra "export"
EXPORT = ["compressed-tensors>=0.20.1,<0.21", "accelerate>=1.16"]
EXPORT_CONSUMERS = EXPORT + ["nvidia-modelopt==0.47.0", "requests"]
TEST = TEST + EXPORT_CONSUMERS

setup(
    name="quantlib",
    version="0.1.0",
    description="Quantization of PyTorch models (PTQ and QAT), ModelOpt-compatible configs, exact numerics",
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["quantlib", "quantlib.*"]),
    # the small language model `quantlib quantize` runs on without --model (scripts/train_embedded_lm.py), with its text
    package_data={"quantlib": ["embedded/*"]},
    install_requires=["torch>=2.4,<=2.14.1", "numpy", "tqdm"],
    extras_require={
        "test": TEST + MEGATRON + TRANSFORMERS,
        "megatron": MEGATRON,
        "transformers": TRANSFORMERS,
        "export": EXPORT,
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["quantlib=quantlib.__main__:main"]},
)
