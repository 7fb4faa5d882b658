# -*- coding: utf-8 -*-
"""The interpreter's bounds check (tests/interpreter_bounds.py) is on in the CPU tests and catches what a GPU would
fault on: an unmasked load or store past a tensor argument's storage, including one into a view's unused tail that
lies beyond the storage. Masked-off lanes and accesses inside the storage pass."""
import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get('TRITON_INTERPRET') != '1' or os.environ.get('FLA_FALCON_BOUNDS') == '0',
                                reason='the bounds check runs under the interpreter only')


@triton.jit
def _copy_plus_one(x, y, n, OFF: tl.constexpr, B: tl.constexpr, MASK_LOAD: tl.constexpr, MASK_STORE: tl.constexpr):
    o = tl.arange(0, B)
    m = o < n
    everywhere = o >= 0   # an all-true mask: every lane accesses memory
    b = tl.load(x + OFF + o, mask=m if MASK_LOAD else everywhere, other=0.)
    tl.store(y + o, b + 1, mask=m if MASK_STORE else everywhere)


def test_in_bounds_and_masked_lanes_pass():
    x, y = torch.arange(10.), torch.zeros(10)
    _copy_plus_one[(1,)](x, y, 10, 0, 16, True, True)
    assert torch.equal(y, x + 1)


@pytest.mark.parametrize('mask_load, mask_store, what', [(False, True, 'load'), (True, False, 'store')])
def test_unmasked_access_past_the_end_fails(mask_load, mask_store, what):
    from interpreter_bounds import OutOfBoundsError
    x, y = torch.arange(10.), torch.zeros(10)
    with pytest.raises(Exception) as e:
        _copy_plus_one[(1,)](x, y, 10, 0, 16, mask_load, mask_store)
    assert isinstance(e.value, OutOfBoundsError) or 'OutOfBoundsError' in repr(e.value)
    assert f'_copy_plus_one: {what} of 6 unmasked lane(s)' in str(e.value)


def test_view_reads_inside_its_storage_pass():
    # a view's neighbours in the same storage are memory the kernel may legally touch (as on a GPU)
    base = torch.arange(32.)
    y = torch.zeros(16)
    _copy_plus_one[(1,)](base[4:8], y, 16, 0, 16, False, True)
    assert torch.equal(y, base[4:20] + 1)
