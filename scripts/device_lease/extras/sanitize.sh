#!/usr/bin/env bash
# compute-sanitizer (memcheck) on the two faults the fourteenth lease left open, with the autotune cache off so that
# every config of every kernel runs under it (a config that reads or writes out of bounds only while it is being
# benchmarked is what the first-call hypothesis needs). To join a lease from its next call:
#   cp scripts/device_lease/extras/sanitize.sh scripts/device_lease/extra_sanitize.sh   (untracked: step.sh runs it)
# Logs in /tmp/L/sweep (packed with the results). Minutes each: the sanitizer slows every launch.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=0
mkdir -p /tmp/L/sweep
CSB=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null) || { echo "no compute-sanitizer"; exit 1; }
CS="$CSB --tool memcheck --print-limit 20 --target-processes all"
# falcon3a's bf16 dq case (window 3, gather band), two calls in one process
timeout 900 $CS --log-file /tmp/L/sweep/memcheck_falcon3a.log python3 scripts/run_case.py --rule falcon3a --T 1000 \
    --H 2 --K 128 --V 128 --window 3 --cu 0,100,611,1000 --band-form gather --repeat 2 \
    > /tmp/L/sweep/memcheck_falcon3a.out 2>&1
tail -n 5 /tmp/L/sweep/memcheck_falcon3a.log
# GatedDeltaNet at 16-wide heads in fp32 (the illegal memory access inside an autotuner's benchmark)
timeout 900 $CS --log-file /tmp/L/sweep/memcheck_gdn16.%p.log python3 -m pytest -x -q tests/test_addition.py \
    -k 'small_heads and gdn' > /tmp/L/sweep/memcheck_gdn16.out 2>&1
tail -n 5 /tmp/L/sweep/memcheck_gdn16.*.log
