# -*- coding: utf-8 -*-
"""Time one kernel of an op's forward+backward under configs of your choosing, and check that every config gives the
same results: the kernel's launch is captured from a real call (its arguments, grid and the autotuner's key), then
relaunched under each config with its tensors restored before each run, compared with the first config's outputs,
and timed with triton.testing.do_bench (CUDA only; ``--no-time`` on any machine just compares).

It answers "is num_warps=16 faster for this kernel at this shape?" or "is the unrolled variant (a constexpr) faster?"
without touching the autotune lists, and checks each config on the GPU at that shape: Triton's Hopper miscompiles
(SPEC section 7) can depend on the config, and the autotuner only ever runs the winner.

    python benchmarks/sweep_configs.py --op falcon1a --kernel _bwd_dqx \\
        --configs num_warps=8,num_stages=2 num_warps=16,num_stages=2 --out benchmarks/results/sweep

A config is ``name=value`` pairs: num_warps, num_stages, maxnreg, or any constexpr of the kernel (``BV=32``;
booleans as 0 / 1). What a config leaves out is taken from the config the autotuner chose for this launch, not from
Triton's launch defaults (num_stages=3 there: a sweep that left num_stages out once timed a pipelined variant at
three stages against an autotune list of two, 1.82 against 1.19 ms); the table lists every setting launched. Ops
are benchmarks/benchmark_chunk.py's (Falcon rules by rule name). Writes sweep_<op>_<kernel>.json and .md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fla_falcon  # noqa: E402,F401  (first: sets up Triton's interpreter where there is no GPU)
import torch  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

import benchmark_chunk as bc  # noqa: E402

MODULES = ('fla_falcon.ops.falcon.chunk', 'fla_falcon.ops.falcon.chunk_col', 'fla_falcon.ops.falcon.chunk_win')


def find_kernel(name: str) -> Autotuner:
    """The autotuned kernel `name` of the chunk modules."""
    import importlib
    for mod in MODULES:
        obj = getattr(importlib.import_module(mod), name, None)
        if isinstance(obj, Autotuner):
            return obj
    raise SystemExit(f"--kernel {name!r}: no autotuned kernel of that name in {', '.join(MODULES)}")


def parse_config(text: str) -> dict:
    cfg = {}
    for item in text.split(','):
        key, sep, val = item.partition('=')
        if not sep or not key:
            raise SystemExit(f"--configs: {text!r} is not name=value[,name=value...]")
        cfg[key.strip()] = int(val)
    return cfg


def capture(kernel: Autotuner, step) -> dict:
    """Runs step() and records the kernel's first launch in it: positional args, launch kwargs (grid included), a
    copy of every tensor argument as it was before the launch and the config the autotuner chose for it."""
    orig = kernel.run
    seen = {}

    def run(*args, **kwargs):
        first = not seen
        if first:
            seen.update(args=args, kwargs=kwargs,
                        before={i: a.clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
        out = orig(*args, **kwargs)
        if first:
            # this launch's choice (a later launch with another autotune key would overwrite best_config)
            seen['config'] = kernel.best_config
        return out
    kernel.run = run
    try:
        step()
    finally:
        kernel.run = orig
    if not seen:
        raise SystemExit(f"the kernel {kernel.fn.__name__} was not launched by this op")
    return seen


def full_config(seen: dict, cfg: dict) -> dict:
    """cfg completed with the config the autotuner chose for the captured launch (its constexprs and launch options)
    for what cfg leaves out."""
    base = seen['config']
    keep = (*base.kwargs, 'num_warps', 'num_stages', 'maxnreg')
    full = {k: v for k, v in base.all_kwargs().items() if k in keep and v is not None}
    full.update(cfg)
    return full


def launch(kernel: Autotuner, seen: dict, cfg: dict):
    kwargs = {k: v for k, v in seen['kwargs'].items() if k != 'warmup'}
    kwargs.update(cfg)
    kernel.fn.run(*seen['args'], warmup=False, **kwargs)


@torch.no_grad()
def restore(seen: dict):
    for i, before in seen['before'].items():
        seen['args'][i].copy_(before)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same values, NaN where the other has NaN: an output buffer the kernel leaves alone may hold
    NaN garbage (torch.empty), which torch.equal would take for a change."""
    # (shapes first: allclose broadcasts)
    return a.shape == b.shape and (torch.equal(a, b) or (a.is_floating_point()
                                                        and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def sweep(op: str, kernel_name: str, shape, configs, window: int = 4, time: bool = True, device: str = 'cuda',
          ignore=()):
    """Per config: max relative difference of the kernel's outputs from the first config's, and (time) ms. ignore:
    arguments left out of the comparison (scratch whose layout depends on the config, e.g. _bwd_col_gates' rowp,
    one slot per program)."""
    B, T, H, K, V = shape
    kernel = find_kernel(kernel_name)
    unknown = sorted(set(ignore) - set(kernel.fn.arg_names))
    if unknown:
        raise SystemExit(f"--ignore: {kernel_name} has no argument {', '.join(map(repr, unknown))}")
    skip = {kernel.fn.arg_names.index(n) for n in ignore}
    cases, leaves = bc.make_cases(B, T, H, K, V, window, device=device)
    if op not in cases:
        raise SystemExit(f"--op {op!r}: choose from {sorted(cases)}")
    step = bc._fwd_bwd(cases[op])
    step()   # compile and autotune everything once
    return run_configs(kernel, capture(kernel, step), configs, time=time, skip=skip)


def run_configs(kernel: Autotuner, seen: dict, configs, time: bool = True, skip=()):
    """The captured launch ``seen`` (capture) under each config: rows of the max relative difference of its outputs
    from the first config's and (time) ms. skip: argument positions left out of the comparison."""
    rows, ref = [], None
    for cfg in configs:
        cfg = full_config(seen, cfg)
        restore(seen)
        try:
            launch(kernel, seen, cfg)
        except Exception as e:   # noqa: BLE001  (out of resources, compile errors: reported, not fatal)
            rows.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
            continue
        outs = {i: a.clone() for i, a in enumerate(seen['args']) if isinstance(a, torch.Tensor) and i not in skip
                and not _same(a, seen['before'][i])}
        if ref is None:
            ref = outs
        err = max((rel_err(outs[i], ref[i]) for i in ref if i in outs), default=0.0)
        missing = sorted(set(ref) - set(outs))
        row = dict(config=cfg, max_rel_diff=err, outputs=len(outs))
        if missing:
            row['outputs_unchanged'] = [kernel.fn.arg_names[i] for i in missing]
        if time:
            from triton.testing import do_bench
            row['ms'] = do_bench(lambda: launch(kernel, seen, cfg), warmup=25, rep=200)
        rows.append(row)
    restore(seen)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--op', required=True, help='a Falcon rule (or an fla baseline) of benchmarks/benchmark_chunk.py')
    p.add_argument('--kernel', required=True, help='the autotuned kernel to sweep, e.g. _bwd_dqx')
    p.add_argument('--configs', nargs='+', required=True, metavar='CFG',
                   help='configs as name=value[,name=value...]; the first is the reference for the comparison')
    p.add_argument('--shape', default='4,4096,16,128,128', help='B,T,H,K,V (default: %(default)s)')
    p.add_argument('--window', type=int, default=4, help='window of falcon3 / falcon3a (default: %(default)s)')
    p.add_argument('--no-time', action='store_true', help='only compare the configs\' outputs (any machine)')
    p.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'sweep'),
                   help='folder for sweep_<op>_<kernel>.json and .md (default: %(default)s)')
    p.add_argument('--ignore', nargs='+', default=[], metavar='ARG',
                   help="kernel arguments not compared (scratch laid out per config, e.g. _bwd_col_gates' rowp)")
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(','))
    if len(shape) != 5:
        raise SystemExit(f"--shape: need B,T,H,K,V, got {args.shape!r}")
    configs = [parse_config(c) for c in args.configs]
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if not args.no_time and device != 'cuda':
        raise SystemExit('timing needs a CUDA GPU; use --no-time to only compare the configs')
    if device == 'cuda':
        bc.lift_fla_guard()
    rows = sweep(args.op, args.kernel, shape, configs, args.window, not args.no_time, device, args.ignore)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"sweep_{args.op}_{args.kernel.lstrip('_')}")
    meta = dict(op=args.op, kernel=args.kernel, shape=shape, window=args.window, not_compared=args.ignore,
                device=torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)')
    with open(stem + '.json', 'w') as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    lines = [f"# {args.kernel} of {args.op} at (B, T, H, K, V) = {shape}, {meta['device']}", '',
             *([f"Not compared: {', '.join(args.ignore)}.", ''] if args.ignore else []),
             '| config | ms | max relative difference from the first config |', '|---|---:|---:|']
    for r in rows:
        cfg = ', '.join(f"{k}={v}" for k, v in r['config'].items())
        if 'error' in r:
            lines.append(f"| {cfg} | failed: {r['error']} | |")
        else:
            ms = f"{r['ms']:.3f}" if 'ms' in r else '-'
            lines.append(f"| {cfg} | {ms} | {r['max_rel_diff']:.1e} |")
    with open(stem + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
