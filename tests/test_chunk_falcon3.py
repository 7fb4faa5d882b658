# -*- coding: utf-8 -*-
"""chunk_falcon(rule='falcon3') (Triton, sliding-window regression) vs naive_recurrent_falcon(rule='falcon3') in fp64:
outputs, the whole final state (S, last key, window tail, count) and every gradient (q, k, v, beta, lam and the
initial state's S, last key and tail). test_chunk's generic tests (options, clamp, zero keys, odd head dims,
segments, the GPU shapes) run falcon3 too, with window 3, and its W = 8 segments test both windowed rules."""

import pytest
import test_chunk as base
import torch
from conftest import DEVICE
from fla.utils import assert_close
from test_chunk import RATIO, SAME_OP_RATIO

from fla_falcon import FalconState
from fla_falcon.ops.falcon.chunk import chunk_falcon
from fla_falcon.ops.falcon.fused_recurrent import fused_recurrent_falcon
from fla_falcon.ops.falcon.naive import naive_recurrent_falcon


def check(window, T, dtype=torch.float32, B=2, H=1, G=2, K=16, V=16, lam_mode='on', init=True, shift=True,
          cu_seqlens=None, seed=0):
    inputs = base.make_inputs('falcon3', B, T, H, G, K, V, lam_mode, init, DEVICE, seed=seed, cu_seqlens=cu_seqlens,
                              window=window)
    base.check(base.run_both('falcon3', *inputs, dtype, lam_mode=lam_mode, shift=shift, cu_seqlens=cu_seqlens,
                             window=window), dtype)


@pytest.mark.parametrize('window, T', [(2, 1), (2, 70), (3, 40), (4, 33), (5, 20), (6, 20), (7, 9), (8, 20)])
def test_windows(window, T):
    # a chunk is 64 virtual rows: 32, 16 or 8 steps of WP = 2, 4 or 8 slots (W = 3, 5-7: padding slots); every
    # length but 1 and 9 spans chunks, whose first W - 1 steps reach back into the previous chunk's pairs. One
    # continued sequence with a full tail and one fresh one, grouped value heads
    check(window, T)


@pytest.mark.parametrize('T', [63, 64, 65])
def test_lengths(T):
    check(4, T, B=1)


@pytest.mark.parametrize('shift', [True, False])
def test_varlen_and_partial_tails(shift):
    # sequences of 1, 19, 0, 37 and 33 tokens; initial counts 3, 0, 2 (full tail, fresh, partial tail)
    cu = torch.tensor([0, 1, 20, 20, 57, 90], device=DEVICE)
    check(3, 90, B=1, cu_seqlens=cu, shift=shift)


def test_odd_head_dims_bf16():
    check(4, 40, dtype=torch.bfloat16, K=24, V=80, seed=3)


def test_window1_is_falcon1():
    # the window of one pair is falcon1 (the rule identity of SPEC section 1), through falcon1's kernels
    q, k, v, beta, lam, state = base.make_inputs('falcon1', 1, 40, 1, 1, 16, 16, 'on', True, DEVICE)
    with torch.no_grad():
        o3, _ = chunk_falcon(q, k, v, beta, lam, rule='falcon3', window=1, initial_state=state)
        o1, _ = chunk_falcon(q, k, v, beta, lam, rule='falcon1', initial_state=state)
    assert torch.equal(o3, o1)


def test_matches_fused_recurrent():
    """The chunk and the fused recurrent kernel agree (outputs, final state, every gradient)."""
    q, k, v, beta, lam, state = base.make_inputs('falcon3', 1, 40, 1, 2, 16, 16, 'on', True, DEVICE, window=4)
    outs = []
    for op in (chunk_falcon, fused_recurrent_falcon):
        xs = [t.clone().requires_grad_() for t in (q, k, v, beta, lam, state.S, state.last_k, state.tail_x,
                                                   state.tail_v)]
        st = FalconState(*xs[5:], state.count)
        o, fs = op(*xs[:5], rule='falcon3', window=4, initial_state=st, output_final_state=True)
        (o.square().sum() + fs.S.square().sum() + fs.tail_x.sum() + fs.tail_v.sum()).backward()
        outs.append([o, fs.S, fs.tail_x, fs.tail_v] + [t.grad for t in xs])
    names = ['o', 'S', 'tail_x', 'tail_v', 'dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0', 'dlast_k', 'dtail_x', 'dtail_v']
    # on the GPU the chunk kernel's products are TF32 and the fused recurrent kernel has no tl.dot (fp32 FMAs):
    # their difference is the chunk's own rounding, so the chunk's tolerance against the fp64 reference applies
    # (dq differed by 2.3e-3 on the H200, over SAME_OP_RATIO's 2e-3). Gradients on the GPU take fla's own gradient
    # tolerance for its chunk kernels against fused_recurrent (0.008 for dq / dk / dv / dh0 in fla's tests): since
    # A is formed from one 64-row Gram product, dlast_k (16 elements) differed by 0.535% on the H200 with an own solve
    # and with fla's solve_tril, a tf32x3 and a TF32-rounded Gram alike (twenty-first and twenty-second leases), while
    # every fp32 gradient stays within 0.5% of the fp64 reference at K = 64, T = 1000 (test_gpu_long)
    for i, (name, a, b) in enumerate(zip(names, *outs)):
        tol = SAME_OP_RATIO[DEVICE] if DEVICE == 'cpu' else RATIO[torch.float32] if i < 4 else 8e-3
        assert_close(name, a.double(), b.double(), tol)


@pytest.mark.gpu
@pytest.mark.parametrize('T', [1, 63, 64, 65, 130])
@pytest.mark.parametrize('window', [2, 5, 8])
def test_gpu_lengths(window, T):
    check(window, T, K=64, V=64)


@pytest.mark.gpu
@pytest.mark.parametrize('window', [2, 4, 8])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gpu_long(window, dtype):
    # heads of 128 in bf16; fp32 at K = 64 (falcon3 refuses fp32 at K > 64: see test_chunk's bad-args test)
    K = 128 if dtype == torch.bfloat16 else 64
    check(window, 1000, dtype=dtype, B=2, H=2, G=1, K=K, V=128)


@pytest.mark.gpu
@pytest.mark.parametrize('window', [2, 8])
def test_gpu_forward_fp32_heads128(window):
    # without gradients falcon3 runs fp32 at K = 128 (training refuses K > 64 in fp32): outputs and final state
    q, k, v, beta, lam, state = base.make_inputs('falcon3', 2, 1000, 2, 1, 128, 128, 'on', True, DEVICE, window=window)
    kw = dict(rule='falcon3', window=window, output_final_state=True)
    with torch.no_grad():
        o, fs = chunk_falcon(q, k, v, beta, lam, initial_state=state, **kw)
        st64 = FalconState(*(t.double() for t in state[:4]), state.count)
        o_ref, fs_ref = naive_recurrent_falcon(*(t.double() for t in (q, k, v, beta, lam)), initial_state=st64, **kw)
    for name, ref, tri in (('o', o_ref, o), ('S', fs_ref.S, fs.S), ('tail_x', fs_ref.tail_x, fs.tail_x)):
        assert_close(name, ref.double(), tri.double(), base.RATIO[torch.float32])


def _energies(window, shift, k, state, cu_seqlens, blocked):
    from fla_falcon.ops.falcon.chunk_win import _win_meta, _window_energy
    m, _, _, _ = _win_meta(k, k, window, None if state is None else state.S, cu_seqlens, shift)
    lk, tx, cnt = (None, None, None) if state is None else (state.last_k, state.tail_x, state.count)
    return _window_energy(k, lk, tx, cnt, window, shift, state is not None, cu_seqlens, m['chunk_indices'],
                          m['chunk_offsets'], blocked=blocked)


@pytest.mark.parametrize('window', [2, 3, 4])
@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('mode', ['fresh', 'state', 'varlen', 'bf16'])
def test_window_energy_blocked(window, shift, mode):
    """The token-blocked energy kernel (_win_energy, windows 2..4) gives the per-token kernel's E and Ue: the same
    pairs (shift, carried last key and tails of every count 0..W, varlen with empty and length-1 sequences, bf16
    keys with fp32 tails), the same eigen-iteration per lane. Lengths are not multiples of the block (64 / WP)."""
    torch.manual_seed(window * 10 + shift)
    H, K = 2, 24
    cu = None
    if mode == 'varlen':
        cu = torch.tensor([0, 1, 20, 20, 57, 90, 91], device=DEVICE)
        B, T, N = 1, 90 + 1, 6
    else:
        B, T = window + 1, 37
        N = B
    k = torch.randn(B, T, H, K, device=DEVICE)
    # rows of different scales: Grams far from multiples of the identity (no ties of the top eigenvalues)
    k = k * torch.rand(B, T, H, 1, device=DEVICE).mul(3).add(0.2)
    if mode == 'bf16':
        k = k.to(torch.bfloat16)
    state = None
    if mode != 'fresh':
        count = torch.tensor([n % (window + 1) for n in range(N)], dtype=torch.int32, device=DEVICE)   # 0..W
        state = FalconState(torch.zeros(N, H, K, K, device=DEVICE), torch.randn(N, H, K, device=DEVICE),
                            torch.randn(N, H, window - 1, K, device=DEVICE), None, count)
    E_ref, U_ref = _energies(window, shift, k, state, cu, blocked=False)
    E, U = _energies(window, shift, k, state, cu, blocked=True)
    n = B * T
    # every step but the first of a fresh shifted sequence has pairs (a nonzero Gram): the comparison is not vacuous
    assert (E_ref[:n] > 0).sum() >= (n - N) * H
    if DEVICE == 'cpu':
        # the interpreter sums a Gram entry in the same order in both kernels: bit for bit (a lane that squared once
        # more or less than the scalar loop would differ in the last bits)
        assert torch.equal(E[:n], E_ref[:n]) and torch.equal(U[:n], U_ref[:n])
    else:
        # compiled, the two kernels reduce over K in different orders: fp32 rounding
        torch.testing.assert_close(E[:n], E_ref[:n], rtol=1e-5, atol=0)
        torch.testing.assert_close(U[:n], U_ref[:n], rtol=0, atol=1e-5)
