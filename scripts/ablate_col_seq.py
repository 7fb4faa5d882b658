# -*- coding: utf-8 -*-
"""Where falcon2's sequential kernels spend their time: each part of _fwd_h_delta_col / _bwd_dhu_delta_col
taken out in turn (a diagnostic; the ablated variants compute wrong results on purpose).

Each variant is a copy of fla_falcon/ops/falcon/chunk_col.py with one part of the per-block chain removed by a
text edit, loaded as its own module (its kernels compile anew, one config: BV = 32, 4 warps, the one the H200
runs) and put in place of chunk_col's falcon2 functions for chunk_falcon. The device time of the two
sequential kernels per forward+backward comes from torch.profiler (benchmark_chunk.profile_kernels); a part's cost
is the base time minus the variant's (the parts are on one dependent chain, so they need not add up).

    python scripts/ablate_col_seq.py --shape 4,4096,16,128,128 --out benchmarks/results/ablate_col_seq
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmarks'))

import fla_falcon  # noqa: E402,F401  (before fla)
import torch  # noqa: E402

import fla_falcon.ops.falcon.chunk_col as chunk_col  # noqa: E402
from benchmark_chunk import make_cases, profile_kernels  # noqa: E402

ONE_CONFIG = "CONFIGS_COL_H = [triton.Config({'BV': 32}, num_warps=4, num_stages=2)]\n"
# (old text, new text) per variant; every old text must occur exactly once in chunk_col.py
VARIANTS = {
    'base': [],
    # forward: the substitution's steps (row i's reduction over the block's rows and the tile updates)
    'fwd: no substitution steps': [
        ("    return tl.where(m_i, b_ri, b_r), tl.where(m_i, b_eta * b_ri, b_w)",
         "    return b_r, b_w")],
    'fwd: no step reduction': [
        ("    b_ri = b_y - tl.sum(b_mi[:, None] * b_w, 0)[None, :]\n",
         "    b_ri = b_y + 0 * tl.sum(b_mi, 0)\n")],
    'fwd: no X S_ref read': [
        ("b_y = b_v - tl.dot(b_x, b_h.to(b_x.dtype)) * tl.exp(tl.minimum(b_Gx - b_Gr[None, :], 0.))",
         "b_y = b_v")],
    'fwd: no block state write': [
        ("b_h = b_h * tl.exp(b_Gl - b_Gr)[None, :] + tl.dot(tl.trans(b_x), b_w.to(b_x.dtype))",
         "b_h = b_h * tl.exp(b_Gl - b_Gr)[None, :]")],
    # backward
    'bwd: no substitution steps': [
        ("    b_dr = tl.where(m_j, b_dr - tl.sum(b_mj[:, None] * b_z, 0)[None, :], b_dr)\n", "\n"),
        ("    return b_dr, tl.where(m_j, b_eta * b_dr, b_z)",
         "    return b_dr, b_z")],
    'bwd: no X e read': [
        ("b_dr = tl.load(du + p_tv, mask=m_tv, other=0) + tl.dot(b_x, b_e.to(b_x.dtype)) * tl.exp(\n"
         "                    b_Gl[None, :] - b_G)",
         "b_dr = tl.load(du + p_tv, mask=m_tv, other=0)")],
    'bwd: no block state write': [
        ("b_e = b_e * tl.exp(b_Gl - b_Gr)[None, :] - tl.dot(tl.trans(b_x), b_z.to(b_x.dtype))",
         "b_e = b_e * tl.exp(b_Gl - b_Gr)[None, :]")],
    'bwd: no Q^T do': [
        ("b_dq += tl.dot(tl.trans(b_q), (b_do * tl.exp(b_G) * scale).to(b_q.dtype))", "b_dq += 0.")],
}
KERNELS = ('_fwd_h_delta_col', '_bwd_dhu_delta_col')


def variant_source(name, edits, src):
    """chunk_col.py's source with its autotune list cut to ONE_CONFIG and a variant's edits made. An old text must
    occur once; runs of whitespace in it match any whitespace, so that re-indented code still matches."""
    start = src.index('CONFIGS_COL_H = [')
    depth, end = 0, start + len('CONFIGS_COL_H = ')
    for end in range(end, len(src)):   # the list's closing bracket
        depth += {'[': 1, ']': -1}.get(src[end], 0)
        if depth == 0:
            break
    src = src[:start] + ONE_CONFIG + src[end + 2:]
    for old, new in edits:
        # the old text's own leading / trailing whitespace stays in the source (and comes off the new text)
        lead, trail = old[:len(old) - len(old.lstrip())], old[len(old.rstrip()):]
        new = new[len(lead):] if new.startswith(lead) else new
        new = new[:len(new) - len(trail)] if trail and new.endswith(trail) else new
        pattern = r'\s+'.join(re.escape(part) for part in old.split())
        found = re.findall(pattern, src)
        if len(found) != 1:
            raise SystemExit(f"variant {name!r}: {old[:60]!r} occurs {len(found)} times in chunk_col.py")
        src = re.sub(pattern, lambda _: new, src)
    return src


def variant_module(name, edits, folder):
    src = variant_source(name, edits, open(chunk_col.__file__).read())
    mod_name = 'ablate_' + ''.join(c if c.isalnum() else '_' for c in name)
    path = os.path.join(folder, mod_name + '.py')
    with open(path, 'w') as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--shape', default='4,4096,16,128,128', help='B,T,H,K,V (default: %(default)s)')
    p.add_argument('--variants', nargs='+', default=list(VARIANTS), help='(default: all)')
    p.add_argument('--out', default='benchmarks/results/ablate_col_seq', help='folder for ablate.{json,md}')
    args = p.parse_args(argv)
    B, T, H, K, V = map(int, args.shape.split(','))
    cases, leaves = make_cases(B, T, H, K, V, 4)
    fn = cases['falcon2']
    fwd, bwd = chunk_col.chunk_fwd_falcon2, chunk_col.chunk_bwd_falcon2
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.variants:
            mod = variant_module(name, VARIANTS[name], folder)
            chunk_col.chunk_fwd_falcon2, chunk_col.chunk_bwd_falcon2 = mod.chunk_fwd_falcon2, mod.chunk_bwd_falcon2
            try:
                prof = dict(profile_kernels(fn, leaves))
            except Exception as e:   # noqa: BLE001  (a variant that does not compile: say so, run the rest)
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            finally:
                chunk_col.chunk_fwd_falcon2, chunk_col.chunk_bwd_falcon2 = fwd, bwd
            us = {k: sum(v for key, v in prof.items() if key.startswith(k)) for k in KERNELS}
            rows.append(dict(variant=name, **us))
            print(name, us, flush=True)
    os.makedirs(args.out, exist_ok=True)
    base = rows[0]
    with open(os.path.join(args.out, 'ablate.json'), 'w') as f:
        json.dump(dict(shape=args.shape, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    lines = [f"# falcon2's sequential kernels with parts taken out, (B, T, H, K, V) = ({args.shape}), "
             f"{torch.cuda.get_device_name()}", "",
             "| variant | " + " | ".join(f"{k} us" for k in KERNELS) + " | " +
             " | ".join(f"{k} saved" for k in KERNELS) + " |",
             "|---|" + "---:|" * (2 * len(KERNELS))]
    for r in rows:
        lines.append(f"| {r['variant']} | " + " | ".join(f"{r[k]:.0f}" for k in KERNELS) + " | " +
                     " | ".join(f"{base[k] - r[k]:.0f}" for k in KERNELS) + " |")
    with open(os.path.join(args.out, 'ablate.md'), 'w') as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == '__main__':
    main()
