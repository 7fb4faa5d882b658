# -*- coding: utf-8 -*-
"""Chunk-parallel Triton kernels of falcon3, the sliding-window regression rule (work in progress: forward).

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
``fused_recurrent``'s token-parallel kernel, the gates from falcon3a's ``_prep_fwd`` given those energies.
Virtual-row tensors (A, W, U, V') are stored chunk-major, ``[chunks * 64, HV, .]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla_falcon.ops.falcon.chunk import (
    CONFIGS,
    CONFIGS_H,
    _load_win_v,
    _load_win_x,
    _meta,
    _prep_fwd,
    _seq_info,
    _seq_span,
    _wy_diag_inv,
    _wy_lower1,
    _wy_lower2,
)
from fla_falcon.ops.falcon.fused_recurrent import NSQ, falcon_window_energy_kernel

VR = 64   # virtual rows per chunk


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


@triton.jit
def _vblock(b_xi, b_xj, b_Gxi, b_Gj, b_ci, o_ti, o_tj, T):
    """P's [16, 16] block of two virtual row blocks: rows of real steps against rows of earlier steps."""
    m = (o_ti[:, None] > o_tj[None, :]) & (o_ti < T)[:, None]
    b_kk = tl.dot(b_xi, tl.trans(b_xj))
    return tl.where(m, b_ci[:, None] * tl.exp(tl.where(m, b_Gxi[:, None] - b_Gj[None, :], 0.)) * b_kk, 0.)


@triton.jit
def _vstore(A, b_blk, vbase, i_hv, r0, c0, HV: tl.constexpr):
    o_i = tl.arange(0, 16)
    tl.store(A + ((vbase + r0 + o_i) * HV + i_hv)[:, None] * 64 + (c0 + o_i)[None, :], b_blk)


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (2, 4)], key=['H', 'HV', 'K', 'WP', 'IS_VARLEN'])
@triton.jit
def _wy_solve3(k, last_k, count, tail_x, G, c, A, cu_seqlens, chunk_indices, chunk_offsets, T,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
               WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    """A = (I + P)^-1 over the chunk's 64 virtual rows, by 16-row blocks as falcon1's _wy_solve (each block holds
    whole steps: 16 is a multiple of WP, so only the diagonal blocks see the by-step mask)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    t0 = i_t * BS
    vbase = (boh + i_t) * 64
    o_t0, _, _, b_x0, _, b_G0, b_Gx0, b_c0 = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 0, T,
                                                     H, HV, K, BK, 16, WP, WIN, SHIFT, USE_INITIAL_STATE)
    o_t1, _, _, b_x1, _, b_G1, b_Gx1, b_c1 = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 16, T,
                                                     H, HV, K, BK, 16, WP, WIN, SHIFT, USE_INITIAL_STATE)
    o_t2, _, _, b_x2, _, b_G2, b_Gx2, b_c2 = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 32, T,
                                                     H, HV, K, BK, 16, WP, WIN, SHIFT, USE_INITIAL_STATE)
    o_t3, _, _, b_x3, _, b_G3, b_Gx3, b_c3 = _vrows(k, last_k, count, tail_x, G, c, i_n, i_h, i_hv, bos, t0, 48, T,
                                                     H, HV, K, BK, 16, WP, WIN, SHIFT, USE_INITIAL_STATE)
    b_Ai00 = _wy_diag_inv(_vblock(b_x0, b_x0, b_Gx0, b_G0, b_c0, o_t0, o_t0, T))
    b_Ai10, b_Ai11 = _wy_lower1(b_Ai00, _vblock(b_x1, b_x0, b_Gx1, b_G0, b_c1, o_t1, o_t0, T),
                                _vblock(b_x1, b_x1, b_Gx1, b_G1, b_c1, o_t1, o_t1, T))
    b_Ai20, b_Ai21, b_Ai22, b_Ai30, b_Ai31, b_Ai32, b_Ai33 = _wy_lower2(
        b_Ai00, b_Ai10, b_Ai11,
        _vblock(b_x2, b_x0, b_Gx2, b_G0, b_c2, o_t2, o_t0, T), _vblock(b_x2, b_x1, b_Gx2, b_G1, b_c2, o_t2, o_t1, T),
        _vblock(b_x3, b_x0, b_Gx3, b_G0, b_c3, o_t3, o_t0, T), _vblock(b_x3, b_x1, b_Gx3, b_G1, b_c3, o_t3, o_t1, T),
        _vblock(b_x3, b_x2, b_Gx3, b_G2, b_c3, o_t3, o_t2, T),
        _vblock(b_x2, b_x2, b_Gx2, b_G2, b_c2, o_t2, o_t2, T), _vblock(b_x3, b_x3, b_Gx3, b_G3, b_c3, o_t3, o_t3, T))
    b_zero = tl.zeros([16, 16], dtype=tl.float32)
    _vstore(A, b_Ai00, vbase, i_hv, 0, 0, HV)
    _vstore(A, b_zero, vbase, i_hv, 0, 16, HV)
    _vstore(A, b_zero, vbase, i_hv, 0, 32, HV)
    _vstore(A, b_zero, vbase, i_hv, 0, 48, HV)
    _vstore(A, b_Ai10, vbase, i_hv, 16, 0, HV)
    _vstore(A, b_Ai11, vbase, i_hv, 16, 16, HV)
    _vstore(A, b_zero, vbase, i_hv, 16, 32, HV)
    _vstore(A, b_zero, vbase, i_hv, 16, 48, HV)
    _vstore(A, b_Ai20, vbase, i_hv, 32, 0, HV)
    _vstore(A, b_Ai21, vbase, i_hv, 32, 16, HV)
    _vstore(A, b_Ai22, vbase, i_hv, 32, 32, HV)
    _vstore(A, b_zero, vbase, i_hv, 32, 48, HV)
    _vstore(A, b_Ai30, vbase, i_hv, 48, 0, HV)
    _vstore(A, b_Ai31, vbase, i_hv, 48, 16, HV)
    _vstore(A, b_Ai32, vbase, i_hv, 48, 32, HV)
    _vstore(A, b_Ai33, vbase, i_hv, 48, 48, HV)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'WP', 'IS_VARLEN'])
@triton.jit
def _wy_wu3(k, v, last_k, count, tail_x, tail_v, G, c, A, Wt, U, cu_seqlens, chunk_indices, chunk_offsets, T,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, BS: tl.constexpr, WP: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
            USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """W = A diag(c exp(G_{t-1})) X and U = A diag(c) Y over the chunk's virtual rows (inputs' dtype)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    t0 = i_t * BS
    vbase = (boh + i_t) * 64
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
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BS, IS_VARLEN)
    t0 = i_t * BS
    vbase = (boh + i_t) * 64
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


def chunk_fwd_falcon3(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma, lam_coupled,
                      shift, output_final_state, cu_seqlens, window):
    """falcon3's chunk forward (window >= 2): (o, final S, saved tensors)."""
    WP = triton.next_power_of_2(window)
    BS = VR // WP
    m = _meta(q, v, BS, cu_seqlens)
    B, T, H, HV, K, V, BK, BV, NT, N = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BK', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    use_init = S0 is not None
    varlen = cu_seqlens is not None
    E = torch.empty(max(B * T, 1), H, **f32)
    if B * T > 0:
        seq_idx = None
        if varlen:
            seq_idx = torch.searchsorted(cu_seqlens, torch.arange(B * T, device=dev, dtype=cu_seqlens.dtype),
                                         right=True) - 1
        falcon_window_energy_kernel[(B * T, H)](
            k, last_k, tail_x, count, E, cu_seqlens, seq_idx, T, H=H, K=K, W=window, BK=triton.next_power_of_2(K),
            BW=WP, SHIFT=shift, USE_INITIAL_STATE=use_init, IS_VARLEN=varlen, NSQ=NSQ, num_warps=1)
    # per step: B_t, the gates from E, c = eta / B_t and G over the chunk's BS steps (falcon3a's prep kernel)
    G = torch.empty(B, T, HV, **f32)
    c = torch.empty(B, T, HV, **f32)
    win_kw = dict(H=H, HV=HV, BS=BS, WIN=window, SHIFT=int(shift), USE_INITIAL_STATE=use_init, IS_VARLEN=varlen)
    _prep_fwd[(NT, B * HV)](
        k, v, beta, lam, last_k, count, tail_x, E, G, c, cu_seqlens, ci, co, eps, eps_gamma, T, H=H, HV=HV, K=K, V=V,
        BT=BS, BK=BK, BV=BV, SHIFT=int(shift), PER_COL=False, WIN=window, HAS_LAM=lam is not None,
        LAM_COUPLED=lam_coupled, USE_INITIAL_STATE=use_init, IS_VARLEN=varlen, E_GIVEN=True)
    NV = m['NTH'] * VR
    A = torch.empty(NV, HV, VR, **f32)
    row_kw = dict(win_kw, K=K, BK=BK, WP=WP)
    _wy_solve3[(NT, B * HV)](k, last_k, count, tail_x, G, c, A, cu_seqlens, ci, co, T, **row_kw)
    Wt = torch.empty(NV, HV, K, device=dev, dtype=k.dtype)
    U = torch.empty(NV, HV, V, device=dev, dtype=k.dtype)
    _wy_wu3[(NT, B * HV)](k, v, last_k, count, tail_x, tail_v, G, c, A, Wt, U, cu_seqlens, ci, co, T, V=V, BV=BV,
                          **row_kw)
    h = torch.empty(m['NTH'], HV, K, V, device=dev, dtype=q.dtype)
    ht = torch.empty(N, HV, K, V, **f32) if output_final_state else None
    vn = torch.empty_like(U)
    _fwd_h3[lambda meta: (triton.cdiv(V, meta['BV']), N * HV)](
        k, last_k, count, tail_x, G, Wt, U, h, S0, ht, vn, cu_seqlens, co, T, V=V,
        STORE_FINAL_STATE=output_final_state, **row_kw)
    o = torch.empty_like(v)
    _fwd_o3[(triton.cdiv(V, BV), NT, B * HV)](
        q, k, last_k, count, tail_x, G, vn, h, o, scale, cu_seqlens, ci, co, T, V=V, BV=BV, BSO=max(BS, 16),
        **row_kw)
    return o, ht, (E, G, c, A, Wt, vn, h)
