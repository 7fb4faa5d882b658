"""EXPERIMENT (branch f2a-half): falcon2a's fwd+bwd device time with G and o32 in fp32 (main) against fp16,
same process, (4, 4096, 16, 128, 128) bf16, autotune lists pruned to the forty-third lease's H100 choices."""
import sys
import time

import torch

sys.path.insert(0, 'benchmarks')
import fla_falcon.ops.falcon.chunk as C  # noqa: E402
from benchmark_chunk import bench, make_cases, profile_kernels  # noqa: E402


def prune(kern, **want):
    keep = [c for c in kern.configs if all((c.kwargs.get(k) if k in c.kwargs else getattr(c, k, None)) == v
                                           for k, v in want.items())]
    assert keep, (kern, want)
    kern.configs = keep[:1]


prune(C._prep_fwd, num_warps=8, num_stages=2)
prune(C._fwd_h, BV=32, num_warps=4, num_stages=3)
prune(C._bwd_dhu, BV=32, num_warps=4, num_stages=3)
prune(C._fwd_o_col, num_warps=4, num_stages=2)
prune(C._bwd_dv_local_col, num_warps=4, num_stages=2)
prune(C._bwd_col_dqk, num_warps=8, num_stages=2)
C._bwd_col_gates.configs = C._bwd_col_gates.configs[:1]
cases, leaves = make_cases(4, 4096, 16, 128, 128, 4)
fn = cases['falcon2a']
res = {}
for half in (False, True, False, True):
    C._COL_HALF = half
    t0 = time.time()
    o = fn()
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    grads = [t.grad.clone() if t.grad is not None else None for t in leaves]
    for t in leaves:
        t.grad = None
    ms = bench(fn, leaves, True)
    print(f"half={half}: fwd+bwd do_bench {ms:.3f} ms (first call {time.time() - t0:.1f} s)", flush=True)
    if half not in res:
        res[half] = (o.detach().float(), grads)
for i, (a, b) in enumerate(zip([res[False][0]] + res[False][1], [res[True][0]] + res[True][1])):
    if a is not None and b is not None:
        a, b = a.float(), b.float()
        print(f"  tensor {i}: rel diff fp16 vs fp32 {((a - b).norm() / a.norm()).item():.2e}", flush=True)
for half in (False, True):
    C._COL_HALF = half
    rows = profile_kernels(fn, leaves)
    print(f"half={half}: " + ", ".join(f"{n[:20]} {us:.0f}" for n, us in rows[:8]), flush=True)
