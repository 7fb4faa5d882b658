# -*- coding: utf-8 -*-
"""Which kernel (and which config) raises a CUDA fault: one chunk_falcon case (scripts/run_case.py's options), forward
and backward, with CUDA_LAUNCH_BLOCKING=1 so that a fault surfaces at its own launch, every Triton launch remembered
with its constexprs, warps and stages, and the autotuner's cache off so that every config of every kernel runs.
A fault prints the launch it happened in; without --log only that launch is printed.

    python scripts/locate_fault.py --rule falcon1 --T 1000 --H 2 --G 2 --K 16 --V 16 --cu 0,100,611,1000 --lam on

(Without CUDA_LAUNCH_BLOCKING a fault is reported at the next synchronizing call, often another kernel's autotuner.)
"""

from __future__ import annotations

import os
import sys

os.environ['CUDA_LAUNCH_BLOCKING'] = '1'
os.environ.setdefault('TRITON_CACHE_AUTOTUNING', '0')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_case  # noqa: E402  (imports fla_falcon first: the interpreter where there is no GPU)
from triton.runtime import jit  # noqa: E402

_last = {}


def _describe(fn, kwargs) -> str:
    meta = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int)) and (k.isupper() or k.startswith('num_'))}
    return f"{fn.__name__} {meta}"


def _patch(log: bool):
    orig = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        desc = _describe(self.fn, kwargs)
        if log and _last.get('desc') != desc:
            print('launch', desc, flush=True)
        _last['desc'] = desc
        try:
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        except Exception as e:   # with CUDA_LAUNCH_BLOCKING=1 a fault raises here, at its own launch
            if not warmup and 'illegal' in str(e).lower() and not _last.get('reported'):
                _last['reported'] = True
                print(f'FAULT in {desc}: {type(e).__name__}', flush=True)
            raise
    jit.JITFunction.run = run


def main(argv=None):
    import argparse

    from diag_rows import add_case_args
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p)
    p.add_argument('--log', action='store_true', help='print every new (kernel, constexprs) launch')
    a = p.parse_args(argv)
    _patch(a.log)
    try:
        norms = run_case.run(a)
    except Exception as e:
        print(f'FAILED ({type(e).__name__}); last launch: {_last.get("desc")}', flush=True)
        return 1
    print(f'OK: gradient norms {({k: round(v, 4) for k, v in norms.items()})}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
