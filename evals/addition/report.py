# -*- coding: utf-8 -*-
"""Aggregation of run records: JSON, Markdown table (mean ± std over seeds), plot of accuracy vs length."""

from __future__ import annotations

import json
import math
from pathlib import Path

PAPER_OOD = {'falcon3a': 87.2, 'falcon1a': 85.9, 'mamba2': 75.2, 'transformer': 65.8}   # SPEC section 6


def _mean_std(xs):
    if not xs:
        return float('nan'), float('nan')
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def summarize(runs: list[dict], train_lengths, test_lengths) -> list[dict]:
    """One row per model (in first-seen order): status, params, seeds, mean/std (in percent) of the
    in-distribution accuracy (mean over train lengths), the mean OOD accuracy (mean over test lengths) and
    the accuracy at the longest test length; per-length means for the plot."""
    order, by_model = [], {}
    for r in runs:
        if r['model'] not in by_model:
            order.append(r['model'])
            by_model[r['model']] = []
        by_model[r['model']].append(r)
    tr = range(train_lengths[0], train_lengths[1] + 1)
    te = range(test_lengths[0], test_lengths[1] + 1)
    rows = []
    for name in order:
        ok = [r for r in by_model[name] if r.get('status') == 'ok']
        bad = [r for r in by_model[name] if r.get('status') != 'ok']
        row = dict(model=name, seeds=[r['seed'] for r in ok], n_ok=len(ok), n_bad=len(bad),
                   status='ok' if ok else (bad[0].get('status', 'failed') if bad else 'missing'),
                   reason='; '.join(sorted({r.get('reason', '') for r in bad})) or None)
        if ok:
            acc = [{int(k): 100 * v for k, v in r['accuracy'].items()} for r in ok]
            row['params'] = ok[0]['params']
            row['route'] = ok[0].get('route')
            row['train_time_s'] = _mean_std([r['train_time_s'] for r in ok])[0]
            row['id'] = _mean_std([sum(a[n] for n in tr) / len(tr) for a in acc])
            row['ood'] = _mean_std([sum(a[n] for n in te) / len(te) for a in acc])
            row['longest'] = _mean_std([a[te[-1]] for a in acc])
            lengths = sorted(acc[0])
            row['per_length'] = {n: _mean_std([a[n] for a in acc]) for n in lengths}
        rows.append(row)
    return rows


def _fmt(ms):
    m, s = ms
    return f"{m:.1f} ± {s:.1f}"


def markdown_table(rows, train_lengths, test_lengths, title: str = '') -> str:
    lines = [f"### {title}" if title else '',
             f"Exact-match accuracy (%), mean ± std over seeds. In-distribution: mean over operand lengths "
             f"{train_lengths[0]}-{train_lengths[1]}; OOD: mean over {test_lengths[0]}-{test_lengths[1]}; "
             f"longest: {test_lengths[1]} digits.", '',
             "| model | params | seeds | in-dist | mean OOD | longest | train time (s) | kernels |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r['status'] == 'ok':
            note = f" ({r['n_bad']} run(s) failed: {r['reason']})" if r['n_bad'] else ''
            lines.append(f"| {r['model']} | {r['params']:,} | {r['n_ok']} | {_fmt(r['id'])} | {_fmt(r['ood'])} | "
                         f"{_fmt(r['longest'])} | {r['train_time_s']:.0f} | {r['route']}{note} |")
        else:
            why = r['reason'] or ''
            why = why if why.startswith(r['status']) else f"{r['status']}: {why}"
            lines.append(f"| {r['model']} | - | 0 | - | - | - | - | {why} |")
    return '\n'.join(lines).lstrip('\n') + '\n'


def plot(rows, train_lengths, path, title: str = '') -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    colors = [f"C{i}" for i in range(10)] + ['black', 'gold', 'teal', 'navy']
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, r in enumerate(x for x in rows if x['status'] == 'ok'):
        ns = sorted(r['per_length'])
        m = [r['per_length'][n][0] for n in ns]
        s = [r['per_length'][n][1] for n in ns]
        falcon = r['model'].startswith('falcon')
        (line,) = ax.plot(ns, m, '-' if falcon else '--', marker='o' if falcon else 's', ms=3.5, label=r['model'],
                          color=colors[i % len(colors)])
        if any(s):
            ax.fill_between(ns, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)],
                            color=line.get_color(), alpha=0.12)
    ax.axvline(train_lengths[1] + 0.5, color='gray', lw=1, ls=':')
    ax.text(train_lengths[1] + 0.6, 50, 'test (OOD) →', color='gray', fontsize=8)
    ax.set_xlabel('operand length (digits)')
    ax.set_ylabel('exact-match accuracy (%)')
    ax.set_ylim(-3, 103)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:   # (a report of no finished run yet has none)
        ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))   # outside: curves overlap
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_losses(runs: list[dict], path, title: str = '') -> bool:
    """Training loss against step, one line per run (color by model, line style by seed); False (no file)
    when no run recorded its curve."""
    curves = [r for r in runs if r.get('status') == 'ok' and (r.get('loss_curve') or {}).get('mean')]
    if not curves:
        return False
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r['model'] for r in curves))
    styles = ['-', '--', ':', '-.']
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for r in curves:
        c = r['loss_curve']
        steps = [(i + 1) * c['every'] for i in range(len(c['mean']))]
        ax.plot(steps, c['mean'], styles[r['seed'] % len(styles)], color=f"C{models.index(r['model']) % 10}",
                lw=1.2, label=f"{r['model']} s{r['seed']}")
    ax.set_yscale('log')
    ax.set_xlabel('training step')
    ax.set_ylabel('training loss (answer tokens)')
    ax.set_title(title)
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(out_dir, runs: list[dict], meta: dict) -> dict:
    """Writes results.json, results.md and accuracy_vs_length.png into out_dir; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tr, te = meta['train_lengths'], meta['test_lengths']
    rows = summarize(runs, tr, te)
    title = f"addition, preset {meta.get('preset')}: train {tr[0]}-{tr[1]} digits, test {te[0]}-{te[1]}"
    table = markdown_table(rows, tr, te, title)
    expected = [f"{m}-s{sd}" for sd in (meta.get('config') or {}).get('seeds', []) for m in meta.get('models') or []]
    have = {f"{r.get('model')}-s{r.get('seed')}" for r in runs}
    missing = [x for x in expected if x not in have]
    if missing:   # runs accumulate over several GPU leases (--resume): say what the table does not hold yet
        table += (f"\n**Partial: {len(expected) - len(missing)} of {len(expected)} runs so far.** Not run yet: "
                  + ', '.join(missing) + ".\n")
    if meta.get('preset') == 'tiny':
        table += ("\nThe `tiny` preset is a CPU smoke test (tiny models, short operands, few steps): it checks the "
                  "pipeline end to end; it is not the paper's experiment (`--preset paper`).\n")
    summary = [{k: v for k, v in r.items() if k != 'per_length'} | (
        {'per_length': {str(n): ms[0] for n, ms in r['per_length'].items()}} if 'per_length' in r else {})
        for r in rows]
    paths = dict(json=out / 'results.json', markdown=out / 'results.md', plot=out / 'accuracy_vs_length.png')
    with open(paths['json'], 'w') as f:
        json.dump(dict(meta=meta, summary=summary, runs=runs, paper_mean_ood=PAPER_OOD), f, indent=1, default=str)
    paths['markdown'].write_text(table)
    plot(rows, tr, paths['plot'], title)
    if plot_losses(runs, out / 'loss_curves.png', f"{title}: training loss"):
        paths['loss_plot'] = out / 'loss_curves.png'
    return {k: str(v) for k, v in paths.items()} | {'table': table}
