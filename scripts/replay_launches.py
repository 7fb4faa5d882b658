# -*- coding: utf-8 -*-
"""Which Triton kernel goes wrong on the GPU: every chunk_falcon kernel launch of a case (forward and backward),
recorded on the GPU with its arguments as they were before and after the launch, then replayed launch by launch in
Triton's interpreter on the CPU from the same "before" arguments, and the outputs compared.

The interpreter runs the kernels' source as written (numpy, no compiler), so a launch whose outputs differ from the
GPU's by more than rounding points at a miscompile, a race, or a launch that depends on the GPU's scheduling. Since the
replay starts from the GPU's own inputs of each launch, an error does not spread into later launches' comparisons. An
autotuned kernel is recorded from the autotuner's entry, so a kernel whose benchmarking runs change a buffer it also
reads (a missing ``restore_value``) shows too. A read of memory no launch wrote is not caught here (the replay
reads the same bytes): fill the allocator with NaN for that.

    # on the GPU machine: run the case twice (the first run autotunes), every autotuned launch again under each
    # config on guarded copies (configs.json: how far each config's outputs are from the recorded run's, and the
    # canaries it hit), and keep the launches of --keep for a replay elsewhere (launches_keep.pt)
    python scripts/replay_launches.py --rule falcon3a --T 1000 --H 2 --K 128 --V 128 --window 3 \\
        --cu 0,100,611,1000 --dtype bf16 --all-configs --out /tmp/L/replay
    # then on a machine whose Triton interpreter runs these kernels (3.6's does not: it fails on `range` over a
    # loaded scalar; CI's Triton does)
    python scripts/replay_launches.py --mode replay --file launches_keep.pt --out /tmp/L/replay

``--mode both`` does both in one process tree where the interpreter can. ``--only _bwd_dqx`` replays only that
kernel (the interpreter takes seconds to minutes a launch at K = V = 128). The case's inputs are tests/test_chunk.py's
``make_inputs`` (the same as scripts/diag_rows.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]

import fla_falcon  # noqa: E402,F401  (first: Triton's interpreter where there is no GPU or TRITON_INTERPRET=1)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_rows import add_case_args, case_cu_seqlens as _cu, case_dtype as _dtype  # noqa: E402

MODULES = ('fla_falcon.ops.falcon.chunk', 'fla_falcon.ops.falcon.chunk_col', 'fla_falcon.ops.falcon.chunk_win')


def _kernels():
    """name -> (autotuner or None, jit function) of the chunk modules' kernels."""
    import importlib
    from triton.runtime.autotuner import Autotuner
    out = {}
    for mod in MODULES:
        m = importlib.import_module(mod)
        for name, obj in vars(m).items():
            if isinstance(obj, Autotuner):
                out[name] = (obj, obj.fn)
            elif type(obj).__name__ in ('JITFunction', 'InterpretedFunction') and name not in out:
                out[name] = (None, obj)
    return out


def _grid(grid, fn, args, kwargs):
    if callable(grid):
        meta = dict(zip(fn.arg_names, args), **kwargs)
        grid = grid(meta)
    return tuple(int(g) for g in grid)


def record(case_args, path: str, repeat: int = 1, all_configs: bool = False) -> list:
    """Runs the case `repeat` times and records every launch of the chunk kernels: (name, grid, constexpr and scalar
    arguments, the autotuner's chosen config, the tensors' addresses, the tensors before and after), saved to `path`
    with each run's end-to-end ratios against the reference: `launches` of the last run, `first` of the first. The
    first run autotunes, the later ones reuse its configs: a first run that fails where a later one passes points at
    the autotuner's benchmarking. all_configs: each autotuned launch of the last run again under every config of its
    autotuner, from the same "before" tensors (per_config)."""
    from test_chunk import make_inputs, run_both
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    launches = []
    kernels = _kernels()
    patched = []
    last_run = [repeat == 1]

    def snap(args):
        return [a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]

    def wrap(name, tuner, fn):
        target = tuner if tuner is not None else fn
        orig = target.run

        def run(*args, **kwargs):
            before = snap(args)
            ret = orig(*args, **kwargs)
            if device == 'cuda':
                torch.cuda.synchronize()
            cfg = tuner.best_config.all_kwargs() if tuner is not None else {}
            kw = {k: v for k, v in kwargs.items() if k not in ('grid', 'warmup')}
            L = dict(name=name, grid=_grid(kwargs['grid'], fn, args, dict(kw, **cfg)), kwargs=kw, config=cfg,
                     ptrs=[a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args],
                     before=before, after=[a.detach().cpu().clone() if isinstance(a, torch.Tensor) else None
                                           for a in args])
            if all_configs and tuner is not None and last_run[0]:
                L['per_config'] = []
                for c in tuner.configs:
                    ck = c.all_kwargs()
                    guarded = [_guarded(b, device) if isinstance(b, torch.Tensor) else (None, b) for b in before]
                    xs = [x for _, x in guarded]
                    try:
                        fn.run(*xs, grid=_grid(kwargs['grid'], fn, args, dict(kw, **ck)), warmup=False, **kw, **ck)
                        if device == 'cuda':
                            torch.cuda.synchronize()
                        oob = {fn.arg_names[j]: n for j, (g, x) in enumerate(guarded)
                               if g is not None and (n := _guard_hits(g, x))}
                        L['per_config'].append(dict(config=_short(ck), oob=oob, after=[
                            x.cpu() if isinstance(x, torch.Tensor) else None for x in xs]))
                    except Exception as e:   # noqa: BLE001  (out of resources: reported)
                        L['per_config'].append(dict(config=_short(ck), error=f"{type(e).__name__}: {e}"[:200]))
            launches.append(L)
            return ret
        target.run = run
        patched.append((target, orig))

    for name, (tuner, fn) in kernels.items():
        wrap(name, tuner, fn)
    runs = []
    try:
        inputs = make_inputs(case_args.rule, case_args.B, case_args.T, case_args.H, case_args.G, case_args.K,
                             case_args.V, case_args.lam, True, device, cu_seqlens=_cu(case_args, device),
                             window=case_args.window)
        first = []
        for r in range(repeat):
            last_run[0] = r == repeat - 1
            launches = [] if r else first
            pairs = run_both(case_args.rule, *inputs, _dtype(case_args), lam_mode=case_args.lam,
                             shift=not case_args.no_shift, cu_seqlens=_cu(case_args, device),
                             chunk_size=case_args.chunk, window=case_args.window,
                             # each kernel once per call: a recomputed intermediate would reuse the freed blocks of
                             # the forward's, which the between-launch check reads as tensors changed in between
                             disable_recompute=True)
            runs.append({name: ((ref - tri).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()
                         for name, ref, tri in pairs})
            print('end-to-end ratios:', {k: round(v, 4) for k, v in runs[-1].items()}, flush=True)
    finally:
        for target, orig in patched:
            target.run = orig
    torch.save(dict(launches=launches, first=first if repeat > 1 else [], ratios=runs, args=vars(case_args)), path)
    return launches


GUARD = 1 << 16   # elements of canary on each side of a guarded copy


def _guarded(t: torch.Tensor, device):
    """A copy of t inside a larger buffer whose GUARD elements on each side hold a canary (NaN for floats, a fixed
    value for int32/int64): a launch that writes outside its argument changes them. Other tensors (non-contiguous,
    other dtypes) are copied as they are (unguarded)."""
    if not t.is_contiguous() or not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64)):
        return None, t.to(device, copy=True)
    base = torch.empty(t.numel() + 2 * GUARD, dtype=t.dtype, device=device)
    if t.dtype.is_floating_point:
        base.fill_(float('nan'))
    else:
        base.fill_(-12345)
    x = base[GUARD:GUARD + t.numel()].view(t.shape)
    x.copy_(t)
    return base, x


def _guard_hits(base: torch.Tensor, x: torch.Tensor) -> int:
    """Canary elements a launch changed around the guarded copy x."""
    edge = torch.cat([base[:GUARD], base[GUARD + x.numel():]])
    if edge.dtype.is_floating_point:
        return int((~torch.isnan(edge)).sum())
    return int((edge != -12345).sum())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (a buffer's unwritten part is whatever the allocator left, NaN too)."""
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _short(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if v is not None and k not in ('num_ctas', 'ir_override')}


def _rows_err(gpu: torch.Tensor, cpu: torch.Tensor, top: int):
    """Relative error of the whole tensor and of its worst rows (first dimension after merging the leading
    [B, T] or [chunks] dims: the row is the tensor's first dimension whose size is not 1)."""
    g, c = gpu.double(), cpu.double()
    both = torch.isnan(g) & torch.isnan(c)   # unwritten on both sides
    g, c = g.masked_fill(both, 0), c.masked_fill(both, 0)
    x = torch.where(g == c, 0., g - c)   # the same bits (garbage an unwritten part holds, inf too) count as equal
    c = torch.where(torch.isfinite(c), c, 0.)   # magnitudes from the finite entries
    den = c.norm().item()
    rel = x.norm().item() / den if den > 0 else x.norm().item()
    lead = x.reshape(-1, *x.shape[2:]) if x.dim() > 2 and x.shape[0] == 1 else x
    if lead.dim() < 2:
        return rel, []
    err = lead.flatten(1).norm(dim=1)
    mag = c.reshape(lead.shape).flatten(1).norm(dim=1)
    r = err / mag.clamp_min(mag.mean().item() * 1e-3 + 1e-30)
    idx = r.topk(min(top, r.numel())).indices
    return rel, [(int(i), round(float(r[i]), 4)) for i in idx if r[i] > 0]


def _config_rows(L: dict, fn, ref: list, top: int) -> list:
    """Each per-config run of launch L against `ref` (the tensors after the launch to compare with): per changed
    argument, the relative difference and the worst rows, and the canaries the config hit."""
    rows = []
    for pc in L.get('per_config', []):
        if 'error' in pc:
            rows.append(dict(config=pc['config'], error=pc['error']))
            continue
        errs = {fn.arg_names[j]: _rows_err(x, r, top) for j, (b, r, x) in enumerate(zip(L['before'], ref, pc['after']))
                if isinstance(x, torch.Tensor) and not (_same(b, r) and _same(b, x))}
        rows.append(dict(config=pc['config'], oob=pc.get('oob', {}),
                         worst=max((e[0] for e in errs.values()), default=0.0),
                         outputs={k: dict(rel=e[0], worst_rows=e[1]) for k, e in errs.items()}))
    return rows


def _print_config_rows(rows: list) -> None:
    for r in rows:
        if 'error' in r:
            print(f"       config {r['config']}: {r['error']}", flush=True)
            continue
        bad = {k: (f"{v['rel']:.1e}", v['worst_rows'][:3]) for k, v in r['outputs'].items() if v['rel'] > 1e-3}
        oob = f" WRITES OUTSIDE {r['oob']}" if r['oob'] else ''
        print(f"       config {r['config']}: differs by {r['worst']:.2e} {bad if bad else ''}{oob}", flush=True)


def between_launches(launches: list, kernels: dict, top: int = 6) -> list:
    """Tensors changed between launches: each tensor argument (by address, shape and dtype) at a launch's start
    against itself at the end of the previous launch that had it. Outside the launches only the host code and the
    autotuner's benchmark runs touch them (a memory block freed and reused with the same shape shows too)."""
    seen, out = {}, []
    for i, L in enumerate(launches):
        fn = kernels[L['name']][1]
        for j, (ptr, b, a) in enumerate(zip(L['ptrs'], L['before'], L['after'])):
            if ptr is None:
                continue
            key = (ptr, tuple(b.shape), b.dtype)
            if key in seen:
                i0, where0, t0 = seen[key]
                if not _same(t0, b):
                    rel, rows = _rows_err(b, t0, top)
                    out.append(dict(tensor=f"{L['name']}.{fn.arg_names[j]}", written_by=where0, launches=(i0, i),
                                    rel=rel, worst_rows=rows))
            seen[key] = (i, f"{L['name']}.{fn.arg_names[j]}", a)
    return out


def analyze(rec: dict, top: int = 6) -> dict:
    """On the recording machine (no interpreter needed): in each recorded run, the tensors changed between launches
    (between_launches); in the last run, each autotuned launch's runs under the other configs against the recorded
    run (per changed argument, relative difference and worst rows) and the canaries each config hit."""
    kernels = _kernels()
    report = dict(between={}, configs=[])
    for run, launches in (('first', rec.get('first', [])), ('last', rec['launches'])):
        if not launches:
            continue
        changed = between_launches(launches, kernels, top)
        report['between'][run] = changed
        print(f"{run} run: {len(launches)} launches; tensors changed between launches: {len(changed)}", flush=True)
        for c in changed:
            print(f"       {c['tensor']} (after {c['written_by']}, launches {c['launches']}): {c['rel']:.2e} "
                  f"{c['worst_rows'][:4]}", flush=True)
    for i, L in enumerate(rec['launches']):
        if not L.get('per_config'):
            continue
        fn = kernels[L['name']][1]
        rows = _config_rows(L, fn, L['after'], top)
        report['configs'].append(dict(launch=i, name=L['name'], config=_short(L['config']), per_config=rows))
        print(f"[{i:2d}] {L['name']:22s} recorded with {_short(L['config'])}", flush=True)
        _print_config_rows(rows)
    return report


def keep(rec: dict, names: list, path: str) -> int:
    """The launches of `names` alone, for a replay elsewhere (the lease's files come back 16 MiB at most), from the
    first run (the one that autotuned) where there were several: their "after" tensors only where the launch changed
    them, no per-config runs. Returns the file's size in bytes."""
    small = []
    for L in rec.get('first') or rec['launches']:
        if L['name'] not in names:
            continue
        after = [g if isinstance(g, torch.Tensor) and not _same(b, g) else None
                 for b, g in zip(L['before'], L['after'])]
        small.append({k: v for k, v in L.items() if k not in ('after', 'per_config')} | dict(after=after))
    torch.save(dict(rec, launches=small, first=[]), path)
    return os.path.getsize(path)


def replay(path: str, only: list, top: int = 6) -> list:
    """Replays each recorded launch under the interpreter from its "before" tensors; compares with the GPU's
    "after" tensors: per changed tensor argument, the relative error and the worst rows."""
    rec = torch.load(path, weights_only=False)
    kernels = _kernels()
    report = []
    for i, L in enumerate(rec['launches']):
        if only and L['name'] not in only:
            continue
        tuner, fn = kernels[L['name']]
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in L['before']]
        fn[L['grid']](*args, **L['kwargs'], **L['config'])
        outs = []
        for j, (b, g, c) in enumerate(zip(L['before'], L['after'], args)):
            if not isinstance(c, torch.Tensor):
                continue
            g = b if g is None else g   # a kept file stores only what the launch changed
            if _same(b, g) and _same(b, c):
                continue
            rel, rows = _rows_err(g, c, top)
            outs.append(dict(arg=fn.arg_names[j], rel=rel, worst_rows=rows,
                             changed_on=('gpu ' if not _same(b, g) else '') + ('cpu' if not _same(b, c) else '')))
        per_config = _config_rows(L, fn, args, top)   # each config on the GPU against the interpreter
        report.append(dict(launch=i, name=L['name'], grid=L['grid'], config=_short(L['config']), outputs=outs,
                           per_config=per_config))
        worst = max((o['rel'] for o in outs), default=0.0)
        print(f"[{i:2d}] {L['name']:22s} grid={L['grid']} {_short(L['config'])} worst rel {worst:.2e}", flush=True)
        for o in outs:
            print(f"       {o['arg']:10s} {o['rel']:.2e}  ({o['changed_on'].strip()})  {o['worst_rows']}", flush=True)
        _print_config_rows(per_config)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p)
    p.add_argument('--repeat', type=int, default=2,
                   help='runs of the case in the recording process; the last is recorded (default: %(default)s)')
    p.add_argument('--all-configs', action='store_true',
                   help="also run every autotuned launch under each of its autotuner's configs (on the GPU)")
    p.add_argument('--only', default='', help='comma-separated kernel names to replay (default: all)')
    p.add_argument('--mode', choices=('both', 'record', 'replay'), default='record',
                   help='record: run the case here (GPU), compare the configs there, keep --keep launches for a '
                        'replay elsewhere; replay: under the interpreter (Triton >= 3.7: 3.6\'s interpreter cannot '
                        'run these kernels); both: record, then replay in a subprocess (default: %(default)s)')
    p.add_argument('--keep', default='_bwd_dqx,_win_bwd_band',
                   help='kernels whose launches go into launches_keep.pt (default: %(default)s)')
    p.add_argument('--file', default='launches.pt', help='the recording replay reads, in --out (default: %(default)s)')
    p.add_argument('--out', default='replay', help='folder for the recordings and reports (default: %(default)s)')
    a = p.parse_args(argv)
    if a.band_form:
        import fla_falcon.ops.falcon.chunk as ch
        ch.BAND_FORM = a.band_form
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, 'launches.pt')
    if a.mode in ('both', 'record'):
        if not torch.cuda.is_available():   # the interpreter against itself: a check of this script
            print('no GPU: recording under the interpreter', flush=True)
        launches = record(a, path, a.repeat, a.all_configs)
        print(f"recorded {len(launches)} launches: {', '.join(L['name'] for L in launches)}", flush=True)
        rec = torch.load(path, weights_only=False)
        report = analyze(rec)
        with open(os.path.join(a.out, 'configs.json'), 'w') as f:
            json.dump(dict(case=vars(a), ratios=rec['ratios'], **report), f, indent=1)
        size = keep(rec, [s for s in a.keep.split(',') if s], os.path.join(a.out, 'launches_keep.pt'))
        print(f"launches_keep.pt: {size / 2**20:.1f} MiB", flush=True)
        if a.mode == 'both':
            env = dict(os.environ, TRITON_INTERPRET='1', CUDA_VISIBLE_DEVICES='')
            cmd = [sys.executable, os.path.abspath(__file__), '--mode', 'replay', '--out', a.out, '--only', a.only]
            return subprocess.call(cmd, env=env)
        return 0
    path = os.path.join(a.out, a.file)
    rec_args = torch.load(path, weights_only=False)['args']
    print('case:', {k: rec_args[k] for k in ('rule', 'T', 'H', 'K', 'V', 'window', 'cu', 'dtype', 'lam', 'no_shift',
                                            'chunk', 'band_form')}, flush=True)
    for n, r in enumerate(torch.load(path, weights_only=False)['ratios']):
        print(f"run {n}, end-to-end ratios: {({k: round(v, 4) for k, v in r.items()})}", flush=True)
    report = replay(path, [s for s in a.only.split(',') if s])
    with open(os.path.join(a.out, a.file.replace('.pt', '') + '_replay.json'), 'w') as f:
        json.dump(dict(case=rec_args, launches=report), f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
