#!/usr/bin/env bash
# The whole GPU suite on a GPU machine, in one command: every test marked `gpu` (Transformer Engine and
# Megatron-Core tests too where they import: they skip cleanly otherwise), the C++ CPU kernel tests on this
# machine's build (with the default --tests), then the GPU benchmarks.
# Installs nothing from the network: build quantlib's CUDA extension first (`pip install
# --no-build-isolation -e .` or `python setup.py build_ext --inplace`), with TE / Megatron-Core installed
# or on PYTHONPATH. Logs, JUnit XML and benchmark JSON go to LOGDIR.
# Benchmarks not in the default list: "sequential" (peak GPU memory of layer-by-layer calibration,
# about a minute), "export" (bench_export.py --profile: packing GB/s against the copy and ModelOpt),
# "casts" (the FP4 and FP8 per-tensor casts export runs, at 16384x7168), "quality" (bench_quality.py
# on the GPU, every held-out window, with each row's aten-op count; ModelOpt's rows where it imports;
# ~10 min).
#
#   scripts/gpu_suite.sh LOGDIR [--tests "PATHS" | none] [--benchmarks "kernels calibrate te" | none]
#                        [--python PY] [--workers N]
#
# All GPU tests run in one pytest process, or in N pytest-xdist workers that share the GPU (each must pass
# whatever ran before it in its process). Exit status: that of pytest, or 1 where a benchmark failed.
set -uo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    sed -n '2,18p' "$0" >&2
    exit 2
fi
logdir=$1
shift
tests="tests"
benchmarks="kernels calibrate te"
py=python3
workers=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) tests=$2; shift 2 ;;
        --benchmarks) benchmarks=$2; shift 2 ;;
        --python) py=$2; shift 2 ;;
        --workers) workers=(-n "$2"); shift 2 ;;
        *) echo "gpu_suite.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ "$benchmarks" = none ] && benchmarks=""
cd "$(dirname "$0")/.."
mkdir -p "$logdir"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
    "$py" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
for name in ("quantlib", "triton", "transformer_engine", "megatron.core", "modelopt"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), "from", getattr(m, "__file__", "?"))
    except Exception as exc:
        print(name, "does not import:", type(exc).__name__, str(exc)[:200])
try:
    import transformer_engine.pytorch  # noqa: F401
    print("transformer_engine.pytorch imports")
except Exception as exc:
    print("transformer_engine.pytorch does not import:", type(exc).__name__, str(exc)[:200])
import quantlib.kernels.backends as b
print("quantlib CUDA kernels:", b.has_cuda_kernels(), "Triton:", b.triton_available())
EOF
} > "$logdir/env.txt" 2>&1
cat "$logdir/env.txt"

status=0
if [ "$tests" != none ]; then
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 "$py" -m pytest -m gpu $tests "${workers[@]}" -ra -q --junitxml="$logdir/pytest_gpu.xml" 2>&1 | tee "$logdir/pytest_gpu.log"
    status=${PIPESTATUS[0]}
    tail -1 "$logdir/pytest_gpu.log"
fi
if [ "$tests" = tests ]; then
    # the C++ CPU kernels as this machine built them (its compiler, its CPU's vector units), which CI never sees
    cpu_tests="tests/test_kernels/test_cpu_kernels.py tests/test_kernels/test_fp8_block_codes_lanes.py"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 "$py" -X faulthandler -m pytest $cpu_tests "${workers[@]}" -ra -q --junitxml="$logdir/pytest_cpu_kernels.xml" 2>&1 |
        tee "$logdir/pytest_cpu_kernels.log" | tail -3
    cpu_status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$cpu_status
fi

for bench in $benchmarks; do
    case "$bench" in
        kernels) cmd=("$py" benchmarks/bench_kernels.py --no-reference --json "$logdir/bench_kernels.json") ;;
        calibrate) cmd=("$py" benchmarks/bench_calibrate.py --device cuda --dim 1024 --blocks 8 --tokens 4096 --batches 8 --warmup) ;;
        te) cmd=("$py" benchmarks/bench_te.py --json "$logdir/bench_te.json") ;;
        sequential) cmd=("$py" benchmarks/bench_sequential.py --device cuda --json "$logdir/bench_sequential.json") ;;
        export) cmd=("$py" benchmarks/bench_export.py --profile --out "$logdir/bench_export.md") ;;
        casts) cmd=("$py" benchmarks/bench_kernels.py --shapes 16384x7168 --cases "mx_cast MXFP4,nvfp4_cast,fp8_cast" --no-peers --no-reference --json "$logdir/bench_casts.json") ;;
        quality) cmd=("$py" benchmarks/bench_quality.py --device cuda --windows 0 --count-ops --json "$logdir/bench_quality.json") ;;
        *) echo "gpu_suite.sh: unknown benchmark $bench" >&2; [ "$status" -eq 0 ] && status=2; continue ;;
    esac
    echo "+ ${cmd[*]}"
    if ! PYTHONUNBUFFERED=1 "${cmd[@]}" > "$logdir/bench_$bench.log" 2>&1; then
        echo "benchmark $bench failed (see $logdir/bench_$bench.log)"
        [ "$status" -eq 0 ] && status=1
    fi
    tail -30 "$logdir/bench_$bench.log"
done
exit "$status"
