# -*- coding: utf-8 -*-
"""Where a chunk_falcon case's error sits: every output and gradient against the fp64 reference (tests/test_chunk.py's
run_both, same inputs and upstream gradients), as fla's ratio, and for the [B, T, ...] tensors the rows with the largest
relative error and the ratio over rows near sequence starts / ends / chunk edges against the rest. An error spread
evenly over the rows points at rounding; one concentrated at boundaries, at a boundary bug (a GPU test that fails by
a small ratio can be either). Also runs the same case in fp32 on the bf16-rounded inputs (--also-fp32).

    python scripts/diag_rows.py --rule falcon3a --T 1000 --H 2 --K 128 --V 128 --window 3 --cu 0,100,611,1000 \\
        --dtype bf16 --lam coupled --also-fp32
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]

import fla_falcon  # noqa: E402,F401  (first: Triton's interpreter where there is no GPU)
import torch  # noqa: E402


def ratio(ref, tri):
    return ((ref - tri).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def row_report(name, ref, tri, T, cu, chunk, window, top):
    """Per-row relative error of a [B, T, ...] tensor; the boundary rows: within `window` + 1 rows of a sequence's
    start or end, or of a chunk edge inside a sequence."""
    err = (ref - tri).flatten(2).pow(2).sum(-1).sqrt()   # [B, T]
    mag = ref.flatten(2).pow(2).sum(-1).sqrt()
    rel = err / mag.clamp_min(mag.mean() * 1e-3)
    starts = cu[:-1] if cu is not None else [0]
    ends = cu[1:] if cu is not None else [T]
    near = torch.zeros(T, dtype=torch.bool)
    for s, e in zip(starts, ends):
        for p in list(range(s, e, chunk)) + [e]:
            near[max(0, p - window - 1):min(T, p + window + 1)] = True
    rows = rel.mean(0)
    out = dict(name=name, ratio=ratio(ref, tri), boundary_rows=int(near.sum()),
               boundary_ratio=ratio(ref[:, near], tri[:, near]) if near.any() else None,
               other_ratio=ratio(ref[:, ~near], tri[:, ~near]) if (~near).any() else None,
               worst_rows=[(int(i), round(float(rows[i]), 4)) for i in rows.topk(min(top, T)).indices])
    return out


def add_case_args(p: argparse.ArgumentParser) -> None:
    """The case's options (tests/test_chunk.py's make_inputs and run_both), shared with scripts/replay_launches.py."""
    p.add_argument('--rule', default='falcon3a')
    p.add_argument('--B', type=int, default=1)
    p.add_argument('--T', type=int, default=1000)
    p.add_argument('--H', type=int, default=2)
    p.add_argument('--G', type=int, default=1, help='value heads per key head')
    p.add_argument('--K', type=int, default=128)
    p.add_argument('--V', type=int, default=128)
    p.add_argument('--window', type=int, default=1)
    p.add_argument('--cu', default=None, help='cu_seqlens, comma-separated (B must be 1)')
    p.add_argument('--dtype', choices=('bf16', 'fp32'), default='bf16')
    p.add_argument('--lam', choices=('off', 'on', 'coupled'), default='coupled')
    p.add_argument('--no-shift', action='store_true')
    p.add_argument('--chunk', type=int, default=64)
    p.add_argument('--band-form', choices=('fold', 'gather'), default=None,
                   help="falcon3a's band in the backward (chunk.BAND_FORM; default: the package's)")


def case_cu_seqlens(a, device):
    """--cu as a tensor on `device` (None without it)."""
    return torch.tensor([int(x) for x in a.cu.split(',')], device=device) if a.cu else None


def case_dtype(a):
    return torch.bfloat16 if a.dtype == 'bf16' else torch.float32


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p)
    p.add_argument('--top', type=int, default=8, help='worst rows listed per tensor')
    p.add_argument('--also-fp32', action='store_true', help='the same case in fp32 on the bf16-rounded inputs')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--out', default=None, help='write the report as JSON here')
    a = p.parse_args(argv)
    from test_chunk import make_inputs, run_both
    if a.band_form:
        import fla_falcon.ops.falcon.chunk as ch
        ch.BAND_FORM = a.band_form
    cu_t = case_cu_seqlens(a, a.device)
    cu = cu_t.tolist() if cu_t is not None else None
    inputs = make_inputs(a.rule, a.B, a.T, a.H, a.G, a.K, a.V, a.lam, True, a.device, cu_seqlens=cu_t,
                         window=a.window)
    runs = [a.dtype] + (['fp32-of-bf16'] if a.also_fp32 and a.dtype == 'bf16' else [])
    report = dict(args=vars(a), runs={})
    for run in runs:
        xs = inputs
        if run == 'fp32-of-bf16':   # the kernels in fp32 on inputs rounded to bf16: rounding inside vs a bug
            xs = tuple(t.to(torch.bfloat16).float() if torch.is_tensor(t) else t for t in inputs)
        dtype = torch.bfloat16 if run == 'bf16' else torch.float32
        pairs = run_both(a.rule, *xs, dtype, lam_mode=a.lam, shift=not a.no_shift, cu_seqlens=cu_t,
                         chunk_size=a.chunk, window=a.window)
        rows = []
        for name, ref, tri in pairs:
            ref, tri = ref.cpu(), tri.cpu()
            if ref.dim() >= 3 and ref.shape[:2] == (a.B, a.T):
                rows.append(row_report(name, ref, tri, a.T, cu, a.chunk, a.window, a.top))
            else:
                rows.append(dict(name=name, ratio=ratio(ref, tri)))
        report['runs'][run] = rows
        print(f"== {a.rule} {run}: ratio (boundary rows / other rows), worst rows")
        for r in rows:
            extra = ''
            if 'worst_rows' in r:
                extra = f"  ({r['boundary_ratio']:.4f} over {r['boundary_rows']} rows / {r['other_ratio']:.4f})  " \
                        f"{r['worst_rows']}"
            print(f"  {r['name']:10s} {r['ratio']:.4f}{extra}")
    if a.out:
        with open(a.out, 'w') as f:
            json.dump(report, f, indent=1)


if __name__ == '__main__':
    main()
