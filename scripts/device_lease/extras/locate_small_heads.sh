#!/usr/bin/env bash
# Every rule at K = V = 16 and 32 (test_gpu_small_heads' cases), fp32 and bf16, each case in its own process under
# scripts/locate_fault.py: every config of every kernel runs (autotune cache off), and a fault names its kernel and
# config. To join a lease: cp scripts/device_lease/extras/locate_small_heads.sh scripts/device_lease/extra_locate.sh
# (untracked: step.sh runs it beside the chain). One line per case in /tmp/L/extra_locate.log, logs in extra_locate/.
mkdir -p /tmp/L/extra_locate
run1() {
  local rule=$1 K=$2 dt=$3 w=1
  case $rule in falcon3*) w=3;; esac
  timeout 420 python3 scripts/locate_fault.py --rule "$rule" --T 1000 --H 2 --G 2 --K "$K" --V "$K" \
      --cu 0,100,611,1000 --lam on --dtype "$dt" --window "$w" > "/tmp/L/extra_locate/$rule-$K-$dt.log" 2>&1
  echo "$rule $K $dt rc=$?: $(grep -E '^(FAULT|FAILED|OK)' "/tmp/L/extra_locate/$rule-$K-$dt.log" | head -2 | tr '\n' ' ')"
}
export -f run1
for r in falcon3a falcon1 falcon1a falcon2 falcon2a falcon3; do for K in 16 32; do for dt in bf16 fp32; do
  echo "$r $K $dt"; done; done; done | xargs -P 6 -L 1 bash -c 'run1 "$@"' _
echo locate done
