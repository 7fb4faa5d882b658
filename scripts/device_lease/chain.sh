#!/usr/bin/env bash
# What a lease runs (started once by step.sh, in /tmp/br, a copy of the repo; logs and results in /tmp/L).
# Settings (environment, or scripts/device_lease/lease.env beside this file):
#   TESTS     pytest arguments run first on cores TEST_CORES (0-3) with TEST_WORKERS (4) workers; empty: none
#   PROFILE   profile_step.py arguments (addition models whose training step is profiled by kernel), after
#             TESTS; several runs separated by ';' (e.g. "falcon1a gdn; falcon1a gdn --bf16")
#   MODELS    addition models of the paper preset (seeds 0 1 2, --resume into /tmp/L/paper), cores PAPER_CORES (4-7)
#   WARM      addition models to compile ahead (8 steps, a tiny eval, 3 at once on cores 8-15): their kernels
#             and autotuning land in Triton's cache before the paper runs reach them
#   JOBS      paper runs in flight (2)
#   LEASE_MIN minutes of the lease, counted from this script's start, that the paper and probe runs may use (26):
#             a run not expected to finish by then is not started (evals.addition --time-budget)
#   PROBE     ';'-separated sets of extra evals.addition arguments, each a variant of the paper preset (seed 0,
#             one run in flight per model), e.g. "--models falcon1a transformer --lr 1e-3; --models gdn --lr 5e-4";
#             all sets at once on cores 8-15 beside MODELS, results in /tmp/L/probe/<i>/ (kept by step.sh)
#   RESUME    a folder of earlier runs/*.json to start from (copied into /tmp/L/paper/runs)
#   PAPER_MPS 1: the paper runs go through CUDA MPS (nvidia-cuda-mps-control, when the machine has it), so that the
#             kernels of several small runs share the GPU at once instead of taking turns (without it the GPU
#             time-slices between processes: in the twelfth lease, 4 runs beside the tests each trained 1.3-4.3x
#             longer than the same model's seed-0 run); the tests stay outside
#   PRE_BENCH arguments of benchmarks/benchmark_chunk.py run first, before TESTS and MODELS (the GPU to itself
#             but for WARM's few steps), e.g. a --profile of the chunk kernels; output in /tmp/L/prebench
#   ACCURACY  run benchmarks/accuracy_chunk.py (bf16 forward error vs fp64) after PRE_BENCH with these
#             arguments ("-" for its defaults); output in /tmp/L/accuracy
#   PRE_CMD   a shell command run after PRE_BENCH/ACCURACY, before TESTS and MODELS (the GPU to itself), output in
#             /tmp/L/precmd.log; e.g. tests and a timing of files carried untracked from a work-in-progress branch
#   SIDE_CMD  a shell command run beside TESTS and MODELS (after PRE_CMD; the GPU shared), output in /tmp/L/sidecmd.log
#   BENCH     arguments of benchmarks/benchmark_chunk.py, run when the rest is done (with two GPUs: from the start,
#             on the second); empty: none
set -x
L=/tmp/L
cd "$(dirname "$0")/../.."
[ -f scripts/device_lease/lease.env ] && . scripts/device_lease/lease.env
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
stage() { echo "$(date +%T) $*" >> $L/stage; }
T0=$(date +%s)
budget() { awk -v s=$(( ${LEASE_MIN:-26} * 60 - ($(date +%s) - T0) )) 'BEGIN { printf "%.1f", s / 60 }'; }
# fla's (and other libraries') autotune choices from earlier leases (committed: scripts/device_lease/merge_autotune.sh),
# so that fla's gated-delta kernels need not autotune again (~8 minutes on a fresh machine). Ours (kernel names
# starting with '_') are left out: they change often, and a first call's autotuning is itself under test
if [ -f scripts/device_lease/fla_autotune.tar.xz ]; then
    mkdir -p ~/.triton/cache && xz -dc scripts/device_lease/fla_autotune.tar.xz | tar xf - -C ~/.triton/cache \
        && stage "fla autotune restored"
fi
if [ -d .tcache ] && ls .tcache/tc.tar.xz.* >/dev/null 2>&1; then   # a Triton cache carried from an earlier lease
    mkdir -p ~/.triton/cache && cat .tcache/tc.tar.xz.* | xz -d | tar xf - -C ~/.triton/cache && stage "cache restored"
fi
# two GPUs (the nvidia-h200-x2 kind): the benchmark has the second to itself from the start, the rest runs on the
# first, instead of the benchmark waiting for the rest (the thirteenth and fourteenth leases never reached it)
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && [ -n "${BENCH:-}" ]; then
    ( stage "bench (GPU 1)"
      CUDA_VISIBLE_DEVICES=1 python3 benchmarks/benchmark_chunk.py $BENCH --out $L/bench > $L/bench.log 2>&1
      stage "bench done" ) &
    export CUDA_VISIBLE_DEVICES=0
    BENCH_EARLY=1
fi
if [ -n "${WARM:-}" ]; then
    (
      stage "warm"
      printf '%s\n' $WARM | xargs -P 3 -I{} taskset -c 8-15 python3 -m evals.addition --preset paper --models {} \
          --seeds 0 --steps 8 --eval-samples 4 --jobs 1 --threads 1 --no-progress --out /tmp/warm/{} >> $L/warm.log 2>&1
      stage "warm done"
    ) &
fi
if [ -n "${PRE_BENCH:-}" ]; then
    stage "pre-bench"
    taskset -c 0-7 python3 benchmarks/benchmark_chunk.py $PRE_BENCH --out $L/prebench > $L/prebench.log 2>&1
    stage "pre-bench done"
fi
if [ -n "${ACCURACY:-}" ]; then
    stage "accuracy"
    taskset -c 0-7 python3 benchmarks/accuracy_chunk.py ${ACCURACY#-} --out $L/accuracy > $L/accuracy.log 2>&1
    stage "accuracy done"
fi
if [ -n "${PRE_CMD:-}" ]; then
    stage "pre-cmd"
    eval "$PRE_CMD" > $L/precmd.log 2>&1
    stage "pre-cmd done"
fi
if [ -n "${SIDE_CMD:-}" ]; then
    ( stage "side-cmd"; eval "$SIDE_CMD" > $L/sidecmd.log 2>&1; stage "side-cmd done" ) &
fi
(
  if [ -n "${TESTS:-}" ]; then
      stage "tests"
      eval "taskset -c ${TEST_CORES:-0-3} env PYTEST_WORKERS=${TEST_WORKERS:-4} bash scripts/gpu_tests.sh $L/tests.log $TESTS" > $L/tests.summary 2>&1
  fi
  if [ -n "${PROFILE:-}" ]; then
      stage "profile"
      IFS=';' read -ra runs <<< "$PROFILE"
      for r in "${runs[@]}"; do
          taskset -c 0-3 python3 scripts/device_lease/profile_step.py $r >> $L/profile.log 2>&1
      done
  fi
) &
if [ -n "${PROBE:-}" ]; then
    stage "probe"
    IFS=';' read -ra sets <<< "$PROBE"
    for i in "${!sets[@]}"; do
        mkdir -p $L/probe/$i
        echo "${sets[$i]}" > $L/probe/$i/args
        taskset -c 8-15 python3 -m evals.addition --preset paper --seeds 0 ${sets[$i]} --threads 1 --resume \
            --time-budget $(budget) --no-progress --out $L/probe/$i > $L/probe/$i/log 2>&1 &
    done
fi
if [ -n "${MODELS:-}" ]; then
    stage "paper"
    mkdir -p $L/paper/runs
    [ -n "${RESUME:-}" ] && cp "$RESUME"/*.json $L/paper/runs/ 2>/dev/null
    MPS_ENV=()
    if [ "${PAPER_MPS:-0}" = 1 ]; then
        MPS=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
        if [ -n "$MPS" ]; then
            mkdir -p /tmp/mps /tmp/mps-log
            export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
            # a client must get through it (a CUDA graph too), else the runs go without it
            if "$MPS" -d && timeout 120 python3 -c "import torch; x = torch.ones(8, device='cuda'); g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g): y = x * 2
g.replay(); torch.cuda.synchronize(); assert y.sum().item() == 16"; then
                MPS_ENV=(CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log) && stage "mps on"
            else
                echo quit | "$MPS"; stage "mps: a client failed; the runs go without it"
            fi
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        else
            stage "mps: no nvidia-cuda-mps-control"
        fi
    fi
    env "${MPS_ENV[@]}" taskset -c ${PAPER_CORES:-4-7} python3 -m evals.addition --preset paper --models $MODELS \
        --jobs ${JOBS:-2} --threads 2 --resume --time-budget $(budget) --no-progress --out $L/paper > $L/paper.log 2>&1
fi
wait
if [ -n "${BENCH:-}" ] && [ -z "${BENCH_EARLY:-}" ]; then
    stage "bench"
    python3 benchmarks/benchmark_chunk.py $BENCH --out $L/bench > $L/bench.log 2>&1
fi
stage "done"
