#!/usr/bin/env bash
# Where falcon2's sequential kernels (_fwd_h_delta_col, _bwd_dhu_delta_col) spend their time: Nsight Compute on one
# launch of each at (4, 4096, 16, 128, 128), warp stall reasons per SASS instruction (ncu reads the counters on the
# lease's Firecracker runtime with --clock-control none). Run it from a lease's PRE_CMD, the GPU to itself (it waits for
# nothing): bash scripts/device_lease/extras/ncu_seq.sh. Output: the details pages on stdout, /tmp/L/out/seq.ncu-rep
# and seq_sass.csv.xz (the per-instruction table), which step.sh brings back.
L=/tmp/L
mkdir -p $L/out
ncu --profile-from-start off --clock-control none --kernel-name regex:'_fwd_h_delta_col|_bwd_dhu_delta_col' \
    --launch-count 2 --section LaunchStats --section Occupancy --section WarpStateStats --section SourceCounters \
    -o $L/out/seq python3 scripts/ncu_kernels.py --ops falcon2
ncu --import $L/out/seq.ncu-rep --page source --print-source sass --csv | xz -9 > $L/out/seq_sass.csv.xz
ncu --import $L/out/seq.ncu-rep --page details
