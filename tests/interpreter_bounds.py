# -*- coding: utf-8 -*-
"""Bounds checking for Triton's interpreter (the CPU tests): every load and store a kernel makes on a lane its mask
keeps must fall inside the storage of one of the kernel's tensor arguments, or the launch fails with an error that
names the kernel, the access and how far outside it went.

Why: on a GPU such an access is an illegal memory access (or a silent wrong value), while the interpreter reads and
writes host memory through raw addresses and usually carries on. The thirty-fifth lease found one that every CPU test
had passed (col-gates-fuse: ``_bwd_col_gates`` faulted in three GPU tests). Masked-off lanes are not checked: they
touch no memory on either side.

Installed by ``tests/conftest.py`` under the interpreter (``install()``); ``FLA_FALCON_BOUNDS=0`` turns it off."""

from __future__ import annotations

import numpy as np
import torch
from triton.runtime import interpreter as _ti

_launches = []   # (kernel name, sorted storage starts, their ends), innermost launch last


class OutOfBoundsError(RuntimeError):
    pass


def _spans(args):
    out = []

    def collect(a):
        if isinstance(a, (tuple, list)):
            for x in a:
                collect(x)
        elif isinstance(a, torch.Tensor):
            st = a.untyped_storage()
            out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        elif hasattr(a, 'base') and isinstance(getattr(a, 'base'), torch.Tensor):   # a TensorDescriptor
            collect(a.base)
    collect(args)
    out.sort()
    return np.array([s for s, _ in out], dtype=np.uint64), np.array([e for _, e in out], dtype=np.uint64)


def _check(ptrs, mask, what):
    if not _launches:
        return
    name, starts, ends = _launches[-1]
    p = ptrs.data
    m = np.broadcast_to(mask.data, p.shape) if mask is not None else np.ones(p.shape, bool)
    p = p[m].astype(np.uint64).ravel()
    if p.size == 0:
        return
    size = np.dtype(_ti._get_np_dtype(ptrs.get_element_ty())).itemsize
    i = np.searchsorted(starts, p, side='right').astype(np.int64) - 1
    ok = i >= 0
    ok[ok] = p[ok] + np.uint64(size) <= ends[i[ok]]
    if not ok.all():
        bad = p[~ok]
        # the nearest argument's end, to say how far past it (or before which start) the access went
        j = np.clip(np.searchsorted(starts, bad[0], side='right').astype(np.int64) - 1, 0, len(starts) - 1)
        where = (f"reaching {int(bad[0]) + size - int(ends[j])} bytes past the end of the argument storage at "
                 f"{int(starts[j]):#x}"
                 if len(starts) and bad[0] >= starts[j] else "below every argument's storage")
        raise OutOfBoundsError(f"{name}: {what} of {bad.size} unmasked lane(s) outside every tensor argument "
                               f"(first at {int(bad[0]):#x}, {where})")


def install():
    """Wraps the interpreter's launch (to know the arguments' storages) and its masked load / store."""
    if getattr(_ti.GridExecutor, '_bounds_checked', False):
        return
    launch = _ti.GridExecutor.__call__
    load = _ti.InterpreterBuilder.create_masked_load
    store = _ti.InterpreterBuilder.create_masked_store

    def checked_launch(self, *args, **kwargs):
        _launches.append((getattr(self.fn, '__name__', '?'), *_spans((args, tuple(kwargs.values())))))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launches.pop()

    def checked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check(ptrs, mask, 'load')
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_policy):
        _check(ptrs, mask, 'store')
        return store(self, ptrs, value, mask, cache_policy)

    _ti.GridExecutor.__call__ = checked_launch
    _ti.InterpreterBuilder.create_masked_load = checked_load
    _ti.InterpreterBuilder.create_masked_store = checked_store
    _ti.GridExecutor._bounds_checked = True
