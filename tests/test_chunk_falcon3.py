# -*- coding: utf-8 -*-
"""chunk_falcon(rule='falcon3') (Triton, sliding-window regression; forward only so far) vs
naive_recurrent_falcon(rule='falcon3') in fp64: outputs and the whole final state (S, last key, window tail, count)."""

import pytest
import test_chunk as base
import torch
from conftest import DEVICE
from fla.utils import assert_close
from test_chunk import RATIO

from fla_falcon import FalconState
from fla_falcon.ops.falcon.chunk import chunk_falcon
from fla_falcon.ops.falcon.naive import naive_recurrent_falcon


def compare(window, T, dtype=torch.float32, B=2, H=1, G=2, K=16, V=16, lam_mode='on', init=True, shift=True,
            cu_seqlens=None, seed=0):
    q, k, v, beta, lam, state = base.make_inputs('falcon3', B, T, H, G, K, V, lam_mode, init, DEVICE, seed=seed,
                                                 cu_seqlens=cu_seqlens, window=window)
    kw = dict(rule='falcon3', window=window, shift=shift, output_final_state=True, cu_seqlens=cu_seqlens,
              lam_coupled=lam_mode == 'coupled')
    cast = lambda t, dt: None if t is None else t.to(dt)  # noqa: E731
    with torch.no_grad():
        o, fs = chunk_falcon(*(cast(t, dtype) for t in (q, k, v, beta, lam)), initial_state=state, **kw)
        # the reference sees the same rounded inputs
        ref_in = [cast(cast(t, dtype), torch.float64) for t in (q, k, v, beta, lam)]
        st64 = FalconState(*(t.double() for t in state[:4]), state.count) if state is not None else None
        o_ref, fs_ref = naive_recurrent_falcon(*ref_in, initial_state=st64, **kw)
    assert o.dtype == dtype and torch.isfinite(o).all()
    for name, ref, tri in (('o', o_ref, o), ('S', fs_ref.S, fs.S), ('last_k', fs_ref.last_k, fs.last_k),
                           ('tail_x', fs_ref.tail_x, fs.tail_x), ('tail_v', fs_ref.tail_v, fs.tail_v)):
        assert_close(name, ref.double(), tri.double(), RATIO[dtype])
    assert torch.equal(fs.count.cpu(), fs_ref.count.cpu())


@pytest.mark.parametrize('window, T', [(2, 1), (2, 70), (3, 20), (3, 65), (4, 63), (5, 40), (8, 70)])
def test_windows(window, T):
    # WP = 2, 4, 4, 8, 8 slots per step (W = 3, 5: padding slots); chunks of 32, 16 or 8 steps; one continued
    # sequence with a full tail and one fresh one (grouped value heads)
    compare(window, T)


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('lam_mode', ['off', 'coupled'])
def test_options(lam_mode, shift):
    compare(4, 40, lam_mode=lam_mode, shift=shift, init=lam_mode == 'off')


def test_varlen_and_partial_tails():
    # sequences of 1, 19, 0, 37 and 33 tokens; initial counts 3, 0, 2 (full tail, fresh, partial tail)
    cu = torch.tensor([0, 1, 20, 20, 57, 90], device=DEVICE)
    compare(3, 90, B=1, cu_seqlens=cu)


def test_odd_head_dims_bf16():
    compare(4, 40, dtype=torch.bfloat16, K=24, V=80, seed=3)


def test_window1_is_falcon1():
    # the window of one pair is falcon1 (the rule identity of SPEC section 1), through falcon1's kernels
    q, k, v, beta, lam, state = base.make_inputs('falcon1', 1, 40, 1, 1, 16, 16, 'on', True, DEVICE)
    with torch.no_grad():
        o3, _ = chunk_falcon(q, k, v, beta, lam, rule='falcon3', window=1, initial_state=state)
        o1, _ = chunk_falcon(q, k, v, beta, lam, rule='falcon1', initial_state=state)
    assert torch.equal(o3, o1)


def test_backward_not_yet():
    q, k, v, beta, lam, _ = base.make_inputs('falcon3', 1, 8, 1, 1, 16, 16, 'on', False, DEVICE, window=2)
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward yet"):
        chunk_falcon(q, k, v, beta, lam, rule='falcon3', window=2)


@pytest.mark.gpu
@pytest.mark.parametrize('window', [2, 4, 8])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gpu_long_heads128(window, dtype):
    compare(window, 1000, dtype=dtype, B=2, H=2, G=1, K=128, V=128)
