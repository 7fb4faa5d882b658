# -*- coding: utf-8 -*-
"""Chunk-parallel Triton kernels of falcon3, the sliding-window regression rule (forward and backward).

Step t writes the pairs of its window ``I_t = {t-W+1..t}`` (those that exist, ``B_t`` of them) with one
coefficient ``c_t = eta_t / B_t`` and one decay ``gamma_t``, every residual at the state before the step
(``naive_chunk_falcon``'s virtual tokens). Here a chunk holds ``BS = 64 / WP`` steps (``WP``: W rounded up to a
power of two) as 64 virtual rows ``r = (step, slot a)`` with pair ``p = t - (WP - 1) + a``; slots
``a < WP - W`` are padding (zero rows). In these rows the chunk is falcon1's WY form, a gated delta rule, with
one change: a row's residual sees the writes of earlier *steps* only, so the triangular system is strictly
lower by step (its WP x WP diagonal blocks are zero). With ``G`` the in-chunk cumulative log-decay per step::

    P[r, s] = c_t(r) exp(G_{t(r)-1} - G_t(s)) x_r . x_s   for t(s) < t(r),     A = (I + P)^-1,
    W = A diag(c exp(G_{t-1})) X,   U = A diag(c) Y,   per chunk from its start state S0:  V' = U - W S0,
    S_next = exp(G_C) S0 + X^T (exp(G_C - G_t(r)) V'),
    o_t = scale (exp(G_t) q_t^T S0 + sum_{r: t(r) <= t} exp(G_t - G_t(r)) (q_t . x_r) V'_r).

Every exponent is ``G_a - G_b`` with b <= a (<= 0). The window energy ``lambda_max(X_t X_t^T) / B_t`` comes from
``_win_energy`` (windows 2..4: a chunk of BS steps per program, the eigen-iteration vectorized over them) or
``fused_recurrent``'s per-token kernel (windows 5..8), the gates from falcon3a's ``_prep_fwd`` given those energies.
Virtual-row tensors (A, W, U, V') are stored chunk-major, ``[chunks * 64, HV, .]``.

The backward is falcon1's on these rows (``_bwd_dv_local3``, ``_bwd_dhu3``, ``_bwd_dqx3``, ``_bwd_gates3``), then
``_bwd_pairs3`` sums each pair's gradient over the up to W rows that hold it. lambda_max's gradient w.r.t. the window
Gram is ``u u^T`` (u: its unit top eigenvector, stored by the forward's energy kernel), so window row b gets
``2 u_b X_t^T u`` times ``dE_t / B_t``; at a tie of the top eigenvalues (where lambda_max is not differentiable) this
is the gradient along the eigenvector the iteration found.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils import solve_tril

from fla_falcon._platform import INTERPRET
from fla_falcon.ops.falcon.chunk import (
    CONFIGS,
    CONFIGS_8W,
    CONFIGS_H,
    CONFIGS_H2,
    _gate_grads,
    _join,
    _load_win_v,
    _load_win_x,
    _meta,
    _gates_bwd,
    _prep_fwd,
    _reduce_groups,
    _run,
    _seq_info,
    _seq_span,
    _store_dk,
    _store_gates,
    _win_gates,
)
from fla_falcon.ops.falcon.fused_recurrent import NSQ, _eig2, _eig4, _load_pairs, _p_min, falcon_window_energy_kernel

VR = 64   # virtual rows per chunk
# _win_energy: a program takes a chunk's BS = 64 / WP steps (the chunk kernels' chunk indices), i.e. 64 window rows of
# [BK] fp32 live at once, with 4 warps: 32-107 registers and no stack at K = 64 / 128, W = 2-4 (aot_check, Triton 3.6,
# sm_90). 32 steps at W = 4 took 192 registers, 64 steps spilled
ENERGY_WARPS = 4


@triton.jit
def _win_row(k, last_k, tail_x, bos, o_t, m_t, p_min, i_n, i_h, o_k, b: tl.constexpr, H: tl.constexpr,
             K: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """Window row b of the steps o_t (pair t - W + 1 + b) as a [BT, BK] fp32 tile and its existence: the per-token
    kernel's _load_pairs with one row index per lane (tails and last key in fp32, as that kernel reads them)."""
    X, _, m = _load_pairs(k, k, last_k, tail_x, tail_x, bos, o_t, p_min, i_n, i_h, i_h, o_t * 0 + b, o_k,
                          tl.arange(0, 16), m_t, H, H, K, 0, WIN, SHIFT, USE_INITIAL_STATE)   # V = 0: no values
    return X, m.to(tl.float32)


@triton.jit(do_not_specialize=['T'])
def _win_energy(k, last_k, tail_x, count, E, Ue, cu_seqlens, chunk_indices, chunk_offsets, T,
                H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, WP: tl.constexpr,
                WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
                NSQ: tl.constexpr):
    """falcon_window_energy_kernel(STORE_U=True) for windows 2..4 on a block of BT steps of one key head: E_t and the
    unit top eigenvector u ([tokens, H, WP], row b at slot WP - W + b, padding slots 0) of every step's window Gram.

    The per-token kernel runs one 1-warp program per (token, head), about 1M tiny programs at (4, 4096, 16); here a
    program loads the W window rows of BT steps as [BT, BK] tiles, each Gram entry is a [BT] vector and the 4x4
    eigen-iteration runs on those lanes (_eig4's VEC form: each lane does the scalar version's operations). Windows
    5..8 keep the per-token kernel (its [BW, BW] squaring)."""
    i_n, i_t, bos, T, _ = _seq_info(tl.program_id(0), tl.program_id(1) // H, chunk_indices, cu_seqlens, chunk_offsets,
                                    T, BT, IS_VARLEN)
    i_h = tl.program_id(1) % H
    bos = bos.to(tl.int64)   # token offsets times H * K
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    c_init = 0
    if USE_INITIAL_STATE:
        c_init = tl.minimum(tl.maximum(tl.load(count + i_n).to(tl.int32), 0), WIN)
    p_min = _p_min(c_init, WIN, SHIFT)
    x0, nb = _win_row(k, last_k, tail_x, bos, o_t, m_t, p_min, i_n, i_h, o_k, 0, H, K, WIN, SHIFT, USE_INITIAL_STATE)
    x1, n1 = _win_row(k, last_k, tail_x, bos, o_t, m_t, p_min, i_n, i_h, o_k, 1, H, K, WIN, SHIFT, USE_INITIAL_STATE)
    nb += n1
    if WIN == 2:
        lmax, u0, u1 = _eig2(tl.sum(x0 * x0, 1), tl.sum(x0 * x1, 1), tl.sum(x1 * x1, 1))
    else:
        x2, n2 = _win_row(k, last_k, tail_x, bos, o_t, m_t, p_min, i_n, i_h, o_k, 2, H, K, WIN, SHIFT,
                          USE_INITIAL_STATE)
        nb += n2
        g03 = tl.zeros([BT], dtype=tl.float32)
        g13, g23, g33 = g03, g03, g03
        if WIN == 4:
            x3, n3 = _win_row(k, last_k, tail_x, bos, o_t, m_t, p_min, i_n, i_h, o_k, 3, H, K, WIN, SHIFT,
                              USE_INITIAL_STATE)
            nb += n3
            g03, g13, g23, g33 = tl.sum(x0 * x3, 1), tl.sum(x1 * x3, 1), tl.sum(x2 * x3, 1), tl.sum(x3 * x3, 1)
        lmax, u0, u1, u2, u3 = _eig4(tl.sum(x0 * x0, 1), tl.sum(x0 * x1, 1), tl.sum(x0 * x2, 1), g03,
                                     tl.sum(x1 * x1, 1), tl.sum(x1 * x2, 1), g13, tl.sum(x2 * x2, 1), g23, g33, NSQ,
                                     VEC=True)
    tl.store(E + (bos + o_t) * H + i_h, lmax / tl.maximum(nb, 1.0), mask=m_t)
    o_s = tl.arange(0, WP)[None, :] - (WP - WIN)   # window row of each slot (< 0: padding)
    b_u = tl.where(o_s == 0, u0[:, None], tl.where(o_s == 1, u1[:, None], 0.))
    if WIN > 2:
        b_u = tl.where(o_s == 2, u2[:, None], b_u)
    if WIN > 3:
        b_u = tl.where(o_s == 3, u3[:, None], b_u)
    tl.store(Ue + ((bos + o_t) * H + i_h)[:, None] * WP + tl.arange(0, WP)[None, :], b_u, mask=m_t[:, None])


@triton.jit
def _vchunk(i_t, i_bh, chunk_indices, cu_seqlens, chunk_offsets, T, H: tl.constexpr, HV: tl.constexpr,
            BS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A chunk program's sequence, value head, key head, chunk in the sequence, first token, length, first chunk of
    the sequence, first step and first virtual row."""
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    return i_n, i_hv, i_hv // (HV // H), i_t, bos, T, boh, i_t * BS, (boh + i_t) * 64


@triton.jit
def _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, r0, T, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, BK: tl.constexpr, NR: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr,
           SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """NR virtual rows from r0 of the chunk whose first step is t0: their steps o_t and pairs o_p, the pairs'
    existence, x ([NR, BK], zero rows where no pair), G_t, G_{t-1} (0 on the chunk's first step) and c_t."""
    o_r = r0 + tl.arange(0, NR)
    o_t = t0 + o_r // WP
    o_p = o_t - (WP - 1) + o_r % WP
    m_t = o_t < T
    m_p = m_t & ((o_r % WP) >= WP - WIN)
    b_x, valid = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, H, K, BK, WIN, SHIFT,
                             USE_INITIAL_STATE)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_Gx = tl.load(G + (bos + o_t - 1) * HV + i_hv, mask=m_t & (o_t > t0), other=0)
    b_c = tl.load(c + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    return o_t, o_p, m_p, b_x, valid, b_G, b_Gx, b_c


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8)], key=['H', 'HV', 'K', 'WP', 'IS_VARLEN'])
@triton.jit
def _wy_p3(k, last_k, count, tail_x, G, c, P, cu_seqlens, chunk_indices, chunk_offsets, T,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
           WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
           IS_VARLEN: tl.constexpr, ROUND_TF32: tl.constexpr):
    """P of the chunk's 64 virtual rows in fp32, one [64, 64] product: P[r, s] = c_t(r) exp(G_{t(r)-1} - G_t(s))
    x_r . x_s for t(s) < t(r) (strictly lower by step), zero rows past the sequence; fla's solve_tril inverts I + P."""
    i_n, i_hv, i_h, i_t, bos, T, boh, t0, vbase = _vchunk(tl.program_id(0), tl.program_id(1), chunk_indices,
                                                           cu_seqlens, chunk_offsets, T, H, HV, BS, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_t, _, _, b_x, _, b_G, b_Gx, b_c = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 0, T,
                                               H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
    m = (o_t[:, None] > o_t[None, :]) & (o_t < T)[:, None]
    if (b_x.dtype == tl.float32) & ROUND_TF32:
        # fp32 keys on a GPU (ROUND_TF32: the interpreter multiplies fp32 exactly, as in every other product). Hopper's
        # wgmma (a 64-row product) drops the low 13 bits of TF32 operands, where the 16-row products of the form
        # before (mma.sync) rounded them to nearest (cvt.rna). With the truncated Gram test_zero_keys[falcon3]'s dbeta
        # ended 0.503% off the reference on the H200 (tolerance 0.5%). So the keys are rounded to TF32 as mma.sync
        # does, then multiplied (wgmma's truncation then drops only zero bits): one product, where tf32x3 took three
        # for the same test results (twenty-first / twenty-second leases; test_matches_fused_recurrent's fp32 dlast_k
        # stayed 0.535% from the fused recurrent kernel with either, so the Gram is not that error's source)
        b_xr = ((b_x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
        b_kk = tl.dot(b_xr, tl.trans(b_xr))
    else:
        b_kk = tl.dot(b_x, tl.trans(b_x))
    b_P = tl.where(m, b_c[:, None] * tl.exp(tl.where(m, b_Gx[:, None] - b_G[None, :], 0.)) * b_kk, 0.)
    tl.store(P + ((vbase + o_r) * HV + i_hv)[:, None] * 64 + o_r[None, :], b_P)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _wy_wu3(k, v, last_k, count, tail_x, tail_v, G, c, A, Wt, U, cu_seqlens, chunk_indices, chunk_offsets, T,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, BS: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
            USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """W = A diag(c exp(G_{t-1})) X and U = A diag(c) Y over the chunk's virtual rows (inputs' dtype)."""
    i_n, i_hv, i_h, i_t, bos, T, boh, t0, vbase = _vchunk(tl.program_id(0), tl.program_id(1), chunk_indices,
                                                           cu_seqlens, chunk_offsets, T, H, HV, BS, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_t, o_p, m_p, b_x, valid, b_G, b_Gx, b_c = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 0, T,
                                                       H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
    dt = k.dtype.element_ty
    b_A = tl.load(A + ((vbase + o_r) * HV + i_hv)[:, None] * 64 + o_r[None, :]).to(dt)
    b_w = tl.dot(b_A, (b_x * (b_c * tl.exp(b_Gx))[:, None]).to(dt))
    tl.store(Wt + ((vbase + o_r) * HV + i_hv)[:, None] * K + o_k[None, :], b_w.to(Wt.dtype.element_ty),
             mask=(o_k < K)[None, :])
    b_cv = tl.where(valid, b_c, 0.)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_y = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_p, m_p, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        b_u = tl.dot(b_A, (b_y * b_cv[:, None]).to(dt))
        tl.store(U + ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :], b_u.to(U.dtype.element_ty),
                 mask=(o_v < V)[None, :])


@triton.autotune(configs=CONFIGS_H, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _fwd_h3(k, last_k, count, tail_x, G, Wt, U, h, h0, ht, vn, cu_seqlens, chunk_offsets, T,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, BS: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
            USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequential over chunks: stores h (chunk-start states) and V' = U - W S0, advances the state."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    dt = k.dtype.element_ty
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)
    for i_t in range(NT):
        tl.store(h + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        t0 = i_t * BS
        vbase = (boh + i_t) * 64
        last = min(t0 + BS, T) - 1
        o_t, o_p, m_p, b_x, valid, b_G, b_Gx, b_c = _vrows(k, last_k, count, tail_x, G, G, i_n, i_h, i_hv, bos, t0,
                                                           0, T, H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
        b_Gl = tl.load(G + (bos + last) * HV + i_hv)
        b_w = tl.load(Wt + ((vbase + o_r) * HV + i_hv)[:, None] * K + o_k[None, :], mask=(o_k < K)[None, :], other=0)
        p_rv = ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_u = tl.load(U + p_rv, mask=(o_v < V)[None, :], other=0).to(tl.float32)
        b_u -= tl.dot(b_w, b_h.to(b_w.dtype))
        tl.store(vn + p_rv, b_u.to(vn.dtype.element_ty), mask=(o_v < V)[None, :])
        b_u = b_u * tl.where(o_t < T, tl.exp(b_Gl - b_G), 0.)[:, None]
        b_h = b_h * tl.exp(b_Gl) + tl.dot(tl.trans(b_x), b_u.to(dt))
    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * HV + i_hv) * K * V + p_kv, b_h, mask=m_kv)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _fwd_o3(q, k, last_k, count, tail_x, G, vn, h, o, scale, cu_seqlens, chunk_indices, chunk_offsets, T,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, BS: tl.constexpr, BSO: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr,
            SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """o_t = scale (exp(G_t) q_t^T S0 + sum_{r: t(r) <= t} exp(G_t - G_t(r)) (q_t . x_r) V'_r) for the chunk's
    steps (BSO >= 16 output rows: dot tiles; those past BS are masked)."""
    i_v = tl.program_id(0)
    i_n, i_hv, i_h, i_t, bos, T, boh, t0, vbase = _vchunk(tl.program_id(1), tl.program_id(2), chunk_indices,
                                                           cu_seqlens, chunk_offsets, T, H, HV, BS, IS_VARLEN)
    o_s = tl.arange(0, BSO)
    o_t = t0 + o_s
    m_t = (o_s < BS) & (o_t < T)
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_q = tl.load(q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                  other=0)
    b_Gt = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    o_tr, _, _, b_x, _, b_Gr, _, _ = _vrows(k, last_k, count, tail_x, G, G, i_n, i_h, i_hv, bos, t0, 0, T,
                                            H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
    b_h = tl.load(h + ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k < K)[:, None] & m_v[None, :], other=0)
    b_o = tl.dot(b_q, b_h.to(b_q.dtype)) * tl.exp(b_Gt)[:, None]
    # real output steps only: a padded row reads G = 0, and exp(0 - G_r) overflows for strong decay
    m_s = m_t[:, None] & (o_tr[None, :] <= o_t[:, None])
    b_S = tl.where(m_s, tl.dot(b_q, tl.trans(b_x)) * tl.exp(tl.where(m_s, b_Gt[:, None] - b_Gr[None, :], 0.)), 0.)
    b_vn = tl.load(vn + ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0)
    b_o += tl.dot(b_S.to(b_vn.dtype), b_vn)
    tl.store(o + ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


def _win_meta(q, v, window, S0, cu_seqlens, shift):
    """Shapes and chunking of falcon3's kernels: (meta, WP, BS, the kernels' common constexprs)."""
    WP = triton.next_power_of_2(window)
    BS = VR // WP
    m = _meta(q, v, BS, cu_seqlens)
    row_kw = dict(H=m['H'], HV=m['HV'], K=m['K'], V=m['V'], BK=m['BK'], BS=BS, WP=WP, WIN=window, SHIFT=int(shift),
                  USE_INITIAL_STATE=S0 is not None, IS_VARLEN=cu_seqlens is not None)
    return m, WP, BS, row_kw


def _window_energy(k, last_k, tail_x, count, window, shift, use_init, cu_seqlens, chunk_indices, chunk_offsets,
                   blocked=None):
    """falcon3's window energies E ([tokens, H]) and top eigenvectors Ue ([tokens, H, WP]) from the keys: _win_energy
    per chunk of BS steps (chunk_indices / chunk_offsets: _win_meta's) for windows 2..4, else (or with
    blocked=False) fused_recurrent's per-token kernel."""
    B, T, H, K = k.shape
    WP = triton.next_power_of_2(window)
    BS = VR // WP
    varlen = cu_seqlens is not None
    f32 = dict(device=k.device, dtype=torch.float32)
    E = torch.empty(max(B * T, 1), H, **f32)
    Ue = torch.empty(max(B * T, 1), H, WP, **f32)   # each window's top eigenvector, for the energy's gradient
    if B * T == 0:
        return E, Ue
    if blocked is None:
        blocked = window <= 4
    if blocked:
        NT = len(chunk_indices) if varlen else triton.cdiv(T, BS)
        _win_energy[(NT, B * H)](
            k, last_k, tail_x, count, E, Ue, cu_seqlens, chunk_indices, chunk_offsets, T, H=H, K=K,
            BK=triton.next_power_of_2(K), BT=BS, WP=WP, WIN=window, SHIFT=shift, USE_INITIAL_STATE=use_init,
            IS_VARLEN=varlen, NSQ=NSQ, num_warps=ENERGY_WARPS)
    else:
        seq_idx = None
        if varlen:
            seq_idx = torch.searchsorted(cu_seqlens, torch.arange(B * T, device=k.device, dtype=cu_seqlens.dtype),
                                         right=True) - 1
        falcon_window_energy_kernel[(B * T, H)](
            k, last_k, tail_x, count, E, Ue, cu_seqlens, seq_idx, T, H=H, K=K, W=window,
            BK=triton.next_power_of_2(K), BW=WP, SHIFT=shift, USE_INITIAL_STATE=use_init, IS_VARLEN=varlen, NSQ=NSQ,
            STORE_U=True, num_warps=1)
    return E, Ue


def _win_gates_and_A(q, k, v, beta, lam, S0, last_k, tail_x, count, eps, eps_gamma, lam_coupled, shift, cu_seqlens,
                     window):
    """The part of falcon3's forward every chunk form shares: the window energies (E, Ue), the gates (G over each
    chunk of BS steps, c = eta / B_t) and A = (I + P)^-1 of each chunk's 64 virtual rows.
    Returns (meta, WP, BS, row_kw, E, Ue, G, c, A) (_win_meta's first four)."""
    m, WP, BS, row_kw = _win_meta(q, v, window, S0, cu_seqlens, shift)
    B, T, H, HV, K, V, BK, BV, NT = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BK', 'BV', 'NT'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    f32 = dict(device=q.device, dtype=torch.float32)
    use_init = S0 is not None
    varlen = cu_seqlens is not None
    E, Ue = _window_energy(k, last_k, tail_x, count, window, shift, use_init, cu_seqlens, ci, co)
    # per step: B_t, the gates from E, c = eta / B_t and G over the chunk's BS steps (falcon3a's prep kernel)
    G = torch.empty(B, T, HV, **f32)
    c = torch.empty(B, T, HV, **f32)
    _prep_fwd[(NT, B * HV)](
        k, v, beta, lam, last_k, count, tail_x, E, G, c, None, None, None, None, cu_seqlens, ci, co, eps, eps_gamma, T,
        H=H, HV=HV, K=K, V=V,
        BT=BS, BK=BK, BV=BV, SHIFT=int(shift), PER_COL=False, WIN=window, HAS_LAM=lam is not None,
        LAM_COUPLED=lam_coupled, USE_INITIAL_STATE=use_init, IS_VARLEN=varlen, E_GIVEN=True)
    NV = m['NTH'] * VR
    # A = (I + P)^-1: P from one [64, 64] product per chunk, inverted by fla's solve_tril (its 16-row diagonal blocks
    # read their rows back from memory, not out of register tiles), A in the inputs' dtype: _wy_wu3 and _bwd_gates3
    # only read it as a matmul operand in that dtype. The virtual rows are chunk-major, 64 per chunk, so they are one
    # sequence of NV rows to solve_tril
    P = torch.empty(NV, HV, VR, **f32)
    _wy_p3[(NT, B * HV)](k, last_k, count, tail_x, G, c, P, cu_seqlens, ci, co, T, ROUND_TF32=not INTERPRET,
                         **{x: y for x, y in row_kw.items() if x != 'V'})
    A = solve_tril(P.view(1, NV, HV, VR), output_dtype=k.dtype).view(NV, HV, VR)
    return m, WP, BS, row_kw, E, Ue, G, c, A


def chunk_fwd_falcon3(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma, lam_coupled,
                      shift, output_final_state, cu_seqlens, window, outputs=None, gates=None, fork=None):
    """falcon3's chunk forward (window >= 2): (o, final S, saved tensors). The backward's recomputation passes
    ``outputs`` (``()``: no output kernel, o None) and ``gates``, the saved (E, Ue, G, c, A), which it does not form
    again, and may pass ``fork`` (chunk.py's _Fork): the state pass on its stream."""
    if gates is None:
        m, WP, BS, row_kw, E, Ue, G, c, A = _win_gates_and_A(q, k, v, beta, lam, S0, last_k, tail_x, count, eps,
                                                             eps_gamma, lam_coupled, shift, cu_seqlens, window)
    else:
        m, WP, BS, row_kw = _win_meta(q, v, window, S0, cu_seqlens, shift)
        E, Ue, G, c, A = gates
    B, T, HV, K, V, BV, NT, N = (m[x] for x in ('B', 'T', 'HV', 'K', 'V', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    NV = m['NTH'] * VR
    Wt = torch.empty(NV, HV, K, device=dev, dtype=k.dtype)
    U = torch.empty(NV, HV, V, device=dev, dtype=k.dtype)
    _wy_wu3[(NT, B * HV)](k, v, last_k, count, tail_x, tail_v, G, c, A, Wt, U, cu_seqlens, ci, co, T, BV=BV, **row_kw)
    h = torch.empty(m['NTH'], HV, K, V, device=dev, dtype=q.dtype)
    ht = torch.empty(N, HV, K, V, **f32) if output_final_state else None
    vn = torch.empty_like(U)
    args = (k, last_k, count, tail_x, G, Wt, U, h, S0, ht, vn, cu_seqlens, co)

    _run(fork, lambda: _fwd_h3[lambda meta: (triton.cdiv(V, meta['BV']), N * HV)](
        *args, T, STORE_FINAL_STATE=output_final_state, **row_kw), args)
    if outputs is not None:
        return None, ht, (E, Ue, G, c, A, Wt, vn, h)
    o = torch.empty_like(v)
    _fwd_o3[(triton.cdiv(V, BV), NT, B * HV)](
        q, k, last_k, count, tail_x, G, vn, h, o, scale, cu_seqlens, ci, co, T, BV=BV, BSO=max(BS, 16), **row_kw)
    return o, ht, (E, Ue, G, c, A, Wt, vn, h)


# ----------------------------------------------------------------------------------------------
# backward: falcon1's (the WY form's) in virtual rows. The outputs are per step (BS rows, q and do), the writes
# per virtual row (x, V', W, A); masks go by step. Per-row gradients of x and y land in buffers dXr, dYr
# ([chunks * 64, HV, .], the inputs' dtype); _bwd_pairs3 sums the up to W rows of each pair into dk and dv in fp32.
# The gates' sums run per step: a row's contribution goes to its step through a [BS, 64] selection.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _steps(q, G, i_h, i_hv, bos, t0, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
           BS: tl.constexpr, BSO: tl.constexpr):
    """The chunk's output steps (BSO >= 16 rows for the dot tiles; those past BS are masked): t, mask, q, G_t."""
    o_s = tl.arange(0, BSO)
    o_t = t0 + o_s
    m_t = (o_s < BS) & (o_t < T)
    o_k = tl.arange(0, BK)
    b_q = tl.load(q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                  other=0)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    return o_t, m_t, b_q, b_G


@triton.jit
def _row_steps(b_r, o_tr, o_ts):
    """Per-step sums ([len(o_ts)]) of the per-virtual-row values b_r (rows of steps o_tr)."""
    return tl.sum(tl.where(o_tr[None, :] == o_ts[:, None], b_r[None, :], 0.), 1)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _bwd_dv_local3(q, k, last_k, count, tail_x, G, do, du, scale, cu_seqlens, chunk_indices, chunk_offsets, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, BS: tl.constexpr, BSO: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr,
                   SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dV' from the outputs of the same chunk: dV'_r = scale sum_{t >= t(r)} exp(G_t - G_t(r)) (x_r . q_t) do_t."""
    i_v = tl.program_id(0)
    i_n, i_hv, i_h, i_t, bos, T, boh, t0, vbase = _vchunk(tl.program_id(1), tl.program_id(2), chunk_indices,
                                                           cu_seqlens, chunk_offsets, T, H, HV, BS, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_tq, m_tq, b_q, b_Gq = _steps(q, G, i_h, i_hv, bos, t0, T, H, HV, K, BK, BS, BSO)
    o_t, _, _, b_x, _, b_G, _, _ = _vrows(k, last_k, count, tail_x, G, G, i_n, i_h, i_hv, bos, t0, 0, T,
                                          H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
    m_s = (o_t[:, None] <= o_tq[None, :]) & m_tq[None, :]   # real output steps only (see _fwd_o3)
    b_st = tl.where(m_s, tl.dot(b_x, tl.trans(b_q)) * tl.exp(tl.where(m_s, b_Gq[None, :] - b_G[:, None], 0.)),
                    0.) * scale
    b_do = tl.load(do + ((bos + o_tq) * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_tq[:, None] & m_v[None, :],
                   other=0)
    b_du = tl.dot(b_st.to(b_do.dtype), b_do)
    tl.store(du + ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :], b_du.to(du.dtype.element_ty),
             mask=m_v[None, :])


@triton.autotune(configs=CONFIGS_H2, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'], restore_value=['du'])
@triton.jit
def _bwd_dhu3(q, k, last_k, count, tail_x, G, Wt, do, du, dh, dht, dh0, scale, cu_seqlens, chunk_offsets, T,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, BS: tl.constexpr, BSO: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr,
              SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
              IS_VARLEN: tl.constexpr):
    """Reverse over chunks: dh[c] = gradient of the state at the end of chunk c; adds the state path
    exp(G_C - G_t(r)) x_r dh to dV' and takes dS0 -= W^T dV' (V' = U - W S0), as falcon1's _bwd_dhu."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = (o_k < K)[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)
    for i_t in range(NT - 1, -1, -1):
        tl.store(dh + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        t0 = i_t * BS
        vbase = (boh + i_t) * 64
        last = min(t0 + BS, T) - 1
        o_tq, m_tq, b_q, b_Gq = _steps(q, G, i_h, i_hv, bos, t0, T, H, HV, K, BK, BS, BSO)
        o_t, _, _, b_x, _, b_G, _, _ = _vrows(k, last_k, count, tail_x, G, G, i_n, i_h, i_hv, bos, t0, 0, T,
                                              H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
        b_Gl = tl.load(G + (bos + last) * HV + i_hv)
        b_do = tl.load(do + ((bos + o_tq) * HV + i_hv)[:, None] * V + o_v[None, :],
                       mask=m_tq[:, None] & m_v[None, :], other=0)
        b_dod = (b_do * (tl.exp(b_Gq) * scale)[:, None]).to(b_q.dtype)
        b_dh_next = b_dh
        b_dh = b_dh * tl.exp(b_Gl) + tl.dot(tl.trans(b_q), b_dod)
        p_rv = ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_du = tl.load(du + p_rv, mask=m_v[None, :], other=0).to(tl.float32)
        b_du += tl.dot(b_x, b_dh_next.to(b_q.dtype)) * tl.where(o_t < T, tl.exp(b_Gl - b_G), 0.)[:, None]
        tl.store(du + p_rv, b_du.to(du.dtype.element_ty), mask=m_v[None, :])
        b_w = tl.load(Wt + ((vbase + o_r) * HV + i_hv)[:, None] * K + o_k[None, :], mask=(o_k < K)[None, :], other=0)
        b_dh -= tl.dot(tl.trans(b_w), b_du.to(b_w.dtype))
    if USE_INITIAL_STATE:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + p_kv, b_dh, mask=m_kv)


# one config: its only loop is not pipelined (see below), so CONFIGS_8W's 2 and 3 stages compiled the same kernel twice
@triton.autotune(configs=[triton.Config({}, num_warps=8, num_stages=2)], key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _bwd_dqx3(q, k, last_k, count, tail_x, G, vn, h, dh, do, du, dq, dx, dG, dw, scale,
              cu_seqlens, chunk_indices, chunk_offsets, T,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, BS: tl.constexpr, BSO: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr,
              SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per chunk, as falcon1's _bwd_dqx: dq per step; per virtual row the output/state part of dx and
    dW = -dV' h^T; the decay gradient of those paths per step (q.dq - sum of the step's rows' x.dx, plus
    <S_next, dS_next> on the last step)."""
    i_n, i_hv, i_h, i_t, bos, T, boh, t0, vbase = _vchunk(tl.program_id(0), tl.program_id(1), chunk_indices,
                                                           cu_seqlens, chunk_offsets, T, H, HV, BS, IS_VARLEN)
    last = min(t0 + BS, T) - 1
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_tq, m_tq, b_q, b_Gq = _steps(q, G, i_h, i_hv, bos, t0, T, H, HV, K, BK, BS, BSO)
    o_t, _, _, b_x, _, b_G, _, _ = _vrows(k, last_k, count, tail_x, G, G, i_n, i_h, i_hv, bos, t0, 0, T,
                                          H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
    b_Gl = tl.load(G + (bos + last) * HV + i_hv)
    dt = b_q.dtype
    b_dq = tl.zeros([BSO, BK], dtype=tl.float32)
    b_dxs = tl.zeros([64, BK], dtype=tl.float32)
    b_dw = tl.zeros([64, BK], dtype=tl.float32)
    b_ds = tl.zeros([BSO, 64], dtype=tl.float32)
    b_dst = tl.zeros([64, BSO], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    # not pipelined (num_stages=1): h, dh, do and u each feed both an asynchronous wgmma (the 64-row products) and
    # register code (the 16-row steps' mma.sync operands, <h, dh>), and Triton 3.6's pipeliner then gives their tiles
    # one shared-memory slot too few: the next block's copy overwrote a slot a wgmma still read
    # (scripts/wgmma_hazards.py; see _bwd_dqx in chunk.py). The loop has 2 iterations at V = 128
    for i_v in tl.range(0, tl.cdiv(V, BV), num_stages=1):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(h + p_kv, mask=m_k[:, None] & m_v[None, :], other=0)
        b_dh = tl.load(dh + p_kv, mask=m_k[:, None] & m_v[None, :], other=0)
        b_do = tl.load(do + ((bos + o_tq) * HV + i_hv)[:, None] * V + o_v[None, :],
                       mask=m_tq[:, None] & m_v[None, :], other=0).to(dt)
        p_rv = ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_du = tl.load(du + p_rv, mask=m_v[None, :], other=0)
        b_u = tl.load(vn + p_rv, mask=m_v[None, :], other=0).to(dt)
        b_dw += tl.dot(b_du.to(dt), tl.trans(b_h.to(dt)))
        b_dq += tl.dot(b_do, tl.trans(b_h.to(dt)))
        b_ds += tl.dot(b_do, tl.trans(b_u))
        b_dst += tl.dot(b_u, tl.trans(b_do))
        b_dxs += tl.dot(b_u, tl.trans(b_dh.to(dt)))
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    m_s = (o_t[None, :] <= o_tq[:, None]) & m_tq[:, None]    # [step, row], real steps only
    b_ds = tl.where(m_s, b_ds * tl.exp(tl.where(m_s, b_Gq[:, None] - b_G[None, :], 0.)), 0.) * scale
    b_dq = b_dq * (tl.exp(b_Gq) * scale)[:, None] + tl.dot(b_ds.to(dt), b_x)
    b_dGq = tl.sum(b_q.to(tl.float32) * b_dq, 1)
    tl.store(dq + ((bos + o_tq) * HV + i_hv)[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_tq[:, None] & m_k[None, :])
    m_st = (o_t[:, None] <= o_tq[None, :]) & m_tq[None, :]   # [row, step]
    b_dst = tl.where(m_st, b_dst * tl.exp(tl.where(m_st, b_Gq[None, :] - b_G[:, None], 0.)), 0.) * scale
    b_xf = b_x.to(tl.float32)
    b_dxs = b_dxs * tl.where(o_t < T, tl.exp(b_Gl - b_G), 0.)[:, None]
    b_end = tl.exp(b_Gl) * tl.sum(b_hdh, 0) + tl.sum(tl.sum(b_xf * b_dxs, 1), 0)
    b_dx = b_dxs + tl.dot(b_dst.to(dt), b_q)
    p_rk = ((vbase + o_r) * HV + i_hv)[:, None] * K + o_k[None, :]
    tl.store(dx + p_rk, b_dx.to(dx.dtype.element_ty), mask=m_k[None, :])
    tl.store(dw + p_rk, (-b_dw).to(dw.dtype.element_ty), mask=m_k[None, :])
    b_dGq += tl.where(o_tq == last, b_end, 0.) - _row_steps(tl.sum(b_xf * b_dx, 1), o_t, o_tq)
    tl.store(dG + (bos + o_tq) * HV + i_hv, b_dGq, mask=m_tq)


@triton.autotune(configs=CONFIGS_8W, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _bwd_gates3(k, v, beta, lam, last_k, count, tail_x, tail_v, E, Ue, G, c, A, dP, dx, dG, dw, du, dXr, dYr,
                dbeta, dlam, eps, eps_gamma, cu_seqlens, chunk_indices, chunk_offsets, T,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, BS: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
                HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    """falcon1's WY backward (_bwd_gates) in virtual rows: dx and dy of every row (fp32, 0 where no pair) into dXr
    and dYr; per step the sums of dG, of the direct gradient of g and of dc, then the gates' chain rule
    (deta = dc / B_t; dbeta, dlam) and the energy's: E_t = lambda_max / B_t with top eigenvector u (from the
    forward) gives dx_r += (2 dE_t / B_t) u_r w_t, w_t = sum over the step's rows u_r x_r."""
    i_n, i_hv, i_h, i_t, bos, T, boh, t0, vbase = _vchunk(tl.program_id(0), tl.program_id(1), chunk_indices,
                                                           cu_seqlens, chunk_offsets, T, H, HV, BS, IS_VARLEN)
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t, o_p, m_p, b_x, valid, b_G, b_Gx, b_c = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 0,
                                                       T, H, HV, K, BK, 64, WP, WIN, SHIFT, USE_INITIAL_STATE)
    dt = b_x.dtype
    b_xf = b_x.to(tl.float32)
    b_b = b_c * tl.exp(b_Gx)
    b_cv = tl.where(valid, b_c, 0.)
    p_A = ((vbase + o_r) * HV + i_hv)[:, None] * 64 + o_r[None, :]
    # A^T through transposed pointers (row s of A^T is column s of A)
    p_At = ((vbase + o_r) * HV + i_hv)[None, :] * 64 + o_r[:, None]
    b_At = tl.load(A + p_At).to(dt)
    # W = A diag(b) X, U = A diag(c) Y: dA = dV' (cY)^T + dW (bX)^T
    b_dA = tl.zeros([64, 64], dtype=tl.float32)
    b_dc = tl.zeros([64], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_y = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_p, m_p, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        p_rv = ((vbase + o_r) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_du = tl.load(du + p_rv, mask=m_v[None, :], other=0).to(dt)
        b_dA += tl.dot(b_du, tl.trans((b_y * b_cv[:, None]).to(dt)))
        b_Atdu = tl.dot(b_At, b_du)
        tl.store(dYr + p_rv, (b_Atdu * b_cv[:, None]).to(dYr.dtype.element_ty), mask=m_v[None, :])
        b_dc += tl.sum(b_Atdu * b_y, 1)
    b_dc = tl.where(valid, b_dc, 0.)
    p_rk = ((vbase + o_r) * HV + i_hv)[:, None] * K + o_k[None, :]
    b_dw = tl.load(dw + p_rk, mask=m_k[None, :], other=0).to(dt)
    b_dA += tl.dot(b_dw, tl.trans((b_xf * b_b[:, None]).to(dt)))
    # A = (I + P)^-1: dP = -A^T dA A^T on the part strictly lower by step
    b_dL = -tl.dot(tl.dot(b_At, b_dA.to(dt)).to(dt), b_At)
    m_l = (o_t[:, None] > o_t[None, :]) & (o_t < T)[:, None]
    b_F = tl.where(m_l, tl.exp(tl.where(m_l, b_Gx[:, None] - b_G[None, :], 0.)), 0.)
    b_P = b_dL * b_F * b_c[:, None]
    # P^T through a scratch buffer: a transposed dot result fed into tl.dot miscompiles on Hopper
    tl.store(dP + p_A, b_P.to(dP.dtype.element_ty))
    b_dx = tl.dot(b_P.to(dt), b_x)
    b_R = b_dL * b_F * tl.dot(b_x, tl.trans(b_x))
    b_dc += tl.sum(b_R, 1)
    b_Q = b_R * b_c[:, None]
    # per row: its share of dG of its step (the exponents G_{t-1} of its P row, G_t of its P column) and of the
    # direct gradient of g_t (G_{t-1} = G_t - g_t inside the chunk)
    b_z = tl.sum(b_Q, 1) - tl.sum(b_Q, 0)
    b_zd = -tl.sum(b_Q, 1)
    tl.debug_barrier()
    b_Pt = tl.load(dP + p_At)
    b_dx += tl.dot(b_Pt.to(dt), b_x)
    b_Atdw = tl.dot(b_At, b_dw)
    b_db = tl.sum(b_Atdw * b_xf, 1)
    b_dx += tl.load(dx + p_rk, mask=m_k[None, :], other=0).to(tl.float32) + b_Atdw * b_b[:, None]
    b_dc += b_db * tl.exp(b_Gx)
    b_z += b_db * b_b
    b_zd -= b_db * b_b
    # the step's gates
    o_ts = t0 + tl.arange(0, BS)
    m_ts = o_ts < T
    b_dG = tl.load(dG + (bos + o_ts) * HV + i_hv, mask=m_ts, other=0) + _row_steps(b_z, o_t, o_ts)
    valid_s, b_rB, b_E, b_lp, b_den, b_eta, b_a, clamped, b_g = _win_gates(
        k, last_k, count, tail_x, beta, lam, E, i_n, i_h, i_hv, bos, o_ts, m_ts, eps, eps_gamma, H, HV, K, BK, WIN,
        SHIFT, HAS_LAM, LAM_COUPLED, USE_INITIAL_STATE, True)
    b_dbeta, b_dlp, b_dden = _gates_bwd(b_dG, _row_steps(b_zd, o_t, o_ts), _row_steps(b_dc, o_t, o_ts) * b_rB,
                                        b_lp, b_den, b_eta, b_a, clamped, valid_s)
    _store_gates(b_dbeta, b_dlp, b_E, dbeta, dlam, bos, o_ts, m_ts, i_hv, HV, HAS_LAM, LAM_COUPLED)
    # the energy: d lambda_max = u^T dGram u, so dx_r += (2 dE_t / B_t) u_r sum_{rows s of t} u_s x_s
    b_wE = tl.sum(tl.where(o_ts[:, None] == o_t[None, :], (2 * b_dden * b_rB)[:, None], 0.), 0)
    b_u = tl.load(Ue + ((bos + o_t) * H + i_h) * WP + o_r % WP, mask=o_t < T, other=0)
    b_Us = tl.where(o_t[:, None] == o_t[None, :], b_u[None, :], 0.)
    b_dx += (b_wE * b_u)[:, None] * tl.dot(b_Us.to(dt), b_x)
    tl.store(dXr + p_rk, tl.where(valid[:, None], b_dx, 0.).to(dXr.dtype.element_ty), mask=m_k[None, :])


@triton.jit
def _bwd_pairs3(dXr, dYr, dk, dv, dlast_k, dtail_x, dtail_v, cu_seqlens, chunk_indices, chunk_offsets, T,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
                BS: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
                USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dk and dv of the chunk's pairs p (and at a sequence start of the carried tail's, p < 0): the sums of the
    rows that hold them, slot WP - 1 - d of step p + d for d < W (in this chunk or the next: a sequence's virtual
    rows are contiguous, row (t, a) at 64 * first chunk + WP * t + a), in a fixed order."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    o_p = i_t * BS + tl.arange(0, BS)
    m_p = o_p < T
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    b_dx = tl.zeros([BS, BK], dtype=tl.float32)
    b_dy = tl.zeros([BS, BVF], dtype=tl.float32)
    for d in tl.static_range(WIN):
        m_r = m_p & (o_p + d < T)
        r = boh * 64 + (o_p + d) * WP + WP - 1 - d
        b_dx += tl.load(dXr + (r * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :],
                        other=0).to(tl.float32)
        b_dy += tl.load(dYr + (r * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_r[:, None] & (o_v < V)[None, :],
                        other=0).to(tl.float32)
    _store_dk(b_dx, m_p, dk, dlast_k, i_n, i_t, i_hv, bos, o_p, m_p, T, HV, K, BK, SHIFT, USE_INITIAL_STATE)
    tl.store(dv + ((bos + o_p) * HV + i_hv)[:, None] * V + o_v[None, :], b_dy.to(dv.dtype.element_ty),
             mask=m_p[:, None] & (o_v < V)[None, :])
    if USE_INITIAL_STATE:
        if i_t == 0:
            # the tail's pairs p = -(W - 1) .. -1 (rows of steps 0 .. p + W - 1); names of their own: a Triton
            # variable keeps its shape across an if block ([8] here, [BS] above)
            o_j = tl.arange(0, 8)
            p = o_j - 8
            m_j = p >= -(WIN - 1)
            b_tx = tl.zeros([8, BK], dtype=tl.float32)
            b_ty = tl.zeros([8, BVF], dtype=tl.float32)
            for e in tl.static_range(1, WIN):
                m_rj = m_j & (p + e >= 0) & (p + e < T)
                r_j = boh * 64 + (p + e) * WP + WP - 1 - e
                b_tx += tl.load(dXr + (r_j * HV + i_hv)[:, None] * K + o_k[None, :],
                                mask=m_rj[:, None] & (o_k < K)[None, :], other=0).to(tl.float32)
                b_ty += tl.load(dYr + (r_j * HV + i_hv)[:, None] * V + o_v[None, :],
                                mask=m_rj[:, None] & (o_v < V)[None, :], other=0).to(tl.float32)
            row = (i_n * HV + i_hv) * (WIN - 1) + WIN - 1 + p
            tl.store(dtail_x + row[:, None] * K + o_k[None, :], b_tx, mask=m_j[:, None] & (o_k < K)[None, :])
            tl.store(dtail_v + row[:, None] * V + o_v[None, :], b_ty, mask=m_j[:, None] & (o_v < V)[None, :])


def chunk_bwd_falcon3(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, saved, do, dht, scale, eps, eps_gamma,
                      lam_coupled, shift, cu_seqlens, window, fork=None):
    """falcon3's chunk backward: (dq, dk, dv, dbeta, dlam, dS0, dlast_k, dtail_x, dtail_v). fork: the stream still
    recomputing h (chunk.py's _Fork), joined before _bwd_dqx3: _bwd_dv_local3 and _bwd_dhu3 do not read h."""
    E, Ue, G, c, A, Wt, vn, h = saved
    m, WP, BS, row_kw = _win_meta(q, v, window, S0, cu_seqlens, shift)
    B, T, H, HV, K, V, BV, NT, N = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    use_init = S0 is not None
    BSO = max(BS, 16)
    do = do.contiguous()
    NV = m['NTH'] * VR
    # the virtual-row buffers ([chunks * 64, HV, .], four times falcon1's rows at window 4) in the inputs' dtype, as
    # falcon1's dU, dx and dW: every one is formed in fp32 inside a kernel, and dU, dW, A and dP are only read back
    # as matmul operands in that dtype, so with bf16 inputs an fp32 buffer doubled their memory traffic
    rdt = q.dtype
    du = torch.empty(NV, HV, V, device=dev, dtype=rdt)
    _bwd_dv_local3[(triton.cdiv(V, BV), NT, B * HV)](
        q, k, last_k, count, tail_x, G, do, du, scale, cu_seqlens, ci, co, T, BV=BV, BSO=BSO, **row_kw)
    dh = torch.empty_like(h)
    dh0 = torch.empty(N, HV, K, V, **f32) if use_init else None
    _bwd_dhu3[lambda meta: (triton.cdiv(V, meta['BV']), N * HV)](
        q, k, last_k, count, tail_x, G, Wt, do, du, dh, dht, dh0, scale, cu_seqlens, co, T, BSO=BSO,
        USE_FINAL_STATE_GRADIENT=dht is not None, **row_kw)
    _join(fork)
    # key-side gradients are per value head; with grouped heads they are summed afterwards in fp32
    kdt = q.dtype if HV == H else torch.float32
    dq = torch.empty(B, T, HV, K, device=dev, dtype=kdt)
    dx = torch.empty(NV, HV, K, device=dev, dtype=rdt)
    dw = torch.empty(NV, HV, K, device=dev, dtype=rdt)
    dG = torch.empty(B, T, HV, **f32)
    # bf16 values of 65-128 columns in one 128-wide block, here and in _bwd_gates3: _bwd_dqx3's value loop runs
    # unpipelined (the wgmma hazard, see the kernel), so each iteration waits for its own loads, and one block waits
    # once (214-255 registers, no stack at K = 64 / 128, V = 128, aot_check sm_90; fp32, or two 128-wide blocks at
    # V = 256, spill 120-144 B); _bwd_gates3 takes 182-252 registers, no stack. Narrower values keep _meta's 64-wide
    # block (MIN_BLOCK). H200, (4, 4096, 16, 128, 128) bf16: _bwd_gates3 1817 -> 1603 us, _bwd_dqx3 1344 -> 1343
    bv = 128 if q.element_size() <= 2 and 64 < V <= 128 else BV
    _bwd_dqx3[(NT, B * HV)](q, k, last_k, count, tail_x, G, vn, h, dh, do, du, dq, dx, dG, dw, scale,
                            cu_seqlens, ci, co, T, BV=bv, BSO=BSO, **row_kw)
    dXr = torch.empty(NV, HV, K, device=dev, dtype=rdt)
    dYr = torch.empty(NV, HV, V, device=dev, dtype=rdt)
    dbeta, dlam = _gate_grads(beta, lam)
    _bwd_gates3[(NT, B * HV)](
        k, v, beta, lam, last_k, count, tail_x, tail_v, E, Ue, G, c, A, torch.empty_like(A), dx, dG, dw, du, dXr,
        dYr, dbeta, dlam, eps, eps_gamma, cu_seqlens, ci, co, T, BV=bv, HAS_LAM=lam is not None,
        LAM_COUPLED=lam_coupled, **row_kw)
    # every row of dk is written (_store_dk: the zero gradient of a sequence's last key too)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=kdt)
    dv = torch.empty_like(v)
    dlast_k = torch.zeros(N, HV, K, **f32) if use_init else None
    dtail_x = torch.zeros(N, HV, window - 1, K, **f32) if use_init else None
    dtail_v = torch.zeros(N, HV, window - 1, V, **f32) if use_init else None
    _bwd_pairs3[(NT, B * HV)](dXr, dYr, dk, dv, dlast_k, dtail_x, dtail_v, cu_seqlens, ci, co, T,
                              BVF=max(triton.next_power_of_2(V), 16), **{x: y for x, y in row_kw.items() if x != 'H'})
    return _reduce_groups(dq, dk, dv, dbeta, dlam, dh0, dlast_k, H, HV, dtail_x) + (dtail_v,)
