# -*- coding: utf-8 -*-
"""The lease settings planned for the next GPU lease (scripts/device_lease/plan_next.env) survive being sourced.

chain.sh sources the settings file, then evals its commands (PRE_CMD, SIDE_CMD, ...). A loop written inside such a
command's double quotes must keep its variable for the eval: `--overlap $o` expands to `--overlap ` when the file is
sourced (the fifty-seventh lease lost its timing run so); `\\$o` keeps it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, 'scripts', 'device_lease', 'plan_next.env')
COMMANDS = ('PRE_CMD', 'SIDE_CMD', 'TESTS')   # the settings chain.sh evals


def _sourced(path: str) -> dict[str, str]:
    """The settings as chain.sh sees them after sourcing the file (L set as chain.sh sets it)."""
    script = f'L=/tmp/L; . {shlex.quote(path)}; ' + '; '.join(f'printf "%s\\0" "${{{v}-}}"' for v in COMMANDS)
    out = subprocess.run(['bash', '-c', script], capture_output=True, text=True, check=True).stdout
    return dict(zip(COMMANDS, out.split('\0')))


def _loop_vars_lost(path: str) -> list[str]:
    """The variables that a `for VAR in ...; do` loop of a command sets but that a double-quoted assignment of the
    file writes as a bare `$VAR` (expanded when the file is sourced) instead of `\\$VAR`."""
    loops = {var for cmd in _sourced(path).values() for var in re.findall(r'\bfor\s+([A-Za-z_]\w*)\s+in\b', cmd)}
    assignments = [line for line in open(path).read().splitlines() if re.match(r'(%s)="' % '|'.join(COMMANDS), line)]
    return sorted(var for var in loops
                  if any(re.search(r'(?<!\\)\$\{?' + var + r'\b', line) for line in assignments))


@pytest.mark.skipif(shutil.which('bash') is None, reason='needs bash')
def test_plan_next_keeps_its_loop_variables_for_the_eval(tmp_path):
    # the check itself: a loop variable expanded at any of its uses is caught, one escaped at all of them passes
    cases = {'bad': 'PRE_CMD="for o in off auto; do echo --overlap $o; done"',
             'half': 'PRE_CMD="for o in off auto; do echo --overlap $o > f_\\$o; done"',
             'good': 'PRE_CMD="for o in off auto; do echo --overlap \\$o > f_\\$o; done"'}
    lost = {}
    for name, text in cases.items():
        (tmp_path / name).write_text(f'# a comment may say $o\n{text}\n')
        lost[name] = _loop_vars_lost(str(tmp_path / name))
    assert lost == {'bad': ['o'], 'half': ['o'], 'good': []}
    assert _sourced(str(tmp_path / 'good'))['PRE_CMD'].count('$o') == 2
    assert not _loop_vars_lost(PLAN), 'plan_next.env: loop variables expanded when the file is sourced'


def _shadowed(path: str) -> list[str]:
    """Shell functions a command defines (`name() {`) under the name of a command or builtin: chain.sh evals the
    commands in its own shell, so such a function would replace it for the rest of the chain (a `tr() {...}` did, in
    the fifty-eighth session's draft)."""
    names = {n for cmd in _sourced(path).values() for n in re.findall(r'(?:^|[;{]\s*)([A-Za-z_][\w-]*)\s*\(\)\s*\{', cmd)}
    out = []
    for name in sorted(names):
        kind = subprocess.run(['bash', '-c', f'type -t {shlex.quote(name)}'], capture_output=True, text=True).stdout
        if kind.strip() or shutil.which(name):
            out.append(name)
    return out


@pytest.mark.skipif(shutil.which('bash') is None, reason='needs bash')
def test_plan_next_functions_shadow_no_command(tmp_path):
    (tmp_path / 'bad').write_text('PRE_CMD="tr() { echo; }; t_r() { echo; }; tr"\n')
    (tmp_path / 'good').write_text('PRE_CMD="nvidia-smi -L; t_r() { echo; }; t_o() { echo; }; t_r; t_o"\n')
    assert _shadowed(str(tmp_path / 'bad')) == ['tr']
    assert _shadowed(str(tmp_path / 'good')) == []
    assert not _shadowed(PLAN), 'plan_next.env: a shell function named as a command'


@pytest.mark.skipif(not all(shutil.which(c) for c in ('bash', 'xz', 'tar', 'find')), reason='needs bash, xz, tar')
def test_pack_cache_keeps_what_fits(tmp_path):
    # step.sh's `final`: the whole Triton cache if it fits, else the autotune results and falcon2's sequential kernels'
    # entries (their compiles take most of falcon2's GPU tests), else the autotune results alone
    cache = tmp_path / 'cache'
    files = {'A/_fwd_h_delta_col.json': b'm', 'A/__grp___fwd_h_delta_col.json': b'g',
             'A/_fwd_h_delta_col.cubin': os.urandom(200_000), 'B/_fwd_o_col.json': b'm',
             'B/_fwd_o_col.cubin': os.urandom(3_000_000), 'C/_fwd_o_col.autotune.json': b'{}',
             'D/_bwd_dhu_delta_col.json': b'm'}
    for name, data in files.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    script = os.path.join(ROOT, 'scripts', 'device_lease', 'pack_cache.sh')
    packed = {}
    for limit in ('10', '1', '0'):
        out = tmp_path / f'{limit}.tar.xz'
        subprocess.run(['bash', script, str(cache), str(out), limit], check=True, capture_output=True)
        names = subprocess.run(['tar', 'tJf', str(out)], check=True, capture_output=True, text=True).stdout.split()
        packed[limit] = sorted(n[2:] for n in names if not n.endswith('/'))
    assert packed['10'] == sorted(files)
    assert packed['1'] == ['A/__grp___fwd_h_delta_col.json', 'A/_fwd_h_delta_col.cubin', 'A/_fwd_h_delta_col.json',
                           'C/_fwd_o_col.autotune.json', 'D/_bwd_dhu_delta_col.json']
    assert packed['0'] == ['C/_fwd_o_col.autotune.json']
