#!/usr/bin/env bash
# The Python packages a GPU machine with no network lacks for the GPU suite and the peer benchmarks, as wheels for its
# Python 3.12 (x86-64 Linux), into DIR: transformers 5.25 with its hub and HTTP stack, nvidia-modelopt 0.47 with the
# dependencies such an image lacks, torchao 0.18 (a peer of the kernel benchmark), and DIR/stub/pulp, a stand-in for
# PuLP (ModelOpt imports it for its NAS solver alone; quantization and export never call it). About 34 MB. On the GPU
# machine:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:DIR/stub
#
#   scripts/device_wheels.sh DIR
# Versions: those CI's pinned line resolved on 2026-12-07; Transformer Engine and Megatron-Core come as their own bundle.
set -euo pipefail
dir=${1:?usage: scripts/device_wheels.sh DIR}
mkdir -p "$dir/stub/pulp"
wheels=(  # every one pinned: pip resolves none of their needs here (--no-deps), so these are the set that imports together
    transformers==5.25.0 huggingface-hub==2.4.0 kernels==0.19.1 hf-xet==1.8.0 httpx2==2.17.0 httpcore2==2.17.0
    truststore==0.10.5 idna==3.21 anyio==4.16.0 click==8.5.1 tomlkit==0.15.3
    nvidia-modelopt==0.47.0 omegaconf==2.4.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing-extensions==4.16.0
    torchao==0.18.0  # the peer of benchmarks/bench_kernels.py (its blockwise FP8 and MX Triton kernels)
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${wheels[@]}"
cat > "$dir/stub/pulp/__init__.py" <<'EOF'
"""Stand-in for PuLP: ModelOpt imports it for its NAS solver alone; quantization and export never call it."""


class _Solver:
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    return type(name, (_Solver,), {})
EOF
ls "$dir"/*.whl | wc -l
