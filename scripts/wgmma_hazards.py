# -*- coding: utf-8 -*-
"""Find shared-memory buffers that a Triton kernel overwrites while an asynchronous wgmma still reads them.

Triton's software pipeliner (Hopper, `num_stages` >= 2) issues a loop's `tl.dot`s as asynchronous wgmma and copies
the next iterations' tiles into a ring of shared-memory slots with `cp.async`. Triton 3.6 gives a loaded tile one slot
fewer than it needs when the tile feeds both an asynchronous wgmma (e.g. through `tl.trans`) and ordinary register
code (e.g. `tl.sum(b_h * b_dh)`): the copy for iteration i + S - 1 then lands in the slot that iteration i's wgmma is
still reading, before the wgmma is waited on. The result depends on timing: wrong now and then, with the same inputs
and config, and only on the GPU (falcon3a's bf16 dq in `_bwd_dqx`, thirteenth to fifteenth leases).

This reads a kernel's TTGIR (`kernel.asm['ttgir']`, or `*.ttgir` files in a Triton cache) and reports every async
copy or local store into a buffer that an asynchronous `warp_group_dot` issued earlier reads and that no
`warp_group_dot_wait` has retired. Loop bodies are scanned twice in a row, so a wgmma left in flight at the end of
an iteration meets the next iteration's copies. A ring of S slots prefetched D iterations ahead (D: the copies
into it before its loop) is overwritten in the slot being read when S divides D; other rings are not reported.

    python scripts/wgmma_hazards.py ~/.triton/cache            # every *.ttgir under it
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_DEF = re.compile(r'^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w."]+)\s*(.*)$')
_NAME = re.compile(r'%[\w.$-]+(?:#\d+)?')
_PENDINGS = re.compile(r'pendings\s*=\s*(\d+)')


def _expand_loops(lines: list[str]) -> list[str]:
    """The lines with each scf.for body (innermost first) repeated once: two iterations back to back."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if 'scf.for' in line and line.rstrip().endswith('{'):
            depth, j = 1, i + 1
            while j < len(lines) and depth:
                depth += lines[j].count('{') - lines[j].count('}')
                j += 1
            body = _expand_loops(lines[i + 1:j - 1])
            out.append(line)
            out.extend(body + body)
            out.append(lines[j - 1])
            i = j
        else:
            out.append(line)
            i += 1
    return out


def war_hazards(ttgir: str) -> list[str]:
    """Human-readable hazards found in one kernel's TTGIR (empty: none found)."""
    root: dict[str, str] = {}
    ring: dict[str, int] = {}   # the pipeliner's mutable buffers: slots per buffer

    def res(name: str) -> str:
        name = name.split('#')[0]
        while name in root:
            name = root[name]
        return name

    lines = ttgir.splitlines()
    depth, in_loop = 0, []   # scf.for nesting of each line
    for line in lines:
        opens = 'scf.for' in line and line.rstrip().endswith('{')
        in_loop.append(depth > 0)
        if depth or opens:
            depth += line.count('{') - line.count('}')
    prologue: dict[str, int] = {}   # copies into each ring before its loop: how far ahead the loop prefetches
    for line, looped in zip(lines, in_loop):
        m = _DEF.match(line)
        if not m:
            continue
        names = _NAME.findall(m.group(3).split(' : ')[0])
        if m.group(2) == 'ttg.local_alloc':
            n = re.search(r'\(\)\s*->\s*!ttg\.memdesc<(\d+)x[^>]*mutable', m.group(3))
            if n:
                ring[m.group(1)] = int(n.group(1))
        elif m.group(2) == 'ttg.memdesc_index' and names and not looped:
            root[m.group(1)] = names[0].split('#')[0]
        elif m.group(2) == 'ttg.async_copy_global_to_local' and len(names) >= 2 and not looped:
            buf = res(names[1])
            prologue[buf] = prologue.get(buf, 0) + 1

    pending: list[tuple[str, set[str], str]] = []
    found: list[str] = []
    for line in _expand_loops(lines):
        m = _DEF.match(line)
        op = m.group(2) if m else line.strip().split(' ')[0]
        rest = m.group(3) if m else line
        names = _NAME.findall(rest.split(' : ')[0])
        if m and op.startswith('ttg.memdesc_') and names:   # a slot of a ring, or a view (trans, reinterpret)
            root[m.group(1)] = names[0].split('#')[0]
        elif op == 'ttng.warp_group_dot' and 'isAsync = true' in rest:
            pending.append((m.group(1) if m else '?', {res(n) for n in names[:2]}, line.strip()[:160]))
        elif op == 'ttng.warp_group_dot_wait':
            k = _PENDINGS.search(rest)
            keep = int(k.group(1)) if k else 0
            pending = pending[len(pending) - keep:] if keep else []
        elif op in ('ttg.async_copy_global_to_local', 'ttg.local_store') and len(names) >= 2:
            dst = res(names[1])
            # a copy for iteration i + dist lands in the slot iteration i reads when the ring's length divides dist
            dist = prologue.get(dst, 1)
            if dst in ring and dist % ring[dst]:
                continue
            for dot, srcs, where in pending:
                if dst in srcs:
                    msg = (f"{op} into {dst} ({ring.get(dst, 1)} slot(s), prefetch distance {dist}) while async "
                           f"wgmma {dot} reads it ({where})")
                    if msg not in found:
                        found.append(msg)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('paths', nargs='*', type=Path, default=[Path.home() / '.triton' / 'cache'],
                   help='*.ttgir files, or folders searched for them (default: ~/.triton/cache)')
    args = p.parse_args(argv)
    files = [f for path in args.paths for f in (sorted(path.rglob('*.ttgir')) if path.is_dir() else
                                                 [path] if path.exists() else [])]
    bad = 0
    for f in files:
        hz = war_hazards(f.read_text())
        if hz:
            bad += 1
            print(f"{f}: {len(hz)} hazard(s)")
            for h in hz:
                print(f"    {h}")
    print(f"{len(files)} kernel(s) read, {bad} with hazards")
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
