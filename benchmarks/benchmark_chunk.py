# -*- coding: utf-8 -*-
"""Time chunk_falcon against fla's chunk kernels (same process, triton.testing.do_bench), bf16, CUDA only.

Baselines: chunk_gated_delta_rule (target for falcon1), chunk_simple_gla (target for falcon1a,
falcon2a, falcon3a), chunk_delta_rule, and chunk_gla (per-channel decay, the fla kernel closest to
falcon2a's per-column decay; shown for reference). fla 0.6.0 refuses its gated chunk backward
(chunk_bwd_dqkwg with a gate) on Hopper with Triton 3.4-3.7.0 because of a miscompilation (fla issue
#640); to time those baselines this script lifts that guard in its own process only (the
miscompilation affects their gradients' values, not their speed) and says so in the table.

A rule with a chunk forward only (``chunk_falcon.forward_only_rules``; none now) is timed forward only.

Writes benchmarks/results/chunk.json, chunk.md and chunk.png (each rule's forward+backward time over its
baseline's, per shape, both measures, against the target). With --cudagraph the targets are judged on the device
time (forward+backward replayed from a CUDA graph): do_bench's includes the host's. `--report-only` rewrites chunk.md
and chunk.png from chunk.json, `--plot-only` chunk.png alone, on any machine.

Our ops run with chunk_falcon's default, the backward recomputing the forward's intermediates (gates, WY factors,
chunk-start states) as fla's chunk ops do; `--disable-recompute` times them with those kept from the forward
instead (faster backward, more memory). The table has each op's memory too: what its forward holds until the
backward (per layer of a model) and its peak over one forward+backward, both over its inputs.
"""

from __future__ import annotations

import argparse
import functools
import faulthandler
import json
import os
import sys
import time

import fla_falcon  # noqa: F401  (before fla)
import torch
import torch.nn.functional as F

import fla_falcon.ops.falcon.chunk as _chunk
from fla_falcon.ops.falcon.chunk import SUPPORTED_RULES, chunk_falcon
from fla_falcon.ops.falcon.fused_recurrent import fused_recurrent_falcon

DEFAULT_STATE_PROGRAMS = _chunk.STATE_PROGRAMS   # (before --state-programs sets it)

TARGETS = {'falcon1': ('chunk_gated_delta_rule', 1.0), 'falcon2': ('chunk_gated_delta_rule', 1.5),
           'falcon3': ('chunk_gated_delta_rule', 2.0),
           'falcon1a': ('chunk_simple_gla', 1.0),
           'falcon2a': ('chunk_simple_gla', 1.2), 'falcon3a': ('chunk_simple_gla', 1.3),
           **{f'falcon3a-{form}': ('chunk_simple_gla', 1.3) for form in ('fold', 'gather')}}
DEFAULT_SHAPES = ['4,4096,16,128,128', '1,16384,16,128,128']
# rules with a chunk forward only (none now; falcon3 was until its backward came): timed forward only
FORWARD_ONLY = tuple(getattr(chunk_falcon, 'forward_only_rules', ()))
RULES = tuple(SUPPORTED_RULES) + FORWARD_ONLY


def lift_fla_guard() -> bool:
    """Lets fla's gated chunk backward run on Triton 3.4-3.7 Hopper (fla #640 guard); True if lifted."""
    import fla.ops.common.chunk_o as chunk_o
    guarded = chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1
    if guarded:
        chunk_o.TRITON_ABOVE_3_7_1 = True
    return bool(guarded)


# falcon3a's band in the backward as the package has it (fla_falcon.ops.falcon.chunk.BAND_FORM); the other forms are
# timed as the ops falcon3a-<form>
BAND_FORM = _chunk.BAND_FORM


def make_cases(B, T, H, K, V, window, recurrent=(), device='cuda', disable_recompute=False):
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    dev, dt = device, torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=dt)
    k = F.normalize(torch.randn(B, T, H, K, device=dev, dtype=torch.float32), dim=-1).to(dt)
    v = torch.randn(B, T, H, V, device=dev, dtype=dt)
    beta = torch.rand(B, T, H, device=dev, dtype=dt)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32))
    lam = torch.rand(B, T, H, device=dev, dtype=dt)
    beta_col = torch.rand(B, T, H, V, device=dev, dtype=dt)
    # per-channel log-decay of GLA: the fla kernel with the cost structure of falcon2a's per-column decay
    g_col = F.logsigmoid(torch.randn(B, T, H, K, device=dev, dtype=torch.float32))
    leaves = [q, k, v, beta, g, lam, beta_col, g_col]
    for t in leaves:
        t.requires_grad_()
    cases = {
        'chunk_gated_delta_rule': lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0],
        'chunk_simple_gla': lambda: chunk_simple_gla(q, k, v, g)[0],
        'chunk_delta_rule': lambda: chunk_delta_rule(q, k, v, beta)[0],
        'chunk_gla': lambda: chunk_gla(q, k, v, g_col)[0],
    }

    def falcon(rule, b, w, band=BAND_FORM):
        # falcon3a's band form is read when its backward runs: each case runs its forward and backward before the
        # next one starts, so setting it here holds for both
        _chunk.BAND_FORM = band
        return chunk_falcon(q, k, v, b, lam, rule=rule, window=w, disable_recompute=disable_recompute)[0]

    for rule in RULES:
        b = beta_col if rule.startswith('falcon2') else beta
        w = window if rule.startswith('falcon3') else 1
        cases[rule] = functools.partial(falcon, rule, b, w)
    if 'falcon3a' in RULES:   # falcon3a with its band's backward in the other forms
        for other in _chunk.BAND_FORMS:
            if other != BAND_FORM:
                cases[f'falcon3a-{other}'] = functools.partial(falcon, 'falcon3a', beta, window, other)
    # the token-by-token kernel of the same rule, for the chunk kernels' speed-up over it (issue 5)
    for rule in recurrent:
        b = beta_col if rule.startswith('falcon2') else beta
        w = window if rule.startswith('falcon3') else 1
        cases[f'fused_recurrent:{rule}'] = (lambda rule=rule, b=b, w=w:
                                            fused_recurrent_falcon(q, k, v, b, lam, rule=rule, window=w)[0])
    return cases, leaves


def _fwd_bwd(fn):
    """fn's output and its backward with a fixed random cotangent (drawn on the first call)."""
    do = None

    def run():
        nonlocal do
        o = fn()
        if do is None:
            do = torch.randn_like(o)
        o.backward(do)
    return run


def bench(fn, leaves, backward):
    from triton.testing import do_bench

    if not backward:
        def run():
            with torch.no_grad():
                fn()
    else:
        step = _fwd_bwd(fn)

        def run():
            step()
            for t in leaves:
                t.grad = None
    run()
    return do_bench(run, warmup=25, rep=100)


def memory_mb(fn, leaves) -> tuple[float, float]:
    """(held, peak) in MB over one forward+backward, against what is allocated before it (inputs, earlier cases'
    leftovers): held, what the forward leaves allocated until the backward (its output and the tensors it saves for
    the backward: what a model holds per layer); peak, the most allocated at any time (the backward's scratch and
    any recomputed intermediates included)."""
    step = _fwd_bwd(fn)
    step()   # the cotangent drawn, kernels compiled
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    o.backward(torch.ones_like(o))
    del o
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    return held / 2 ** 20, peak / 2 ** 20


def bench_graph(fn, leaves) -> float | None:
    """Forward+backward time with the host out of the loop: calls unrolled into one CUDA graph and replayed
    (triton.testing.do_bench_cudagraph). do_bench also counts host time where an op's launches take longer than
    its kernels (fla's ops, at these shapes); this is the device's share. None if capture fails."""
    from triton.testing import do_bench_cudagraph

    run = _fwd_bwd(fn)
    run()
    for t in leaves:
        t.grad = None
    try:
        return do_bench_cudagraph(run, rep=50, grad_to_none=leaves)
    except Exception as e:   # noqa: BLE001  (an op that cannot be captured: say so, time the rest)
        print(f"    CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return None


def profile_kernels(fn, leaves, iters: int = 5) -> list[tuple[str, float]]:
    """[(kernel name, device microseconds per forward+backward)], largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    do = None

    def step():
        nonlocal do
        o = fn()
        if do is None:   # once, outside the profile: its fill kernel is not the op's (21 us at 4 x 4096 x 16 x 128)
            do = torch.ones_like(o)
        o.backward(do)
        for t in leaves:
            t.grad = None
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--shapes', nargs='+', default=DEFAULT_SHAPES, help='B,T,H,K,V (default: %(default)s)')
    parser.add_argument('--window', type=int, default=4, help='window B of falcon3a (default: %(default)s)')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results'),
                        help='output folder for chunk.json and chunk.md (default: %(default)s)')
    parser.add_argument('--ops', nargs='+', default=None, metavar='OP',
                        help='time only these ops (fla baselines by function name, falcon rules by rule name)')
    parser.add_argument('--recurrent', nargs='*', default=None, metavar='RULE',
                        help='also time fused_recurrent_falcon for these rules (bare: every chunk rule) at the first '
                             'shape, to report the chunk kernels\' speed-up over the token-by-token kernel')
    parser.add_argument('--profile', nargs='*', default=None, metavar='OP',
                        help='also write chunk_profile.md: per-kernel device time of forward+backward for these ops '
                             '(given bare: the ops timed, see --ops) at the first shape, or at every shape with '
                             '--profile-all-shapes')
    parser.add_argument('--profile-all-shapes', action='store_true',
                        help='--profile at every shape (one section per shape in chunk_profile.md)')
    parser.add_argument('--cudagraph', action='store_true',
                        help='also time forward+backward replayed from a CUDA graph (the device time, without the '
                             'host time that do_bench includes), with ratios in a column of their own')
    parser.add_argument('--disable-recompute', action='store_true',
                        help="run our ops with disable_recompute=True: the forward's intermediates kept for the "
                             "backward instead of recomputed there (recomputing is chunk_falcon's default, as fla's)")
    parser.add_argument('--overlap', choices=('auto', 'on', 'off'), default='auto',
                        help="chunk.py's OVERLAP_RECOMPUTE: the recomputed state pass on a second CUDA stream beside "
                             "the state gradients always (on), never (off), or where the state pass has few programs "
                             "(auto, the default: falcon1, falcon2, falcon2a and falcon3 at few sequences; falcon2 never "
                             "where its state gradients read the states)")
    parser.add_argument('--state-programs', type=int, default=None, metavar='N',
                        help=f"set chunk.py's STATE_PROGRAMS (default {DEFAULT_STATE_PROGRAMS}): the rules without "
                             "a delta term split the key dimension of their sequential state kernels down to 32-wide "
                             "blocks while they have fewer programs than N, and --overlap auto forks falcon1a / "
                             "falcon3a's recomputed state pass below N")
    parser.add_argument('--watchdog', type=float, default=0, metavar='S',
                        help='print every thread\'s Python stack to stderr every S seconds (0: off), to see where a '
                             'long first call (compilation, autotuning) spends its time')
    parser.add_argument('--plot-only', action='store_true',
                        help='only redraw chunk.png from the chunk.json in --out (no GPU needed)')
    parser.add_argument('--report-only', action='store_true',
                        help='only rewrite chunk.md and chunk.png from the chunk.json in --out (no GPU needed)')
    args = parser.parse_args(argv)
    if args.state_programs is not None and args.state_programs < 1:
        parser.error('--state-programs must be at least 1')
    if args.plot_only or args.report_only:
        with open(os.path.join(args.out, 'chunk.json')) as f:
            data = json.load(f)
        if args.report_only:
            print(render_report(data['meta'], data['results'], args.out))
        else:
            print(plot_ratios(data['results'], data['meta'], os.path.join(args.out, 'chunk.png')))
        return
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    if not torch.cuda.is_available():
        sys.exit('benchmark_chunk.py needs a CUDA GPU (the Triton kernels are timed on the device); none found.')
    lifted = lift_fla_guard()
    _chunk.OVERLAP_RECOMPUTE = {'auto': 'auto', 'on': True, 'off': False}[args.overlap]
    if args.state_programs is not None:
        _chunk.STATE_PROGRAMS = args.state_programs
    os.makedirs(args.out, exist_ok=True)
    results = []
    for spec in args.shapes:
        B, T, H, K, V = (int(x) for x in spec.split(','))
        recurrent = (args.recurrent or SUPPORTED_RULES) if args.recurrent is not None and spec == args.shapes[0] else ()
        cases, leaves = make_cases(B, T, H, K, V, args.window, recurrent, disable_recompute=args.disable_recompute)
        row = {'shape': [B, T, H, K, V], 'ms': {}, 'ratio': {}}
        results.append(row)
        for name, fn in cases.items():
            # --recurrent names its own rules: --ops does not filter those out
            if args.ops and name not in args.ops and not name.startswith('fused_recurrent:'):
                continue
            # the first call of an op compiles and autotunes its kernels (minutes on a fresh machine): say so in the log
            t0 = time.perf_counter()
            print(f"{spec:>22} {name:>24} compiling/autotuning and timing ...", flush=True)
            fwd_only = name in FORWARD_ONLY
            row['ms'][name] = {'fwd': bench(fn, leaves, False),
                               'fwd+bwd': None if fwd_only else bench(fn, leaves, True)}
            if args.cudagraph and not fwd_only:
                row['ms'][name]['fwd+bwd graph'] = bench_graph(fn, leaves)
            if not fwd_only:
                row['ms'][name]['held MB'], row['ms'][name]['peak MB'] = memory_mb(fn, leaves)
            print(f"{spec:>22} {name:>24} done in {time.perf_counter() - t0:.0f} s", flush=True)
            print(f"{spec:>22} {name:>24} fwd {row['ms'][name]['fwd']:8.3f} ms  "
                  f"fwd+bwd {_ms(row['ms'][name]['fwd+bwd'])} ms", flush=True)
            row['ratio'] = {rule: {m: row['ms'][rule][m] / row['ms'][base][m]
                                   for m in ('fwd', 'fwd+bwd', 'fwd+bwd graph')
                                   if row['ms'][rule].get(m) and row['ms'][base].get(m)}
                            for rule, (base, _) in TARGETS.items() if rule in row['ms'] and base in row['ms']}
            # how many times faster the chunk kernel is than the token-by-token one
            row['speedup_over_recurrent'] = {
                r: {m: row['ms'][f'fused_recurrent:{r}'][m] / row['ms'][r][m] for m in ('fwd', 'fwd+bwd')
                    if row['ms'][r].get(m) and row['ms'][f'fused_recurrent:{r}'].get(m)}
                for r in RULES if r in row['ms'] and f'fused_recurrent:{r}' in row['ms']}
            # after every case: a run stopped part way (time limit, compile failure) keeps what it measured
            write_report(args, results, lifted, done=False)
        if args.profile is not None and (spec == args.shapes[0] or args.profile_all_shapes):
            if spec == args.shapes[0]:
                prof_lines = []
            prof_lines += [f"# Kernel times, forward+backward, (B, T, H, K, V) = {spec} (us per call, torch.profiler)",
                           '']
            # bare --profile: the ops timed (--ops, or all); a bare --profile beside --ops used to profile
            # fla's baselines too, which compiles and autotunes them (8 minutes on a fresh machine)
            wanted = args.profile or args.ops
            for name, fn in cases.items():
                if (wanted and name not in wanted) or name in FORWARD_ONLY:   # (profiles forward+backward)
                    continue
                rows = profile_kernels(fn, leaves)
                prof_lines += [f"## {name}: {sum(t for _, t in rows):.0f} us", '', '| kernel | us |', '|---|---:|']
                prof_lines += [f"| {k_[:90]} | {t:.1f} |" for k_, t in rows[:25]] + ['']
            with open(os.path.join(args.out, 'chunk_profile.md'), 'w') as f:
                f.write('\n'.join(prof_lines))
            print('\n'.join(prof_lines), flush=True)
        del cases, leaves
        torch.cuda.empty_cache()
    print(write_report(args, results, lifted, done=True))


def write_report(args, results, lifted: bool, done: bool) -> str:
    """chunk.json and chunk.md from the rows measured so far."""
    meta = {'device': torch.cuda.get_device_name(), 'torch': torch.__version__,
            'triton': __import__('triton').__version__, 'dtype': 'bfloat16', 'window_falcon3a': args.window,
            'fla_guard_640_lifted': lifted, 'lam': 'on (uncoupled)', 'complete': done,
            'falcon_intermediates': 'kept' if getattr(args, 'disable_recompute', False) else 'recomputed',
            'recompute_streams': {'on': 2, 'off': 1}.get(getattr(args, 'overlap', 'auto'), 'auto'),
            'state_programs': _chunk.STATE_PROGRAMS}
    with open(os.path.join(args.out, 'chunk.json'), 'w') as f:
        json.dump({'meta': meta, 'results': results}, f, indent=2)
    return render_report(meta, results, args.out)


def render_report(meta, results, out) -> str:
    """chunk.md and chunk.png from chunk.json's content. With CUDA-graph times, the targets are judged on them (the
    device time); do_bench's times include the host's."""
    lines = ['# chunk_falcon vs fla chunk kernels (bf16, ms, triton.testing.do_bench)', '',
             f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, "
             f"falcon3a window {meta['window_falcon3a']}.", '',
             '![forward+backward time over the baseline, per shape](chunk.png)', '']
    if not meta.get('complete', True):
        lines += ['**Partial: the run had not finished when this was written.**', '']
    # (runs before chunk_falcon recomputed by default kept every intermediate: no key)
    if meta.get('falcon_intermediates', 'kept') == 'kept':
        lines += ["Our ops kept the forward's intermediates (gates, WY factors, chunk-start states) for the backward "
                  "(`disable_recompute=True`); fla's baselines recompute theirs in the backward.", '']
    else:
        # (runs before the 'auto' default record 1 or 2)
        streams = {1: ", on one CUDA stream.",
                   2: ", the state pass on a second CUDA stream beside the state gradients (every rule but falcon2).",
                   'auto': ", the state pass on a second CUDA stream beside the state gradients where it has few "
                           "programs (chunk.py's OVERLAP_RECOMPUTE = 'auto': some rules at few sequences), else on "
                           "one."}[meta.get('recompute_streams', 1)]
        lines += ["Our ops recomputed the forward's intermediates in the backward (chunk_falcon's default), as fla's "
                  "baselines do" + streams, '']
    # (runs before the fifty-fourth session's had 128, and did not record it)
    if meta.get('state_programs', 128) != DEFAULT_STATE_PROGRAMS:
        lines += [f"chunk.py's STATE_PROGRAMS was {meta.get('state_programs', 128)} (default {DEFAULT_STATE_PROGRAMS}): "
                  "the key split of the state kernels and the second stream's threshold.", '']
    if meta.get('fla_guard_640_lifted'):
        lines += ["fla's #640 guard (gated chunk backward refused on Hopper with Triton 3.4-3.7) was lifted in "
                  "this process to time chunk_gated_delta_rule / chunk_simple_gla backward; their gradients "
                  "may be wrong there, their timings are what is compared.", '']
    for row in results:
        graph = any('fwd+bwd graph' in t for t in row['ms'].values())
        mem = any('peak MB' in t for t in row['ms'].values())
        gcol = lambda x: (f" {x:.3f} |" if x else ' - |') if graph else ''  # noqa: E731
        mcol = lambda t: ''.join(f" {t[m]:.0f} |" if t.get(m) is not None else ' - |'  # noqa: E731
                                 for m in ('held MB', 'peak MB')) if mem else ''
        lines += [f"## (B, T, H, K, V) = {tuple(row['shape'])}", '',
                  '| op | fwd | fwd+bwd |' + (' fwd+bwd, CUDA graph |' if graph else '')
                  + (' MB held from fwd to bwd | peak MB of fwd+bwd |' if mem else ''),
                  '|---|---:|---:|' + ('---:|' if graph else '') + ('---:|---:|' if mem else '')]
        for name, t in row['ms'].items():
            lines.append(f"| {name} | {t['fwd']:.3f} | {_ms(t.get('fwd+bwd'))} |" + gcol(t.get('fwd+bwd graph'))
                         + mcol(t))
        judged = 'CUDA graph' if graph else 'fwd+bwd'
        lines += ['', '| rule | baseline | fwd ratio | fwd+bwd ratio |' + (' fwd+bwd ratio, CUDA graph |' if graph
                                                                          else '') + f" target ({judged}) |",
                  '|---|---|---:|---:|' + ('---:|' if graph else '') + '---:|']
        for rule, r in row['ratio'].items():
            base, target = TARGETS[rule]
            fb = r.get('fwd+bwd')
            basis = r.get('fwd+bwd graph') if graph else fb
            ok = 'forward only' if fb is None else '-' if basis is None else 'met' if basis <= target else 'missed'
            g = (f" {r['fwd+bwd graph']:.2f}x |" if r.get('fwd+bwd graph') else ' - |') if graph else ''
            lines.append(f"| {rule} | {base} | {r['fwd']:.2f}x | {_x(fb)} |" + g + f" <= {target}x ({ok}) |")
        if row.get('speedup_over_recurrent'):
            lines += ['', '| rule | chunk speed-up over fused_recurrent_falcon, fwd | fwd+bwd |'
                      + (' fwd+bwd, CUDA graph |' if graph else ''), '|---|---:|---:|' + ('---:|' if graph else '')]
            for r, sp in row['speedup_over_recurrent'].items():
                rec, chk = row['ms'][f'fused_recurrent:{r}'].get('fwd+bwd graph'), row['ms'][r].get('fwd+bwd graph')
                g = (f" {_x(rec / chk if rec and chk else None, 1)} |") if graph else ''
                lines.append(f"| {r} | {sp['fwd']:.1f}x | {_x(sp.get('fwd+bwd'), 1)} |" + g)
        lines.append('')
    with open(os.path.join(out, 'chunk.md'), 'w') as f:
        f.write('\n'.join(lines))
    plot_ratios(results, meta, os.path.join(out, 'chunk.png'))
    return '\n'.join(lines)


def _ms(t) -> str:
    return '-' if t is None else f"{t:.3f}"


def _x(r, digits: int = 2) -> str:
    return '-' if r is None else f"{r:.{digits}f}x"


def plot_ratios(results, meta, path) -> str:
    """chunk.png: per shape, each rule's forward+backward time over its baseline's (do_bench, and the CUDA-graph
    device time where measured), with the issue's target as a marker; below 1 is faster than the baseline."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rows = [r for r in results if r['ratio']]
    if not rows:
        return f"{path}: no ratios to plot"
    n_rules = max(len(row['ratio']) for row in rows)
    fig, axes = plt.subplots(1, len(rows), figsize=(max(5.5, 1.1 * n_rules) * len(rows), 4.8), squeeze=False,
                             sharey=True)
    for ax, row in zip(axes[0], rows):
        rules = [r for r in row['ratio'] if row['ratio'][r].get('fwd+bwd')]   # (forward-only rules: table only)
        xs = range(len(rules))
        measures = [('fwd+bwd', 'do_bench (host time included)', 'tab:blue'),
                    ('fwd+bwd graph', 'device time (CUDA graph)', 'tab:orange')]
        measures = [m for m in measures if any(row['ratio'][r].get(m[0]) for r in rules)]
        width = 0.8 / len(measures)
        for i, (key, label, color) in enumerate(measures):
            vals = [row['ratio'][r].get(key) or 0 for r in rules]
            pos = [x - 0.4 + width * (i + 0.5) for x in xs]
            ax.bar(pos, vals, width, label=label, color=color)
            for x, val in zip(pos, vals):
                if val:
                    ax.text(x, val, f"{val:.2f}", ha='center', va='bottom', fontsize=7)
        ax.scatter(list(xs), [TARGETS[r][1] for r in rules], marker='_', s=900, color='black', zorder=3,
                   label='target')
        ax.axhline(1.0, color='grey', lw=0.8, ls=':')
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r}\n/ {TARGETS[r][0].replace('chunk_', '')}" for r in rules], fontsize=8,
                           rotation=30, ha='right', rotation_mode='anchor')
        ax.set_title(f"(B, T, H, K, V) = {tuple(row['shape'])}", fontsize=10)
        ax.grid(axis='y', alpha=0.3)
    axes[0][0].set_ylabel('forward+backward time / baseline')
    axes[0][0].set_ylim(0, axes[0][0].get_ylim()[1] * 1.08)   # room for the bars' labels
    # the legend beside the panels, where it covers no bar
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc='upper right', ncol=len(labels))
    fig.suptitle(f"chunk_falcon vs fla, bf16, {meta.get('device', '')}, Triton {meta.get('triton', '')}", fontsize=11,
                 x=0.01, ha='left')
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


if __name__ == '__main__':
    main()
