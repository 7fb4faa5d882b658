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
import triton
import triton.language as tl
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
# `tl.atomic_add(dk + ...)`
ATOMIC = re.compile(r"tl\.atomic_add\(\s*(\w+)")


def _atomic_targets(kernel):
    fn = kernel.fn
    src = inspect.getsource(getattr(fn, 'fn', fn))
    return set(ATOMIC.findall(src)) & set(fn.arg_names)


@triton.autotune(configs=[triton.Config({}, num_warps=4)], key=['N'])
@triton.jit
def _adds_into(x, out, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.atomic_add(out + o, tl.load(x + o))


def test_kernels_found():
    # the walk must see the chunk kernels, and the source check must find an atomic output, or the check
    # below proves nothing (no kernel of ours adds atomically)
    assert any('_win_bwd_pairs' in k for k in KERNELS), sorted(KERNELS)
    assert _atomic_targets(_adds_into) == {'out'}


@pytest.mark.parametrize('name', sorted(KERNELS))
def test_atomic_outputs_reset_between_timed_runs(name):
    kernel = KERNELS[name]
    missing = _atomic_targets(kernel) - set(kernel.reset_to_zero) - set(kernel.restore_value)
    assert not missing, f"{name}: autotuned, adds atomically into {sorted(missing)} without reset_to_zero/restore_value"
