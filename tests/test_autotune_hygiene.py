# -*- coding: utf-8 -*-
"""Static checks of the autotuned kernels that the CPU interpreter cannot exercise.

Under the interpreter every autotuner keeps one config and never benchmarks (conftest), so a kernel that
accumulates into an output with atomic adds gives the right answer on the CPU even when, on a GPU, the
autotuner's timed runs of each config pile up in that output before the real run. (This happened:
falcon3a's dk/dv were off by factors of hundreds on the H200 only.) Every argument such a kernel
atomically adds into must be zeroed (`reset_to_zero`) or restored (`restore_value`) around the timed runs.
"""

import importlib
import inspect
import pkgutil
import re

import pytest
from triton.runtime.autotuner import Autotuner

import fla_falcon.ops


def _autotuned_kernels():
    seen = set()
    for info in pkgutil.walk_packages(fla_falcon.ops.__path__, 'fla_falcon.ops.'):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, Autotuner) and id(obj) not in seen:   # a kernel imported elsewhere: once
                seen.add(id(obj))
                yield f"{info.name}.{name}", obj


KERNELS = dict(_autotuned_kernels())
# `tl.atomic_add(dk + ...)` and `_store_rows(dv + ..., N_SHARED)` with a nonzero shared-row count
ATOMIC = re.compile(r"tl\.atomic_add\(\s*(\w+)")
SHARED_ROWS = re.compile(r"_store_rows\(\s*(\w+)[^;]*?,\s*([^,()]+)\)\s*$", re.M)


def _atomic_targets(kernel):
    fn = kernel.fn
    src = inspect.getsource(getattr(fn, 'fn', fn))
    names = set(ATOMIC.findall(src))
    names |= {m.group(1) for m in SHARED_ROWS.finditer(src) if m.group(2).strip() != '0'}
    return names & set(fn.arg_names)


def test_kernels_found():
    # the walk must see the chunk and recurrent kernels, or the check below proves nothing
    assert any('_bwd_win_dk' in k for k in KERNELS), sorted(KERNELS)
    assert _atomic_targets(KERNELS['fla_falcon.ops.falcon.chunk._bwd_win_dk']) == {'dk', 'dv'}


@pytest.mark.parametrize('name', sorted(KERNELS))
def test_atomic_outputs_reset_between_timed_runs(name):
    kernel = KERNELS[name]
    missing = _atomic_targets(kernel) - set(kernel.reset_to_zero) - set(kernel.restore_value)
    assert not missing, f"{name}: autotuned, adds atomically into {sorted(missing)} without reset_to_zero/restore_value"
