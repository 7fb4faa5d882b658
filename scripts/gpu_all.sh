#!/usr/bin/env bash
# Every GPU check of the project in one go, results in OUTDIR: the test suite (scripts/gpu_tests.sh)
# and the benchmarks (decode, chunk, bf16 accuracy, model throughput). With two or more GPUs the tests
# run on the first and the benchmarks on the second, at the same time, so the timings are not disturbed.
#   bash scripts/gpu_all.sh OUTDIR                    # everything
#   STEPS="tests chunk" bash scripts/gpu_all.sh OUTDIR
# Each step has its own time limit (T_TESTS, T_DECODE, T_CHUNK, T_ACC, T_MODEL seconds); the benchmarks
# write their JSON/Markdown as they go, so a step cut short keeps what it measured.
# The tests' compile workers load the CPUs, which inflates launch-bound timings on the other GPU
# (seen on 2026-11-30 with 12 workers): PYTEST_WORKERS defaults to 6 here, and QUIET=1 starts the
# benchmarks only after the tests have finished.
# Without a package registry (our H200), source scripts/device_setup.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_all.sh OUTDIR}
mkdir -p "$OUT"
STEPS=${STEPS:-"tests decode chunk accuracy model"}
export TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] || { echo "scripts/gpu_all.sh: no CUDA GPU"; exit 2; }
TEST_GPU=0
BENCH_GPU=$([ "$NGPU" -ge 2 ] && echo 1 || echo 0)
has() { [[ " $STEPS " == *" $1 "* ]]; }

tests_pid=
if has tests; then
    CUDA_VISIBLE_DEVICES=$TEST_GPU PYTEST_WORKERS=${PYTEST_WORKERS:-6} timeout "${T_TESTS:-900}" \
        bash scripts/gpu_tests.sh "$OUT/gpu_tests.log" > "$OUT/gpu_tests.summary" 2>&1 &
    tests_pid=$!
    # one GPU, or QUIET=1: the benchmarks wait for the tests
    if [ "$BENCH_GPU" = "$TEST_GPU" ] || [ -n "${QUIET:-}" ]; then wait $tests_pid; fi
fi
export CUDA_VISIBLE_DEVICES=$BENCH_GPU
bench() {   # name, limit, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $? ; tail:"; grep -v Warning "$OUT/$name.log" | tail -n 12
}
has decode && bench decode "${T_DECODE:-240}" python3 benchmarks/benchmark_decode.py --out "$OUT"
has decode && bench decode_sweep "${T_DECODE:-240}" python3 benchmarks/benchmark_decode.py --batch 1 64 \
    --rules falcon3 falcon3a --sweep 8,1 16,2 32,4 64,4 128,4 128,8 --out "$OUT"
has chunk && bench chunk "${T_CHUNK:-900}" python3 benchmarks/benchmark_chunk.py --out "$OUT"
has accuracy && bench accuracy "${T_ACC:-300}" python3 benchmarks/accuracy_chunk.py --out "$OUT"
has model && bench model "${T_MODEL:-600}" python3 benchmarks/benchmark_model.py --out "$OUT"
if [ -n "$tests_pid" ]; then
    wait $tests_pid
    echo "== tests"; cat "$OUT/gpu_tests.summary"
fi
