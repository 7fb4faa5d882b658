# -*- coding: utf-8 -*-
"""Summarize Nsight Compute's per-SASS-instruction table (``ncu --import R.ncu-rep --page source --print-source sass
--csv``, as scripts/device_lease/extras/ncu_seq.sh writes it, plain or .xz) into Markdown: per kernel, the warp stall
reasons over all samples, the opcodes by share of stall samples and of executed instructions, and the code in slices
of N instructions (where the samples fall, which opcodes dominate each slice), so that a loop body's parts (the
substitution steps, the pipeliner's copies for the next iteration) can be told apart without the GUI.

    python scripts/ncu_sass_summary.py seq_sass.csv.xz --slice 250 --out summary.md
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import lzma
import sys

SAMPLES = 'Warp Stall Sampling (All Samples)'
EXECUTED = 'Instructions Executed'


def _num(x: str) -> float:
    try:
        return float(x.replace(',', ''))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """An instruction's opcode without modifiers or predicate ('@!P0 LDGSTS.E [R1], ...' -> 'LDGSTS'); also
    scripts/aot_check.py's."""
    parts = source.split()
    if not parts:
        return ''
    op = parts[1] if parts[0].startswith('@') and len(parts) > 1 else parts[0]   # '@P0 FMUL ...': the predicate
    return op.split('.')[0]


def read_kernels(text: str) -> dict[str, list[dict]]:
    """The table of each kernel: ncu writes a '"Kernel Name","<name>",' line before each kernel's CSV table."""
    kernels = {}
    for part in text.split('"Kernel Name",')[1:]:
        head, _, table = part.partition('\n')
        name = head.split(',')[0].strip('"')
        rows = list(csv.DictReader(io.StringIO(table)))
        if not rows or SAMPLES not in rows[0]:
            raise ValueError(f'kernel {name}: no {SAMPLES!r} column (was SourceCounters / WarpStateStats collected?)')
        kernels[name] = rows
    if not kernels:
        raise ValueError('no "Kernel Name" line: not the CSV of `ncu --page source --print-source sass --csv`')
    return kernels


def summarize(name: str, rows: list[dict], slice_len: int, top: int) -> str:
    stalls = [c for c in rows[0] if c.startswith('stall_') and 'Not Issued' not in c]
    total = collections.Counter()
    for r in rows:
        for c in stalls:
            total[c] += _num(r[c])
    n_samples = sum(total.values()) or 1.0
    samples = collections.Counter()
    executed = collections.Counter()
    static = collections.Counter()
    for r in rows:
        op = opcode(r['Source'])
        samples[op] += _num(r[SAMPLES])
        executed[op] += _num(r[EXECUTED])
        static[op] += 1
    s_all = sum(samples.values()) or 1.0
    e_all = sum(executed.values()) or 1.0
    out = [f'## {name}', '', f'{len(rows)} SASS instructions, {int(n_samples)} stall samples, '
           f'{int(e_all)} warp instructions executed.', '',
           '| stall reason | share of samples |', '|---|---:|']
    out += [f'| {c[6:]} | {100 * v / n_samples:.1f}% |' for c, v in total.most_common(8)]
    out += ['', '| opcode | share of samples | share of executed | static count |', '|---|---:|---:|---:|']
    out += [f'| {op} | {100 * v / s_all:.1f}% | {100 * executed[op] / e_all:.1f}% | {static[op]} |'
            for op, v in samples.most_common(top)]
    out += ['', f'Slices of {slice_len} instructions:', '',
            '| instructions | share of samples | share of executed | most common opcodes |', '|---|---:|---:|---|']
    for b in range(0, len(rows), slice_len):
        part = rows[b:b + slice_len]
        s = sum(_num(r[SAMPLES]) for r in part)
        e = sum(_num(r[EXECUTED]) for r in part)
        ops = collections.Counter(opcode(r['Source']) for r in part)
        common = ', '.join(f'{op} {k}' for op, k in ops.most_common(5))
        out.append(f'| {b}-{b + len(part) - 1} | {100 * s / s_all:.1f}% | {100 * e / e_all:.1f}% | {common} |')
    return '\n'.join(out) + '\n'


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('csv', help="ncu's SASS source table as CSV (.xz allowed)")
    ap.add_argument('--slice', type=int, default=250, help='instructions per slice of the code (default 250)')
    ap.add_argument('--top', type=int, default=20, help='opcodes listed (default 20)')
    ap.add_argument('--out', help='write the Markdown here (default: stdout)')
    args = ap.parse_args(argv)
    if args.slice < 1:
        ap.error('--slice must be at least 1')
    opener = lzma.open if args.csv.endswith('.xz') else open
    with opener(args.csv, 'rt') as f:
        text = f.read()
    try:
        kernels = read_kernels(text)
    except ValueError as e:
        ap.error(str(e))
    md = '\n'.join(summarize(name, rows, args.slice, args.top) for name, rows in kernels.items())
    if args.out:
        with open(args.out, 'w') as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == '__main__':
    sys.exit(main())
