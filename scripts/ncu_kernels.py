# -*- coding: utf-8 -*-
"""Run chosen ops' forward+backward once between cudaProfilerStart and cudaProfilerStop, after a warm-up that
compiles and autotunes them, so that Nsight Compute (ncu) reads the hardware counters of the timed launches only.

The benchmark's profile (benchmarks/benchmark_chunk.py --profile) says how long each kernel takes; ncu says why:
registers, occupancy, where warps stall, memory and tensor-core throughput. It needs a machine whose runtime lets
ncu read the counters (our H200 lease: Firecracker; KINDS.md in the device library), e.g.

    ncu --profile-from-start off --clock-control none --kernel-name regex:'_bwd_dqx|_bwd_gates' \\
        --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \\
        python3 scripts/ncu_kernels.py --ops falcon1a falcon3a falcon1

Ops are those of benchmarks/benchmark_chunk.py (fla's baselines by function name, Falcon rules by rule name).
``--config KERNEL:name=value,...`` runs one of our autotuned kernels under that config alone (a config on trial that
the autotuner does not try; names as in benchmarks/sweep_configs.py --configs), e.g.
``--config _bwd_col_dqk:KSPLIT=1,REG_DS=1,num_warps=8,num_stages=1``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmarks'))

import torch  # noqa: E402

import benchmark_chunk as bc  # noqa: E402


def _fix_config(text: str):
    """--config KERNEL:name=value,...: (the autotuned kernel, its triton.Config)."""
    import triton
    from sweep_configs import find_kernel, parse_config
    name, sep, spec = text.partition(':')
    if not sep or not spec:
        raise SystemExit(f"--config: {text!r} is not KERNEL:name=value[,name=value...]")
    kernel, cfg = find_kernel(name), parse_config(spec)
    opts = {key: cfg.pop(key) for key in ('num_warps', 'num_stages', 'maxnreg') if key in cfg}
    return kernel, triton.Config(cfg, **opts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--ops', nargs='+', required=True, help='ops to run (see benchmarks/benchmark_chunk.py --ops)')
    p.add_argument('--shape', default='4,4096,16,128,128', help='B,T,H,K,V (default: %(default)s)')
    p.add_argument('--window', type=int, default=4, help='window B of falcon3 / falcon3a (default: %(default)s)')
    p.add_argument('--config', action='append', default=[], metavar='KERNEL:NAME=VALUE,...',
                   help='run KERNEL (one of ours, autotuned) under this config only; repeatable')
    args = p.parse_args(argv)
    fixed = [_fix_config(text) for text in args.config]   # bad input fails before the GPU check
    if not torch.cuda.is_available():
        sys.exit('scripts/ncu_kernels.py needs a CUDA GPU; none found.')
    for kernel, cfg in fixed:
        kernel.configs = [cfg]
        kernel.cache.clear()
    bc.lift_fla_guard()
    B, T, H, K, V = (int(x) for x in args.shape.split(','))
    cases, leaves = bc.make_cases(B, T, H, K, V, args.window)
    unknown = [op for op in args.ops if op not in cases]
    if unknown:
        raise SystemExit(f"unknown --ops {unknown}; choose from {sorted(cases)}")
    steps = {op: bc._fwd_bwd(cases[op]) for op in args.ops}
    for op, step in steps.items():   # compile and autotune outside the profiled range
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for op, step in steps.items():
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ran {', '.join(args.ops)} at {args.shape} between cudaProfilerStart and cudaProfilerStop")
    return 0


if __name__ == '__main__':
    sys.exit(main())
