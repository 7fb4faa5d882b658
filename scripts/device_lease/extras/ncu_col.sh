#!/usr/bin/env bash
# Where falcon2's substitution steps and falcon2a's per-column kernels spend their time: Nsight Compute on one launch
# each (ncu reads the counters on the Firecracker runtime; --clock-control none), then the config sweeps of falcon2a's
# per-column kernels. Waits for the chain's end (the GPU to itself) and needs its Triton cache (autotune choices
# included: TRITON_CACHE_AUTOTUNING), so that ncu's run compiles and autotunes nothing under the profiler. To join a
# lease: cp scripts/device_lease/extras/ncu_col.sh scripts/device_lease/extra_ncu.sh (untracked: step.sh runs it).
# Output: /tmp/L/extra_ncu.log (the details pages), /tmp/L/out/ (the report and its per-instruction SASS table, which
# step.sh brings back), /tmp/L/sweep/.
L=/tmp/L
until grep -qE "^[0-9:]+ done$" $L/stage 2>/dev/null; do sleep 5; done
mkdir -p $L/out
NCU="ncu --profile-from-start off --clock-control none"
$NCU --kernel-name regex:_fwd_h_delta_col --launch-count 1 --section WarpStateStats --section SourceCounters \
    -o $L/out/fwdh python3 scripts/ncu_kernels.py --ops falcon2
ncu --import $L/out/fwdh.ncu-rep --page source --print-source sass --csv | xz -9 > $L/out/fwdh_sass.csv.xz
ncu --import $L/out/fwdh.ncu-rep --page details
$NCU --kernel-name regex:'_bwd_col_gates|_bwd_col_dqk|_fwd_o_col' --launch-count 3 --section LaunchStats \
    --section Occupancy --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 scripts/ncu_kernels.py --ops falcon2a
S="python3 benchmarks/sweep_configs.py --op falcon2a --out $L/sweep"
$S --kernel _bwd_col_gates --configs num_warps=4,num_stages=2 num_warps=4,num_stages=1 num_warps=4,num_stages=3
$S --kernel _fwd_o_col --configs num_warps=4,num_stages=2 num_warps=8,num_stages=2 num_warps=4,num_stages=3 \
    num_warps=8,num_stages=3
$S --kernel _bwd_dv_local_col --configs num_warps=4,num_stages=2 num_warps=8,num_stages=2 num_warps=4,num_stages=3 \
    num_warps=8,num_stages=3
