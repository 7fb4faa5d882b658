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
from fla_falcon.ops.falcon.utils import narrow_head_configs, narrow_warps, prune_narrow_heads


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


@pytest.mark.parametrize('name', sorted(n for n in KERNELS if '.falcon.chunk' in n))
def test_chunk_kernels_prune_narrow_heads(name):
    # every chunk kernel goes through fla_falcon.ops.falcon.utils.autotune: 8-warp configs gave illegal memory accesses
    # and wrong gradients at K = V = 16 and 32 on the H200 (nineteenth lease)
    assert KERNELS[name].early_config_prune is prune_narrow_heads, name


def test_prune_narrow_heads():
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)]
    assert prune_narrow_heads(configs, {}, K=128, V=64) == configs
    assert prune_narrow_heads(configs, {}, K=64) == configs
    assert [(c.num_warps, c.num_stages) for c in prune_narrow_heads(configs, {}, K=128, V=32)] == [(4, 2), (4, 3)]
    assert [(c.num_warps, c.num_stages) for c in prune_narrow_heads(configs, {}, K=16)] == [(4, 2), (4, 3)]
    # a list of 8-warp configs only (the heavy per-chunk kernels): its first config at 4 warps, its meta kept
    only8 = [triton.Config({'BV': 32}, num_warps=8, num_stages=3)]
    (c,) = prune_narrow_heads(only8, {}, K=32, V=32)
    assert (c.num_warps, c.num_stages, c.kwargs) == (4, 3, {'BV': 32})
    assert narrow_warps(16, 128, 8) == 4 and narrow_warps(64, 64, 8) == 8


def test_narrow_head_configs_single_config():
    # Triton's autotuner calls early_config_prune only for lists of two or more configs: a kernel with one 8-warp
    # config (falcon3's _bwd_dqx3) gets its 4-warp copy in the list, used at narrow heads only
    (c8,) = [triton.Config({'BV': 64}, num_warps=8, num_stages=2)]
    configs = narrow_head_configs([c8])
    assert len(configs) == 2 and configs[0] is c8
    assert prune_narrow_heads(configs, {}, K=128, V=128) == [c8]
    (c4,) = prune_narrow_heads(configs, {}, K=128, V=32)
    assert (c4.num_warps, c4.num_stages, c4.kwargs) == (4, 2, {'BV': 64})
    # a list with a config of at most 4 warps is kept as it is
    mixed = [triton.Config({}, num_warps=w) for w in (4, 8)]
    assert narrow_head_configs(mixed) == mixed
