# -*- coding: utf-8 -*-
"""One chunk_falcon case, forward and backward, without the reference: a target for compute-sanitizer (bad memory
accesses, reads of unwritten memory, races) or Nsight Compute. The inputs are tests/test_chunk.py's make_inputs, the
loss reaches every output (the outputs and the final state, as in run_both), the case options are diag_rows.py's.

    compute-sanitizer --tool memcheck python scripts/run_case.py --rule falcon3a --T 1000 --H 2 --K 128 --V 128 \\
        --window 3 --cu 0,100,611,1000 --band-form gather
    compute-sanitizer --tool initcheck python scripts/run_case.py ...

The first call autotunes (under the sanitizer, every config of every kernel is run, not only the chosen one).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]

import fla_falcon  # noqa: E402,F401  (first: Triton's interpreter where there is no GPU)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_rows import add_case_args, case_cu_seqlens, case_dtype  # noqa: E402


def run(a) -> dict:
    """The case's forward and backward once; returns the gradients' norms (a check that it ran)."""
    from test_chunk import make_inputs

    from fla_falcon.ops import chunk_falcon
    from fla_falcon.ops.falcon.utils import FalconState
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    dtype = case_dtype(a)
    cu = case_cu_seqlens(a, device)
    q, k, v, beta, lam, state = make_inputs(a.rule, a.B, a.T, a.H, a.G, a.K, a.V, a.lam, True, device,
                                            cu_seqlens=cu, window=a.window)
    xs = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (q, k, v, beta, lam)]
    st = FalconState(*(t.detach().float().requires_grad_() for t in state[:4]), state.count)
    o, fs = chunk_falcon(*xs, initial_state=st, chunk_size=a.chunk, rule=a.rule, lam_coupled=a.lam == 'coupled',
                         shift=not a.no_shift, output_final_state=True, cu_seqlens=cu, window=a.window)
    g = torch.Generator(device='cpu').manual_seed(1)
    loss = (o.float() * torch.randn(o.shape, generator=g).to(device)).sum() + (fs.S * torch.randn(
        fs.S.shape, generator=g).to(device)).sum() + fs.last_k.sum() + fs.tail_x.sum() + fs.tail_v.sum()
    loss.backward()
    if device == 'cuda':
        torch.cuda.synchronize()
    names = ('q', 'k', 'v', 'beta', 'lam', 'S0', 'last_k', 'tail_x', 'tail_v')
    return {n: t.grad.float().norm().item() for n, t in zip(names, xs + list(st[:4]))
            if t is not None and t.grad is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p)
    p.add_argument('--repeat', type=int, default=1, help='calls in this process (default: %(default)s)')
    a = p.parse_args(argv)
    if a.band_form:
        import fla_falcon.ops.falcon.chunk as ch
        ch.BAND_FORM = a.band_form
    for i in range(a.repeat):
        norms = run(a)
        print(f"call {i}: gradient norms {({k: round(v, 4) for k, v in norms.items()})}", flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
