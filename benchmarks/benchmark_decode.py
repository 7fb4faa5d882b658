# -*- coding: utf-8 -*-
"""One-token decode step: fused_recurrent_falcon (every rule) vs fla's fused_recurrent_gated_delta_rule.

Both ops get T = 1 with an initial state and return the final state (what a decoding step does),
under ``torch.no_grad``; they are timed in the same process with ``triton.testing.do_bench`` (GPU
time between events around each call, L2 flushed before each; host overhead shows only where it
exceeds the flush) and, unless ``--no-cudagraph``, with ``triton.testing.do_bench_cudagraph``
(device time of a replayed CUDA graph, no host overhead). Writes
``benchmarks/results/decode.json`` and ``benchmarks/results/decode.md``.

Target (issue 3): falcon/fla <= 1.0 for falcon1/1a/2/2a at B = 64 and <= 1.5 for falcon3/3a.

    python benchmarks/benchmark_decode.py                       # B in {1, 64}, H=16, K=V=128, bf16
    python benchmarks/benchmark_decode.py --batch 1 8 64 --window 4 --rules falcon1 falcon3
    python benchmarks/benchmark_decode.py --sweep 8,1 16,2 32,4 --rules falcon3 falcon3a   # tune (BV, warps)
    python benchmarks/benchmark_decode.py --sweep 8,1,0 8,1,128 8,1,112 --rules falcon3 falcon3a   # + maxnreg

``--sweep`` times the forward kernel under each (BV, num_warps[, maxnreg]) given (the values that
``FLA_FALCON_FWD_CONFIG`` sets; maxnreg 0 = no register cap) and writes ``decode_sweep.json`` /
``decode_sweep.md`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

RULES = ['falcon1', 'falcon2', 'falcon3', 'falcon1a', 'falcon2a', 'falcon3a']
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--batch', type=int, nargs='+', default=[1, 64], help='batch sizes B')
    p.add_argument('--heads', type=int, default=16, help='heads H (= HV)')
    p.add_argument('--head-dim', type=int, default=128, help='K = V')
    p.add_argument('--window', type=int, default=4, help='window of falcon3/falcon3a')
    p.add_argument('--rules', nargs='+', default=RULES, choices=RULES)
    p.add_argument('--dtype', default='bf16', choices=sorted(DTYPES))
    p.add_argument('--warmup', type=int, default=100, help='do_bench warmup (ms)')
    p.add_argument('--rep', type=int, default=500, help='do_bench repetitions (ms)')
    p.add_argument('--sweep', nargs='+', default=None, metavar='BV,WARPS[,MAXNREG]',
                   help='time each forward (BV, num_warps, maxnreg) config instead of the default one')
    p.add_argument('--no-cudagraph', action='store_true', help='skip the CUDA-graph (device-only) timing')
    p.add_argument('--out', default=str(Path(__file__).resolve().parent / 'results'),
                   help='folder for decode.json and decode.md')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit('benchmark_decode.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was timed.')
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from fla_falcon.ops.falcon import FalconState, fused_recurrent_falcon
    from fla_falcon.ops.falcon import fused_recurrent as fr
    from fla_falcon.ops.falcon.utils import rule_info
    # without --sweep: the kernel's choice, or the FLA_FALCON_FWD_CONFIG override if one is set
    env_config = fr.FWD_CONFIG
    configs = [env_config] if args.sweep is None else [tuple(int(x) for x in c.split(',')) for c in args.sweep]

    dev, dtype = 'cuda', DTYPES[args.dtype]
    H, D = args.heads, args.head_dim
    torch.manual_seed(0)

    def bench(fn):
        with torch.no_grad():
            fn()
            t = {'do_bench_us': 1e3 * do_bench(fn, warmup=args.warmup, rep=args.rep)}
            if not args.no_cudagraph:
                t['cudagraph_us'] = 1e3 * do_bench_cudagraph(fn, rep=args.rep)
        return t

    rows = []
    for B in args.batch:
        q = torch.nn.functional.normalize(torch.randn(B, 1, H, D, device=dev), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(torch.randn(B, 1, H, D, device=dev), dim=-1).to(dtype)
        v = torch.randn(B, 1, H, D, device=dev, dtype=dtype)
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, device=dev))
        beta1 = torch.rand(B, 1, H, device=dev, dtype=dtype)
        h0 = torch.randn(B, H, D, D, device=dev) * 0.1

        def fla_step():
            return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta1, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=False)

        t_fla = bench(fla_step)
        rows.append(dict(op='fla.fused_recurrent_gated_delta_rule', rule='gated_delta_rule', B=B, **t_fla))
        print(f"B={B:3d} fla gated delta rule: " + ', '.join(f"{k_}={v_:.2f}" for k_, v_ in t_fla.items()), flush=True)
        for rule in args.rules:
            _, per_column, windowed = rule_info(rule)
            W = args.window if windowed else 1
            beta = torch.rand(B, 1, H, D, device=dev, dtype=dtype) if per_column else beta1
            lam = torch.rand(B, 1, H, device=dev, dtype=dtype) * 0.1
            state = FalconState(
                S=h0.clone(),
                last_k=torch.nn.functional.normalize(torch.randn(B, H, D, device=dev), dim=-1),
                tail_x=torch.nn.functional.normalize(torch.randn(B, H, W - 1, D, device=dev), dim=-1),
                tail_v=torch.randn(B, H, W - 1, D, device=dev),
                count=torch.full((B,), W, device=dev, dtype=torch.int32))

            def falcon_step(beta=beta, lam=lam, state=state, rule=rule, W=W):
                return fused_recurrent_falcon(q, k, v, beta, lam, rule=rule, window=W, initial_state=state,
                                              output_final_state=True)

            for cfg in configs:
                fr.FWD_CONFIG = cfg   # None: the kernel's default choice
                t = bench(falcon_step)
                ratio = {f"ratio_{k_.replace('_us', '')}": t[k_] / t_fla[k_] for k_ in t}
                # what the op launched (falcon3's small decode steps raise the register cap: _fwd_launch)
                used = fr._fwd_launch(D, D, W, rule_info(rule)[0], True, True, B, H)
                rows.append(dict(op='fused_recurrent_falcon', rule=rule, window=W, B=B, BV=used[0],
                                 num_warps=used[1], maxnreg=used[2], **t, **ratio))
                print(f"B={B:3d} {rule:9s} W={W} BV={used[0]} warps={used[1]} maxnreg={used[2]}: "
                      + ', '.join(f"{k_}={v_:.3f}" for k_, v_ in {**t, **ratio}.items()), flush=True)
            fr.FWD_CONFIG = env_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                H=H, K=D, V=D, dtype=args.dtype, window=args.window, T=1,
                note='T=1 decode step with an initial state and output_final_state=True, torch.no_grad; '
                     'do_bench = triton.testing.do_bench (L2 flushed before each call), '
                     'cudagraph = triton.testing.do_bench_cudagraph (device time, no host overhead)')
    stem = 'decode' if args.sweep is None else 'decode_sweep'
    (out / f'{stem}.json').write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    cols = ['do_bench'] + ([] if args.no_cudagraph else ['cudagraph'])
    lines = [f"# One-token decode step ({meta['device']}, H={H}, K=V={D}, {args.dtype}, falcon3/3a window "
             f"{args.window})", '',
             'Time per call in microseconds; ratio = falcon / fla `fused_recurrent_gated_delta_rule` at the same B. '
             'Target: <= 1.0 for falcon1/1a/2/2a at B=64, <= 1.5 for falcon3/3a.', '',
             '| B | op | BV, warps[, maxnreg] | ' + ' | '.join(f'{c} (us) | ratio {c}' for c in cols) + ' |',
             '|---|---|---|' + '---|---|' * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            cells += [f"{r[c + '_us']:.2f}", f"{r['ratio_' + c]:.3f}" if 'ratio_' + c in r else '1']
        name = r['rule'] if r['op'] == 'fused_recurrent_falcon' else 'fla gated delta rule'
        cfg = f"{r['BV']}, {r['num_warps']}" + (f", {r['maxnreg']}" if r.get('maxnreg') else '') if 'BV' in r else ''
        lines.append(f"| {r['B']} | {name} | {cfg} | " + ' | '.join(cells) + ' |')
    (out / f'{stem}.md').write_text('\n'.join(lines) + '\n')
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")


if __name__ == '__main__':
    os.environ.setdefault('TRITON_PRINT_AUTOTUNING', '0')
    main()
