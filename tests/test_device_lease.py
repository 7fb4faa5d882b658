# -*- coding: utf-8 -*-
"""The lease settings planned for the next GPU lease (scripts/device_lease/plan_next.env) survive being sourced.

chain.sh sources the settings file, then evals its commands (PRE_CMD, SIDE_CMD, ...). A loop written inside such a
command's double quotes must keep its variable for the eval: `--overlap $o` expands to `--overlap ` when the file is
sourced (the fifty-seventh lease lost its timing run so); `\\$o` keeps it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, 'scripts', 'device_lease', 'plan_next.env')
COMMANDS = ('PRE_CMD', 'SIDE_CMD', 'PRE_BENCH', 'BENCH', 'TESTS')


def _sourced(path: str) -> dict[str, str]:
    """The settings as chain.sh sees them after sourcing the file (L set as chain.sh sets it)."""
    script = f'L=/tmp/L; set -a; . {path!s}; ' + '; '.join(f'printf "%s\\0" "${{{v}-}}"' for v in COMMANDS)
    out = subprocess.run(['bash', '-c', script], capture_output=True, text=True, check=True).stdout
    return dict(zip(COMMANDS, out.split('\0')))


def _loop_vars_lost(cmd: str) -> list[str]:
    """The variables a `for VAR in ...; do` loop of cmd sets but whose uses were expanded away before the eval."""
    return [var for var in re.findall(r'\bfor\s+([A-Za-z_]\w*)\s+in\b', cmd)
            if not re.search(r'\$\{?' + var + r'\b', cmd)]


@pytest.mark.skipif(shutil.which('bash') is None, reason='needs bash')
def test_plan_next_keeps_its_loop_variables_for_the_eval(tmp_path):
    # the check itself: an unescaped loop variable is caught, an escaped one passes
    bad, good = tmp_path / 'bad.env', tmp_path / 'good.env'
    bad.write_text('PRE_CMD="for o in off auto; do echo --overlap $o; done"\n')
    good.write_text('PRE_CMD="for o in off auto; do echo --overlap \\$o; done"\n')
    assert _loop_vars_lost(_sourced(str(bad))['PRE_CMD']) == ['o']
    assert _loop_vars_lost(_sourced(str(good))['PRE_CMD']) == []
    settings = _sourced(PLAN)
    for name, cmd in settings.items():
        assert not _loop_vars_lost(cmd), f'{name} in plan_next.env: loop variables expanded at source time'
