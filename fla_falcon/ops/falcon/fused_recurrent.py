# -*- coding: utf-8 -*-
"""Fused recurrent Triton kernels (forward and backward) of the six Falcon rules.

One forward kernel and one backward kernel cover every rule through ``tl.constexpr`` flags
(``REGRESSION``, ``PER_COLUMN``, window size ``W``, ``SHIFT``, ``USE_LAM``, ``LAM_COUPLED``,
``IS_VARLEN``, ``USE_INITIAL_STATE``, ``STORE_FINAL_STATE``). The grid is (V blocks, N * HV): a
program owns a ``[K, BV]`` slice of one head's fp32 state and the full key dimension, because the
regression residual ``S^T x`` and the key statistics need all of K.

Window. The pairs of step t (local index, 0-based) sit at positions ``p = t-W+1 .. t``; pair p is
``(k_{p-1}, v_p)`` with the shift (``(k_p, v_p)`` without), the previous segment's ``last_k`` for
``p = 0``, and row ``W-1+p`` of the initial state's ``tail_x/tail_v`` for ``p < 0``. Pair p is real
iff ``p >= p_min``, where ``p_min`` follows from the initial ``count`` (see ``_p_min``). The kernel
re-reads the (at most W) pairs of each step from global memory (L1/L2 hits): the forward row by row
(``_load_row``, straight into the layouts of the state's rows and columns, each pair once per step),
the backward as ``[BW, K]`` / ``[BW, BV]`` tiles (``_load_pairs``). A step without a pair (the first
step of a fresh sequence with the shift) gets ``eta = 0``, hence ``gamma = 1`` and no write: the state
passes through exactly.

falcon3's energy is ``lambda_max(X X^T) / B_t`` from the ``B_t x B_t`` Gram of the window (the
missing pairs of a short window are zero rows, which leave lambda_max unchanged):

- ``W <= 2``: closed form.
- ``W = 3, 4``: scalar code (each thread holds the 10 Gram entries, no cross-thread traffic)
  squaring the trace-normalized Gram, ``M <- M^2 / tr(M^2)`` (a power iteration whose exponent
  doubles each time; entries stay in [0, 1]), until no entry moves by more than ``EIG_TOL = 1e-6``
  or after ``NSQ = 16`` squarings (exponent ``2^16``). The top eigenvector u is the column of the
  converged projector with the largest diagonal, and ``lambda_max = u^T G u`` (a Rayleigh quotient:
  its error is quadratic in u's). Tolerance: at exit u leaks at most ~``2e-6`` (or
  ``(l2/l1)^(2^16)``) into the other eigenvectors, so lambda_max is exact to fp32 rounding unless the
  top two eigenvalues tie to ~1e-4 relative, where the quotient is still within
  ``(l1 - l2) * leak^2`` of l1 (at a tie the gradient, ill-defined there, uses a vector of the top
  eigenspace).
  The chunk path (chunk_win's ``_win_energy``) runs the same iteration on ``[BT]`` vectors of tokens
  (``_eig4(..., VEC=True)``: each lane does exactly the scalar loop's operations).
- ``W > 4``: the same squaring on ``[BW, BW]`` register tensors, 16 squarings.

Backward (exact, checkpointed recomputation). The backward kernel first re-runs the forward from
the initial state and stores the state at the start of every chunk of ``C`` steps (``C`` about
``sqrt(T)``, 8..64). Then, chunk by chunk in reverse, it recomputes the chunk's pre-update states
``S_{t-1}`` into a per-head scratch buffer (``C`` states) and walks the chunk backwards carrying
``dS`` in registers: every term that needs ``S_{t-1}`` (dq through ``S_t``, the decay gradient
``<S_{t-1}, dS_t>``, the regression residual terms) reads it from the scratch. Extra memory is
``(ceil(T/C) + C)`` states per head, i.e. O(sqrt(T)) states instead of O(T). Gradients of a pair
``(x_j, y_j)`` (shared by up to W steps, by the V blocks and by the grouped value heads) are
accumulated with fp32 atomics and routed to ``k``/``v``, the initial ``last_k`` or the initial tail.
The decay clamp passes no gradient through ``alpha`` when active; with ``lam_coupled`` the factor E
of ``lam * E`` is a statistic (gradient to ``lam`` only); ``d lambda_max / dG = u u^T``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from fla_falcon.ops.falcon.utils import (
    DEFAULT_EPS,
    DEFAULT_EPS_GAMMA,
    FalconState,
    rule_info,
    validate_falcon_inputs,
)

NSQ = 16  # at most this many Gram squarings for falcon3's lambda_max with windows > 2 (module docstring)
EIG_TOL = tl.constexpr(1e-6)  # windows 3-4: stop squaring once no normalized entry moves by more


# ----------------------------------------------------------------------------------------------
# shared device helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _p_min(c0, W: tl.constexpr, SHIFT: tl.constexpr):
    """First real pair position of a segment whose initial state has count ``c0``."""
    if SHIFT:
        # count tokens seen: last_k is pair 0 and the tail holds count-1 older pairs
        return tl.where(c0 > 0, 1 - c0, 1)
    else:
        return -tl.minimum(c0, W - 1)


@triton.jit
def _pair_src(p, real, SHIFT: tl.constexpr):
    """Where pair p (scalar or vector; ``real``: the pair exists) comes from, the one rule for the tile
    and the row loaders: x is row ``src`` of k where ``in_k`` (else last_k for p = 0 with the shift, a
    tail row for p < 0), y is row p of v where ``in_v`` (else a tail row)."""
    if SHIFT:
        src = p - 1
        in_k = real & (p >= 1)
    else:
        src = p
        in_k = real & (p >= 0)
    return src, in_k, real & (p >= 0)


@triton.jit
def _pair_ptrs(k, v, lk0, tx0, tv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v, row_mask,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
               SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """Pointers and masks of the window rows of step t (row b is pair ``p = t-W+1+b``).

    Returns (pointers, masks) of the x rows in k / last_k / tail_x and of the y rows in v / tail_v,
    and the row mask of the real pairs. Exactly one source mask is on for a real row.
    """
    p = t - (W - 1) + o_w
    m = row_mask & (o_w < W) & (p >= p_min)
    mk = o_k < K
    mv = o_v < V
    src, m_k, m_y = _pair_src(p, m, SHIFT)
    px_k = k + ((bos + src) * H + i_h)[:, None] * K + o_k[None, :]
    py_v = v + ((bos + p) * HV + i_hv)[:, None] * V + o_v[None, :]
    m_xk = m_k[:, None] & mk[None, :]
    m_yv = m_y[:, None] & mv[None, :]
    # last_k (pair 0 with the shift) and tail rows (p < 0) exist only with an initial state
    px_l, m_xl, px_t, m_xt, py_t, m_yt = px_k, m_xk & False, px_k, m_xk & False, py_v, m_yv & False
    if USE_INITIAL_STATE:
        row = W - 1 + p
        if SHIFT:
            px_l = lk0 + (i_n * H + i_h) * K + o_k[None, :] + 0 * o_w[:, None]
            m_xl = (m & (p == 0))[:, None] & mk[None, :]
        if W > 1:
            px_t = tx0 + ((i_n * H + i_h) * (W - 1) + row)[:, None] * K + o_k[None, :]
            m_xt = (m & (p < 0))[:, None] & mk[None, :]
            py_t = tv0 + ((i_n * HV + i_hv) * (W - 1) + row)[:, None] * V + o_v[None, :]
            m_yt = (m & (p < 0))[:, None] & mv[None, :]
    return px_k, m_xk, px_l, m_xl, px_t, m_xt, py_v, m_yv, py_t, m_yt, m


@triton.jit
def _load_pairs(k, v, lk0, tx0, tv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v, row_mask,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """X ``[BW, BK]`` and Y ``[BW, BV]`` of step t in fp32 (zero rows for missing pairs), row mask."""
    px_k, m_xk, px_l, m_xl, px_t, m_xt, py_v, m_yv, py_t, m_yt, m = _pair_ptrs(
        k, v, lk0, tx0, tv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v, row_mask,
        H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
    X = tl.load(px_k, mask=m_xk, other=0).to(tl.float32)
    Y = tl.load(py_v, mask=m_yv, other=0).to(tl.float32)
    if USE_INITIAL_STATE:
        if SHIFT:
            X += tl.load(px_l, mask=m_xl, other=0).to(tl.float32)
        if W > 1:
            X += tl.load(px_t, mask=m_xt, other=0).to(tl.float32)
            Y += tl.load(py_t, mask=m_yt, other=0).to(tl.float32)
    return X, Y, m


@triton.jit
def _load_row(k, v, lk0, tx0, tv0, bos, p, p_min, i_n, i_h, i_hv, o_k, o_v, mk,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
              SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """x ``[BK]`` and y ``[BV]`` of the window pair at position p (a scalar; fp32, zeros for a missing
    pair; x only where ``mk``) and whether the pair is real. The sources of ``_pair_src`` for one
    row, loaded straight into the layouts of the state's rows and columns (no tile to extract from).
    Scalar conditions enter the masks through ``tl.where`` (the interpreter turns ``vector & scalar``
    into int32)."""
    real = p >= p_min
    mv = o_v < V
    src, in_k, in_v = _pair_src(p, real, SHIFT)
    x = tl.load(k + ((bos + src) * H + i_h) * K + o_k, mask=tl.where(in_k, mk, False), other=0).to(tl.float32)
    m_y = tl.where(in_v, mv, False)
    y = tl.load(v + ((bos + p) * HV + i_hv) * V + o_v, mask=m_y, other=0).to(tl.float32)
    if USE_INITIAL_STATE:
        # an x of the initial state (last_k for p = 0 with the shift, a tail row for p < 0): both fp32,
        # so one load from a pointer picked per row rather than one masked load per source
        p_l = lk0 + (i_n * H + i_h) * K
        if W > 1:
            in_t = real & (p < 0)
            p_t = tx0 + ((i_n * H + i_h) * (W - 1) + W - 1 + p) * K
            if SHIFT:
                p_s = tl.where(p == 0, p_l, p_t)
                m_s = tl.where(real & (p <= 0), mk, False)
            else:
                p_s = p_t
                m_s = tl.where(in_t, mk, False)
            x += tl.load(p_s + o_k, mask=m_s, other=0).to(tl.float32)
            m_t = tl.where(in_t, mv, False)
            y += tl.load(tv0 + ((i_n * HV + i_hv) * (W - 1) + W - 1 + p) * V + o_v, mask=m_t, other=0).to(tl.float32)
        elif SHIFT:
            x += tl.load(p_l + o_k, mask=tl.where(real & (p == 0), mk, False), other=0).to(tl.float32)
    return x, y, real


@triton.jit
def _add_pair_grads(dk, dv, dlk0, dtx0, dtv0, dX, dY, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v,
                    row_mask, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    W: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                    ADD_X: tl.constexpr, ADD_Y: tl.constexpr):
    """Accumulates the gradients of the window rows of step t where their pairs came from (atomics:
    a pair is shared by W steps, the V blocks and the grouped value heads)."""
    px_k, m_xk, px_l, m_xl, px_t, m_xt, py_v, m_yv, py_t, m_yt, m = _pair_ptrs(
        dk, dv, dlk0, dtx0, dtv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v, row_mask,
        H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
    if ADD_X:
        tl.atomic_add(px_k, dX, mask=m_xk)
        if USE_INITIAL_STATE:
            if SHIFT:
                tl.atomic_add(px_l, dX, mask=m_xl)
            if W > 1:
                tl.atomic_add(px_t, dX, mask=m_xt)
    if ADD_Y:
        tl.atomic_add(py_v, dY, mask=m_yv)
        if USE_INITIAL_STATE:
            if W > 1:
                tl.atomic_add(py_t, dY, mask=m_yt)


@triton.jit
def _row(X, o_w, i: tl.constexpr):
    return tl.sum(tl.where(o_w[:, None] == i, X, 0.), 0)


@triton.jit
def _sq4(a00, a01, a02, a03, a11, a12, a13, a22, a23, a33):
    """(A^2) / tr(A^2) of a symmetric 4x4 matrix given by its upper triangle (scalars)."""
    b00 = a00 * a00 + a01 * a01 + a02 * a02 + a03 * a03
    b01 = a00 * a01 + a01 * a11 + a02 * a12 + a03 * a13
    b02 = a00 * a02 + a01 * a12 + a02 * a22 + a03 * a23
    b03 = a00 * a03 + a01 * a13 + a02 * a23 + a03 * a33
    b11 = a01 * a01 + a11 * a11 + a12 * a12 + a13 * a13
    b12 = a01 * a02 + a11 * a12 + a12 * a22 + a13 * a23
    b13 = a01 * a03 + a11 * a13 + a12 * a23 + a13 * a33
    b22 = a02 * a02 + a12 * a12 + a22 * a22 + a23 * a23
    b23 = a02 * a03 + a12 * a13 + a22 * a23 + a23 * a33
    b33 = a03 * a03 + a13 * a13 + a23 * a23 + a33 * a33
    tr = b00 + b11 + b22 + b33
    inv = 1.0 / tl.where(tr > 0, tr, 1.0)
    return b00 * inv, b01 * inv, b02 * inv, b03 * inv, b11 * inv, b12 * inv, b13 * inv, b22 * inv, b23 * inv, b33 * inv


@triton.jit
def _eig2(a, b, c):
    """lambda_max and unit top eigenvector (u0, u1) of the symmetric 2x2 Gram [[a, b], [b, c]] (closed form)."""
    lmax = 0.5 * (a + c) + tl.sqrt(0.25 * (a - c) * (a - c) + b * b)
    # two candidate eigenvectors (l-c, b) and (b, l-a): the longer one is well conditioned
    n1 = (lmax - c) * (lmax - c) + b * b
    n2 = b * b + (lmax - a) * (lmax - a)
    use1 = n1 >= n2
    u0 = tl.where(use1, lmax - c, b)
    u1 = tl.where(use1, b, lmax - a)
    nn = tl.where(use1, n1, n2)
    inv = 1.0 / tl.sqrt(tl.where(nn > 0, nn, 1.0))
    u0 = tl.where(nn > 0, u0 * inv, 1.0)
    u1 = tl.where(nn > 0, u1 * inv, 0.0)
    return lmax, u0, u1


@triton.jit
def _sq4_step(a00, a01, a02, a03, a11, a12, a13, a22, a23, a33):
    """One squaring (``_sq4``) and the largest change of an entry: the body of the eigen-iterations."""
    b00, b01, b02, b03, b11, b12, b13, b22, b23, b33 = _sq4(a00, a01, a02, a03, a11, a12, a13, a22, a23, a33)
    delta = tl.maximum(tl.maximum(tl.maximum(tl.abs(b00 - a00), tl.abs(b11 - a11)),
                                  tl.maximum(tl.abs(b22 - a22), tl.abs(b33 - a33))),
                       tl.maximum(tl.maximum(tl.abs(b01 - a01), tl.abs(b02 - a02)),
                                  tl.maximum(tl.abs(b03 - a03), tl.abs(b12 - a12))))
    delta = tl.maximum(delta, tl.maximum(tl.abs(b13 - a13), tl.abs(b23 - a23)))
    return b00, b01, b02, b03, b11, b12, b13, b22, b23, b33, delta


@triton.jit
def _top4(a00, a01, a02, a03, a11, a12, a13, a22, a23, a33, g00, g01, g02, g03, g11, g12, g13, g22, g23, g33):
    """lambda_max and unit top eigenvector (u0..u3) of the Gram g from its converged normalized power a
    (elementwise: scalars or vectors alike)."""
    # the column of the converged projector with the largest diagonal is the top eigenvector
    u0, u1, u2, u3, best = a00, a01, a02, a03, a00
    pick = a11 > best
    u0, u1, u2, u3, best = (tl.where(pick, a01, u0), tl.where(pick, a11, u1), tl.where(pick, a12, u2),
                            tl.where(pick, a13, u3), tl.where(pick, a11, best))
    pick = a22 > best
    u0, u1, u2, u3, best = (tl.where(pick, a02, u0), tl.where(pick, a12, u1), tl.where(pick, a22, u2),
                            tl.where(pick, a23, u3), tl.where(pick, a22, best))
    pick = a33 > best
    u0, u1, u2, u3 = (tl.where(pick, a03, u0), tl.where(pick, a13, u1), tl.where(pick, a23, u2),
                      tl.where(pick, a33, u3))
    nn = u0 * u0 + u1 * u1 + u2 * u2 + u3 * u3
    inv = 1.0 / tl.sqrt(tl.where(nn > 0, nn, 1.0))
    u0 = tl.where(nn > 0, u0 * inv, 1.0)
    u1, u2, u3 = u1 * inv, u2 * inv, u3 * inv
    # Rayleigh quotient with the unnormalized Gram
    lmax = (u0 * (g00 * u0 + g01 * u1 + g02 * u2 + g03 * u3) + u1 * (g01 * u0 + g11 * u1 + g12 * u2 + g13 * u3)
            + u2 * (g02 * u0 + g12 * u1 + g22 * u2 + g23 * u3) + u3 * (g03 * u0 + g13 * u1 + g23 * u2 + g33 * u3))
    return lmax, u0, u1, u2, u3


@triton.jit
def _eig4(g00, g01, g02, g03, g11, g12, g13, g22, g23, g33, NSQ: tl.constexpr, VEC: tl.constexpr = False):
    """lambda_max and unit top eigenvector (u0..u3) of a symmetric 4x4 Gram given by its upper triangle, by
    squaring with an early exit once the normalized power has converged (module docstring).

    Scalars (every thread holds the whole matrix: no cross-thread traffic), or with VEC ``[n]`` vectors of n
    independent Grams (lanes): the loop then runs while any lane is unconverged and freezes converged ones,
    so that each lane goes through exactly the scalar version's operations (same squarings, same exit)."""
    tr = g00 + g11 + g22 + g33
    inv = 1.0 / tl.where(tr > 0, tr, 1.0)
    a00, a01, a02, a03, a11 = g00 * inv, g01 * inv, g02 * inv, g03 * inv, g11 * inv
    a12, a13, a22, a23, a33 = g12 * inv, g13 * inv, g22 * inv, g23 * inv, g33 * inv
    delta = tr * 0 + 1.0
    it = 0
    if VEC:
        # live lanes counted, not tl.max(delta): a NaN lane stops itself (as the scalar loop would), not the others
        while (tl.max((delta > EIG_TOL).to(tl.int32), 0) > 0) & (it < NSQ):
            b00, b01, b02, b03, b11, b12, b13, b22, b23, b33, d = _sq4_step(a00, a01, a02, a03, a11, a12, a13,
                                                                             a22, a23, a33)
            live = delta > EIG_TOL
            a00, a01, a02, a03 = (tl.where(live, b00, a00), tl.where(live, b01, a01), tl.where(live, b02, a02),
                                  tl.where(live, b03, a03))
            a11, a12, a13 = tl.where(live, b11, a11), tl.where(live, b12, a12), tl.where(live, b13, a13)
            a22, a23, a33 = tl.where(live, b22, a22), tl.where(live, b23, a23), tl.where(live, b33, a33)
            delta = tl.where(live, d, delta)
            it += 1
    else:
        while (delta > EIG_TOL) & (it < NSQ):
            a00, a01, a02, a03, a11, a12, a13, a22, a23, a33, delta = _sq4_step(a00, a01, a02, a03, a11, a12, a13,
                                                                                 a22, a23, a33)
            it += 1
    return _top4(a00, a01, a02, a03, a11, a12, a13, a22, a23, a33, g00, g01, g02, g03, g11, g12, g13, g22, g23, g33)


@triton.jit
def _rows_eig(x0, x1, x2, x3, W: tl.constexpr, NSQ: tl.constexpr):
    """lambda_max and unit top eigenvector (u0..u3) of the Gram of a window's rows x0..x{W-1} (W = 2, 3 or 4;
    rows past W are ignored: pass any tensor)."""
    if W == 2:
        lmax, u0, u1 = _eig2(tl.sum(x0 * x0, 0), tl.sum(x0 * x1, 0), tl.sum(x1 * x1, 0))
        u2 = u1 * 0
        u3 = u2
    else:
        g03, g13, g23, g33 = 0.0, 0.0, 0.0, 0.0
        if W == 4:
            g03, g13 = tl.sum(x0 * x3, 0), tl.sum(x1 * x3, 0)
            g23, g33 = tl.sum(x2 * x3, 0), tl.sum(x3 * x3, 0)
        lmax, u0, u1, u2, u3 = _eig4(tl.sum(x0 * x0, 0), tl.sum(x0 * x1, 0), tl.sum(x0 * x2, 0), g03,
                                     tl.sum(x1 * x1, 0), tl.sum(x1 * x2, 0), g13, tl.sum(x2 * x2, 0), g23, g33, NSQ)
    return lmax, u0, u1, u2, u3


@triton.jit
def _top_eig(X, o_w, W: tl.constexpr, NSQ: tl.constexpr):
    """lambda_max and unit top eigenvector ``u [BW]`` of the window Gram ``X X^T`` (rows of X are the
    pairs' x; missing pairs are zero rows)."""
    if W <= 4:
        x0 = _row(X, o_w, 0)
        x1 = _row(X, o_w, 1)
        x2 = _row(X, o_w, 2) if W >= 3 else x0
        x3 = _row(X, o_w, 3) if W == 4 else x0
        lmax, u0, u1, u2, u3 = _rows_eig(x0, x1, x2, x3, W, NSQ)
        u = tl.where(o_w == 0, u0, tl.where(o_w == 1, u1, tl.where(o_w == 2, u2, tl.where(o_w == 3, u3, 0.0))))
    else:
        G = tl.sum(X[:, None, :] * X[None, :, :], 2)
        ii = o_w[:, None]
        jj = o_w[None, :]
        eye = ii == jj
        tr = tl.sum(tl.sum(tl.where(eye, G, 0.), 1), 0)
        M = G / tl.where(tr > 0, tr, 1.0)
        for _ in tl.static_range(NSQ):
            # M <- M^2 / tr(M^2): a power iteration with exponent 2^NSQ; tr(M^2) >= 1/BW for a
            # normalized PSD M, so nothing under- or overflows
            M = tl.sum(M[:, :, None] * M[None, :, :], 1)
            tr2 = tl.sum(tl.sum(tl.where(eye, M, 0.), 1), 0)
            M = M / tl.where(tr2 > 0, tr2, 1.0)
        d = tl.sum(tl.where(eye, M, 0.), 1)
        jm = tl.argmax(d, 0)
        col = tl.sum(tl.where(jj == jm, M, 0.), 1)
        nrm = tl.sqrt(tl.sum(col * col, 0))
        u = tl.where(nrm > 0, col / tl.where(nrm > 0, nrm, 1.0), tl.where(o_w == 0, 1.0, 0.0))
        lmax = tl.sum(u * tl.sum(G * u[None, :], 1), 0)
    return lmax, u


@triton.jit
def _gates(nb, E, b_beta, b_lam, eps, eps_gamma, USE_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr):
    """The step's gates from its number of real pairs ``nb`` and energy ``E``. ``b_beta`` is a scalar
    or ``[BV]`` (per-column rules)."""
    nb_s = tl.maximum(nb, 1.0)
    if USE_LAM:
        if LAM_COUPLED:
            lam_eff = b_lam * E
        else:
            lam_eff = b_lam
    else:
        lam_eff = 0.0 * E
    den = E + lam_eff + eps
    ok = (den > 0) & (nb > 0)
    den_s = tl.where(ok, den, 1.0)
    eta = tl.where(ok, b_beta / den_s, 0.0)
    alpha = eta * lam_eff
    free = alpha <= 1 - eps_gamma          # the clamp is inactive: gradient flows through alpha
    gamma = 1 - tl.where(free, alpha, 1 - eps_gamma)
    c = eta / nb_s
    return nb_s, lam_eff, den_s, ok, eta, free, gamma, c


@triton.jit
def _coeffs(X, m, b_beta, b_lam, eps, eps_gamma, o_w, W: tl.constexpr, REGRESSION: tl.constexpr,
            USE_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr, NSQ: tl.constexpr):
    """The step's statistics and gates from its window tile X (rows m real); ``u`` is falcon3's top
    eigenvector (0 otherwise)."""
    nb = tl.sum(m.to(tl.float32), 0)
    nb_s = tl.maximum(nb, 1.0)
    u = tl.zeros_like(o_w).to(tl.float32)
    if W == 1:
        E = tl.sum(tl.sum(X * X, 1), 0)
    elif REGRESSION:
        lmax, u = _top_eig(X, o_w, W, NSQ)
        E = lmax / nb_s
    else:
        E = tl.sum(tl.sum(X * X, 1), 0) / nb_s
    nb_s, lam_eff, den_s, ok, eta, free, gamma, c = _gates(nb, E, b_beta, b_lam, eps, eps_gamma, USE_LAM,
                                                           LAM_COUPLED)
    return nb_s, E, u, lam_eff, den_s, ok, eta, free, gamma, c


@triton.jit
def _step(S, X, Y, gamma, c, o_w, W: tl.constexpr, REGRESSION: tl.constexpr, PER_COLUMN: tl.constexpr):
    """S_t = gamma S_{t-1} + X^T (R * c) with R the residual at S_{t-1} (or Y). Returns S_t, R*c, R.

    Row by row (one [K, BV] pass per pair, like a delta-rule step) rather than through [W, K, BV]
    temporaries: it keeps the register footprint, hence the occupancy of a decode step, low."""
    R = Y
    if REGRESSION:
        for b in tl.static_range(W):
            x_b = _row(X, o_w, b)
            z_b = tl.sum(S * x_b[:, None], 0)                   # all residuals at the pre-update S
            R = R - tl.where(o_w[:, None] == b, z_b[None, :], 0.)
    if PER_COLUMN:
        Wc = R * c[None, :]
        S = S * gamma[None, :]
    else:
        Wc = R * c
        S = S * gamma
    for b in tl.static_range(W):
        S += _row(X, o_w, b)[:, None] * _row(Wc, o_w, b)[None, :]
    return S, Wc, R


@triton.jit
def _load_gates(beta, lam, bos, t, i_hv, o_v, HV: tl.constexpr, V: tl.constexpr,
                PER_COLUMN: tl.constexpr, USE_LAM: tl.constexpr):
    if PER_COLUMN:
        b_beta = tl.load(beta + ((bos + t) * HV + i_hv) * V + o_v, mask=o_v < V, other=0).to(tl.float32)
    else:
        b_beta = tl.load(beta + (bos + t) * HV + i_hv).to(tl.float32)
    if USE_LAM:
        b_lam = tl.load(lam + (bos + t) * HV + i_hv).to(tl.float32)
    else:
        b_lam = 0.0
    return b_beta, b_lam


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=['T'])
def falcon_window_energy_kernel(k, lk0, tx0, c0, E, U, cu_seqlens, seq_idx, T,
                                H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                                BW: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                                IS_VARLEN: tl.constexpr, NSQ: tl.constexpr, STORE_U: tl.constexpr = False):
    """falcon3's window energy ``E_t = lambda_max(X_t X_t^T) / B_t`` of one (token, key head).

    It depends on the keys only, not on the state, so it runs token-parallel before the recurrence;
    the forward kernel then reads it instead of recomputing it in each of its value-block programs.
    STORE_U: also the unit top eigenvector u ([tokens, H, BW], window row b at slot BW - W + b, the padding
    slots 0), whose outer product u u^T is lambda_max's gradient w.r.t. the Gram (the chunk backward's)."""
    i_j, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if IS_VARLEN:
        i_n = tl.load(seq_idx + i_j).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    else:
        i_n = i_j // T
        bos = i_n * T
    t = i_j - bos
    o_k = tl.arange(0, BK)
    o_w = tl.arange(0, BW)
    o_v = tl.arange(0, 16)   # no value rows: V = 0 masks every value load off
    c_init = 0
    if USE_INITIAL_STATE:
        c_init = tl.minimum(tl.maximum(tl.load(c0 + i_n).to(tl.int32), 0), W)
    p_min = _p_min(c_init, W, SHIFT)
    X, _, m = _load_pairs(k, k, lk0, tx0, tx0, bos, t, p_min, i_n, i_h, i_h, o_w, o_k, o_v, o_w >= 0,
                          H, H, K, 0, W, SHIFT, USE_INITIAL_STATE)
    lmax, u = _top_eig(X, o_w, W, NSQ)
    tl.store(E + i_j * H + i_h, lmax / tl.maximum(tl.sum(m.to(tl.float32), 0), 1.0))
    if STORE_U:
        tl.store(U + (i_j * H + i_h) * BW + BW - W + o_w, u, mask=o_w < W)
        tl.store(U + (i_j * H + i_h) * BW + o_w, tl.zeros_like(u), mask=o_w < BW - W)


@triton.jit(do_not_specialize=['T'])
def falcon_fused_recurrent_fwd_kernel(
    q, k, v, beta, lam, o,
    S0, lk0, tx0, tv0, c0,
    St, lkt, txt, tvt, ct, E,
    cu_seqlens, scale, eps, eps_gamma, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    REGRESSION: tl.constexpr, PER_COLUMN: tl.constexpr, SHIFT: tl.constexpr,
    USE_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, INLINE_E: tl.constexpr, NSQ: tl.constexpr,
):
    # INLINE_E (falcon3, windows 2-4): each program computes the window's lambda_max from the rows it holds
    # instead of reading E; for decoding, where one launch less matters more than the repeated 4x4 eigenproblem
    i_v, i_nh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
    else:
        bos = i_n * T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    c_init = 0
    if USE_INITIAL_STATE:
        b_S += tl.load(S0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=mask_h, other=0).to(tl.float32)
        c_init = tl.minimum(tl.maximum(tl.load(c0 + i_n).to(tl.int32), 0), W)  # read clamped into [0, W]
    p_min = _p_min(c_init, W, SHIFT)

    key_owner = (i_v == 0) & (i_hv % (HV // H) == 0)   # the program that writes per-key-head outputs
    for t in range(0, T):
        b_beta, b_lam = _load_gates(beta, lam, bos, t, i_hv, o_v, HV, V, PER_COLUMN, USE_LAM)
        # the window row by row, each pair loaded once and kept in registers (x_b, and r_b = y_b - S^T x_b
        # for the regression rules: every residual at the pre-update state); no [W, K] tile whose rows
        # would have to be extracted and moved into the state's layout
        xs = ()
        rs = ()
        nb = 0.0
        b_e = 0.0
        for b in tl.static_range(W):
            b_x, b_y, real = _load_row(k, v, lk0, tx0, tv0, bos, t - (W - 1) + b, p_min, i_n, i_h, i_hv, o_k, o_v,
                                       mask_k, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
            nb += real.to(tl.float32)
            if REGRESSION:
                b_y -= tl.sum(b_S * b_x[:, None], 0)
            if (W == 1) | (not REGRESSION):
                b_e += tl.sum(b_x * b_x, 0)
            xs = xs + (b_x,)
            rs = rs + (b_y,)
        if W == 1:
            b_E = b_e
        elif REGRESSION and INLINE_E:
            # falcon3's lambda_max / B_t from the window rows in registers (missing pairs are zero rows)
            lmax, _, _, _, _ = _rows_eig(xs[0], xs[1], xs[2 % W], xs[3 % W], W, NSQ)
            b_E = lmax / tl.maximum(nb, 1.0)
        elif REGRESSION:
            # falcon3's lambda_max / B_t, once per (token, key head) by falcon_window_energy_kernel
            b_E = tl.load(E + (bos + t) * H + i_h)
        else:
            b_E = b_e / tl.maximum(nb, 1.0)
        nb_s, lam_eff, den_s, ok, eta, free, gamma, c = _gates(nb, b_E, b_beta, b_lam, eps, eps_gamma, USE_LAM,
                                                               LAM_COUPLED)
        # S_t = gamma S_{t-1} + sum_b x_b (c r_b)^T
        if PER_COLUMN:
            b_S = b_S * gamma[None, :]
        else:
            b_S = b_S * gamma
        for b in tl.static_range(W):
            b_S += xs[b][:, None] * (rs[b] * c)[None, :]
        b_q = tl.load(q + ((bos + t) * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
        b_o = tl.sum(b_S * b_q[:, None], 0) * scale
        tl.store(o + ((bos + t) * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)

    if STORE_FINAL_STATE:
        tl.store(St + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_S.to(St.dtype.element_ty), mask=mask_h)
        if W > 1:
            # the tail = the pairs of a virtual step T but its newest, reloaded once the state is stored (its
            # registers are free then; for T > 0 the rows are cache hits of the last step). x only in the
            # program that stores it
            m_xo = tl.where(key_owner, mask_k, False)
            for b in tl.static_range(W - 1):
                b_x, b_y, real = _load_row(k, v, lk0, tx0, tv0, bos, T - (W - 1) + b, p_min, i_n, i_h, i_hv,
                                           o_k, o_v, m_xo, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
                tl.store(tvt + ((i_n * HV + i_hv) * (W - 1) + b) * V + o_v, b_y.to(tvt.dtype.element_ty),
                         mask=mask_v)
                tl.store(txt + ((i_n * H + i_h) * (W - 1) + b) * K + o_k, b_x.to(txt.dtype.element_ty), mask=m_xo)
        if key_owner:
            # last key seen (the shift's next x), the initial one for an empty segment
            b_lk = tl.zeros([BK], dtype=tl.float32)
            T_k = tl.zeros_like(o_k) + T    # T as a tensor (a plain int under the interpreter)
            b_lk += tl.load(k + ((bos + T - 1) * H + i_h) * K + o_k, mask=mask_k & (T_k > 0), other=0).to(tl.float32)
            if USE_INITIAL_STATE:
                b_lk += tl.load(lk0 + (i_n * H + i_h) * K + o_k, mask=mask_k & (T_k == 0), other=0).to(tl.float32)
            tl.store(lkt + (i_n * H + i_h) * K + o_k, b_lk.to(lkt.dtype.element_ty), mask=mask_k)
            if i_hv == 0:
                tl.store(ct + i_n, tl.minimum(tl.zeros([], dtype=tl.int32) + c_init + T, W).to(tl.int32))


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=['T'])
def falcon_fused_recurrent_bwd_kernel(
    q, k, v, beta, lam, do,
    dSt, dlkt, dtxt, dtvt,
    S0, lk0, tx0, tv0, c0,
    cu_seqlens, chunk_offsets, ckpt, scratch,
    dq, dk, dv, dbeta, dlam, dS0, dlk0, dtx0, dtv0,
    scale, eps, eps_gamma, T, CH,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    REGRESSION: tl.constexpr, PER_COLUMN: tl.constexpr, SHIFT: tl.constexpr,
    USE_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, NSQ: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
        boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        boc = i_n * tl.cdiv(T, CH)
    NC = tl.cdiv(T, CH)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_w = tl.arange(0, BW)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    all_rows = o_w >= 0
    key_rank = i_v + i_hv % (HV // H)   # 0 for the one program that routes per-key-head gradients
    key_owner = key_rank == 0
    p_hk = o_k[:, None] * V + o_v[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    c_init = 0
    if USE_INITIAL_STATE:
        b_S += tl.load(S0 + i_nh * K * V + p_hk, mask=mask_h, other=0).to(tl.float32)
        c_init = tl.minimum(tl.maximum(tl.load(c0 + i_n).to(tl.int32), 0), W)  # read clamped into [0, W]
    p_min = _p_min(c_init, W, SHIFT)

    # 1) checkpoints: the state before each chunk of CH steps
    for ci in range(0, NC):
        tl.store(ckpt + ((boc + ci) * HV + i_hv) * K * V + p_hk, b_S, mask=mask_h)
        for j in range(0, CH):
            t = ci * CH + j
            if t < T:
                X, Y, m = _load_pairs(k, v, lk0, tx0, tv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v,
                                      all_rows, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
                b_beta, b_lam = _load_gates(beta, lam, bos, t, i_hv, o_v, HV, V, PER_COLUMN, USE_LAM)
                nb_s, E, u, lam_eff, den_s, ok, eta, free, gamma, c = _coeffs(
                    X, m, b_beta, b_lam, eps, eps_gamma, o_w, W, REGRESSION, USE_LAM, LAM_COUPLED, NSQ)
                b_S, Wc, R = _step(b_S, X, Y, gamma, c, o_w, W, REGRESSION, PER_COLUMN)

    # the checkpoints are read back below, possibly by other threads of this program
    tl.debug_barrier()

    # 2) the gradient of the final state
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dSt + i_nh * K * V + p_hk, mask=mask_h, other=0).to(tl.float32)
        if W > 1:
            m_r = o_w < W - 1
            m_xo = mask_k & (tl.zeros_like(o_k) + key_rank == 0)
            dX = tl.load(dtxt + ((i_n * H + i_h) * (W - 1) + o_w)[:, None] * K + o_k[None, :],
                         mask=m_r[:, None] & m_xo[None, :], other=0).to(tl.float32)
            dY = tl.load(dtvt + ((i_n * HV + i_hv) * (W - 1) + o_w)[:, None] * V + o_v[None, :],
                         mask=m_r[:, None] & mask_v[None, :], other=0).to(tl.float32)
            _add_pair_grads(dk, dv, dlk0, dtx0, dtv0, dX, dY, bos, T, p_min, i_n, i_h, i_hv, o_w, o_k, o_v,
                            m_r, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE, True, True)
        if key_owner:
            b_dlk = tl.load(dlkt + (i_n * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
            T_k = tl.zeros_like(o_k) + T
            tl.atomic_add(dk + ((bos + T - 1) * H + i_h) * K + o_k, b_dlk, mask=mask_k & (T_k > 0))
            if USE_INITIAL_STATE:
                tl.atomic_add(dlk0 + (i_n * H + i_h) * K + o_k, b_dlk, mask=mask_k & (T_k == 0))

    # 3) chunks in reverse: recompute S_{t-1} of the chunk into the scratch, then walk back
    p_scr = scratch + i_nh * CH * K * V + p_hk
    for ii in range(0, NC):
        ci = NC - 1 - ii
        b_S = tl.load(ckpt + ((boc + ci) * HV + i_hv) * K * V + p_hk, mask=mask_h, other=0)
        for j in range(0, CH):
            t = ci * CH + j
            if t < T:
                tl.store(p_scr + j * K * V, b_S, mask=mask_h)
                X, Y, m = _load_pairs(k, v, lk0, tx0, tv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v,
                                      all_rows, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
                b_beta, b_lam = _load_gates(beta, lam, bos, t, i_hv, o_v, HV, V, PER_COLUMN, USE_LAM)
                nb_s, E, u, lam_eff, den_s, ok, eta, free, gamma, c = _coeffs(
                    X, m, b_beta, b_lam, eps, eps_gamma, o_w, W, REGRESSION, USE_LAM, LAM_COUPLED, NSQ)
                b_S, Wc, R = _step(b_S, X, Y, gamma, c, o_w, W, REGRESSION, PER_COLUMN)
        # the scratch is read back below by other threads of this program
        tl.debug_barrier()
        for jj in range(0, CH):
            j = CH - 1 - jj
            t = ci * CH + j
            if t < T:
                b_Sp = tl.load(p_scr + j * K * V, mask=mask_h, other=0)
                X, Y, m = _load_pairs(k, v, lk0, tx0, tv0, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v,
                                      all_rows, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE)
                b_beta, b_lam = _load_gates(beta, lam, bos, t, i_hv, o_v, HV, V, PER_COLUMN, USE_LAM)
                nb_s, E, u, lam_eff, den_s, ok, eta, free, gamma, c = _coeffs(
                    X, m, b_beta, b_lam, eps, eps_gamma, o_w, W, REGRESSION, USE_LAM, LAM_COUPLED, NSQ)
                b_St, Wc, R = _step(b_Sp, X, Y, gamma, c, o_w, W, REGRESSION, PER_COLUMN)
                # read-out o_t = scale S_t^T q_t
                b_q = tl.load(q + ((bos + t) * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
                b_do = tl.load(do + ((bos + t) * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
                b_dS += (scale * b_q)[:, None] * b_do[None, :]
                tl.atomic_add(dq + ((bos + t) * H + i_h) * K + o_k, scale * tl.sum(b_St * b_do[None, :], 1),
                              mask=mask_k)
                # S_t = gamma S_{t-1} + X^T Wc,  Wc = R * c,  R = Y - X S_{t-1} (regression)
                dWc = tl.sum(X[:, :, None] * b_dS[None, :, :], 1)           # [BW, BV]
                dX = tl.sum(Wc[:, None, :] * b_dS[None, :, :], 2)           # [BW, BK]
                dgam = tl.sum(b_Sp * b_dS, 0)                               # [BV]
                dc = tl.sum(R * dWc, 0)                                     # [BV]
                if PER_COLUMN:
                    dR = dWc * c[None, :]
                    b_dS = b_dS * gamma[None, :]
                else:
                    dR = dWc * c
                    b_dS = b_dS * gamma
                    dgam = tl.sum(dgam, 0)
                    dc = tl.sum(dc, 0)
                if REGRESSION:
                    dX -= tl.sum(dR[:, None, :] * b_Sp[None, :, :], 2)
                    b_dS -= tl.sum(X[:, :, None] * dR[:, None, :], 0)
                # the gates: c = eta / B_t, alpha = eta * lam_eff (unless clamped), eta = beta / den
                deta = dc / nb_s
                dalpha = tl.where(free, -dgam, 0.0)
                deta += dalpha * lam_eff
                dlam_eff = dalpha * eta
                dbeta_ = tl.where(ok, deta / den_s, 0.0)
                dden = -dbeta_ * eta
                if PER_COLUMN:
                    dlam_eff = tl.sum(dlam_eff, 0)
                    dden = tl.sum(dden, 0)
                    tl.store(dbeta + ((bos + t) * HV + i_hv) * V + o_v, dbeta_, mask=mask_v)
                else:
                    tl.atomic_add(dbeta + (bos + t) * HV + i_hv, dbeta_)
                dlam_eff += dden
                dE = dden
                if USE_LAM:
                    if LAM_COUPLED:
                        tl.atomic_add(dlam + (bos + t) * HV + i_hv, dlam_eff * E)
                    else:
                        tl.atomic_add(dlam + (bos + t) * HV + i_hv, dlam_eff)
                # the energy: ||x||^2, the window mean, or lambda_max / B_t (dlambda/dG = u u^T)
                if (W > 1) & REGRESSION:
                    uX = tl.sum(u[:, None] * X, 0)                          # [BK]
                    dX += (2 * dE / nb_s) * u[:, None] * uX[None, :]
                else:
                    dX += (2 * dE / nb_s) * X
                _add_pair_grads(dk, dv, dlk0, dtx0, dtv0, dX, dR, bos, t, p_min, i_n, i_h, i_hv, o_w, o_k, o_v,
                                all_rows, H, HV, K, V, W, SHIFT, USE_INITIAL_STATE, True, True)
        tl.debug_barrier()

    if USE_INITIAL_STATE:
        tl.store(dS0 + i_nh * K * V + p_hk, b_dS.to(dS0.dtype.element_ty), mask=mask_h)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

def _interpret() -> bool:
    return os.environ.get('TRITON_INTERPRET') == '1'


def _parse_config(name: str):
    val = os.environ.get(name)
    return tuple(int(x) for x in val.split(',')) if val else None


# (BV, num_warps) overrides for tuning on a GPU: env FLA_FALCON_FWD_CONFIG / FLA_FALCON_BWD_CONFIG="16,2"; the
# forward takes a third value, the register cap (maxnreg; 0: none), e.g. "8,1,128"
FWD_CONFIG = _parse_config('FLA_FALCON_FWD_CONFIG')
BWD_CONFIG = _parse_config('FLA_FALCON_BWD_CONFIG')
FWD_MAXNREG = 128   # the windowed rules' register cap in a decode step (see _fwd_config)
# falcon3 decode steps whose grid fits in about one wave of 1-warp programs (H200: 132 SMs x 12-16) compute
# lambda_max inside the forward kernel (INLINE_E): launch-bound there, one launch less counts; beyond, the
# separate energy kernel keeps the forward at 128 registers. The inline build needs 158 (aot_check, sm_90,
# K = V = 128, W = 4; spills under 128), hence its own cap
INLINE_E_MAX_PROGRAMS = 2048
FWD_MAXNREG_INLINE_E = 160


def _fwd_config(K: int, V: int, W: int, use_initial_state: bool = True,
                decode: bool = False) -> tuple[int, int, int | None]:
    """(BV, num_warps, maxnreg) of the forward. Small V blocks as in fla (N*HV*V/8 programs keep a decode
    step memory-bound); one warp while the state slice and the window's rows fit its registers.

    A decode step is bound by the state loads in flight, i.e. by the warps resident per SM, which the
    registers limit (1-warp programs, 64K registers per SM). Left alone, ptxas issues the window's loads
    early and takes ~150 registers for falcon3 (12 warps per SM; falcon1: 80, 25 warps); capped at 128 it
    schedules them later without spilling (scripts/aot_check.py, sm_90, K = V = 128, W = 2..4, bf16 and
    fp32, with an initial state: the decode specialization). Only there: under a cap ptxas can also take
    more registers than it needs (window 1: 95 instead of 80; K = 64: 122 instead of 96), and without an
    initial state (prefill) falcon3 spills under it.

    `decode` (at most one token per sequence) with no window: BV = 16, one warp. Measured on the H200 at
    B = 64, H = 16, K = V = 128, bf16 (CUDA-graph device time, fla's step 49 us): BV 8 -> 16 takes falcon1/1a/2/2a
    from 49.1-49.5 to 38.4-39.4 us; B = 1 stays at 2.5-2.8 us either way. Longer sequences keep BV = 8: a program
    walks its sequence serially, so halving the programs would idle SMs when N * HV is small; so do K > 128,
    where a 16-wide slice of the state alone takes 128 registers of a one-warp program (falcon1 at K = 256: 255
    and a spill, aot_check)."""
    if FWD_CONFIG is not None:
        cfg = tuple(FWD_CONFIG) + (0,) * (3 - len(FWD_CONFIG))
        return cfg[0], cfg[1], (cfg[2] or None)
    if _interpret():
        return triton.next_power_of_2(V), 1, None      # fewer programs: the interpreter runs them one by one
    BK = triton.next_power_of_2(K)
    BV = min(16 if decode and W == 1 and BK <= 128 else 8, triton.next_power_of_2(V))
    work = BK * BV * triton.next_power_of_2(W)
    num_warps = 1 if work <= 4096 else 2 if work <= 8192 else 4
    cap = FWD_MAXNREG if W > 1 and use_initial_state and num_warps == 1 and BK * BV == 1024 else None
    return BV, num_warps, cap


def _fwd_launch(K: int, V: int, W: int, regression: bool, use_initial_state: bool, decode: bool,
                N: int, HV: int) -> tuple[int, int, int | None, bool]:
    """(BV, num_warps, maxnreg, inline_e) of a forward launch over N sequences and HV value heads: `_fwd_config`,
    and whether falcon3's lambda_max is computed inside the forward kernel (INLINE_E) with the register cap that
    needs. A small decode step (a grid of about one wave, windows 2-4) does: one launch less counts more there
    than each program repeating the 4 x 4 eigenproblem; otherwise lambda_max is computed once per (token, key
    head) by falcon_window_energy_kernel before the recurrence."""
    BV, num_warps, maxnreg = _fwd_config(K, V, W, use_initial_state, decode=decode)
    inline_e = regression and 1 < W <= 4 and decode and N * HV * triton.cdiv(V, BV) <= INLINE_E_MAX_PROGRAMS
    if inline_e and maxnreg is not None and FWD_CONFIG is None:
        maxnreg = max(maxnreg, FWD_MAXNREG_INLINE_E)
    return BV, num_warps, maxnreg, inline_e


def _bwd_config(K: int, V: int, W: int) -> tuple[int, int]:
    if BWD_CONFIG is not None:
        return BWD_CONFIG
    if _interpret():
        return triton.next_power_of_2(V), 4
    BV = min(16, triton.next_power_of_2(V))
    work = triton.next_power_of_2(K) * BV * triton.next_power_of_2(W)
    return BV, (4 if work <= 8192 else 8)


def falcon_fused_recurrent_fwd(q, k, v, beta, lam, scale, eps, eps_gamma, rule, window, lam_coupled, shift,
                               S0, lk0, tx0, tv0, c0, output_final_state, cu_seqlens):
    regression, per_column, _ = rule_info(rule)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    W = window
    BK, BW = triton.next_power_of_2(K), triton.next_power_of_2(W)
    BV, num_warps, maxnreg, inline_e = _fwd_launch(K, V, W, regression, S0 is not None, B * T <= N, N, HV)
    o = torch.empty_like(v)
    if output_final_state:
        St = q.new_empty(N, HV, K, V, dtype=torch.float32)
        lkt = q.new_empty(N, H, K, dtype=torch.float32)
        txt = q.new_empty(N, H, W - 1, K, dtype=torch.float32)
        tvt = q.new_empty(N, HV, W - 1, V, dtype=torch.float32)
        ct = q.new_empty(N, dtype=torch.int32)
    else:
        St = lkt = txt = tvt = ct = None
    E = None
    if regression and W > 1 and not inline_e:
        E = q.new_empty(max(B * T, 1), H, dtype=torch.float32)
    if E is not None and B * T > 0:
        seq_idx = None
        if cu_seqlens is not None:
            # each token's sequence without a host sync (fla's prepare_sequence_ids reads the lengths on the
            # host; this step also runs in CUDA-graph-captured decoding), empty sequences included
            seq_idx = torch.searchsorted(cu_seqlens, torch.arange(B * T, device=q.device, dtype=cu_seqlens.dtype),
                                         right=True) - 1
        falcon_window_energy_kernel[(B * T, H)](
            k, lk0, tx0, c0, E, None, cu_seqlens, seq_idx, T, H=H, K=K, W=W, BK=BK, BW=BW, SHIFT=shift,
            USE_INITIAL_STATE=S0 is not None, IS_VARLEN=cu_seqlens is not None, NSQ=NSQ, num_warps=1)
    grid = (triton.cdiv(V, BV), N * HV)
    falcon_fused_recurrent_fwd_kernel[grid](
        q, k, v, beta, lam, o, S0, lk0, tx0, tv0, c0, St, lkt, txt, tvt, ct, E,
        cu_seqlens, scale, eps, eps_gamma, T,
        H=H, HV=HV, K=K, V=V, W=W, BK=BK, BV=BV,
        REGRESSION=regression, PER_COLUMN=per_column, SHIFT=shift,
        USE_LAM=lam is not None, LAM_COUPLED=lam_coupled, USE_INITIAL_STATE=S0 is not None,
        STORE_FINAL_STATE=output_final_state, IS_VARLEN=cu_seqlens is not None, INLINE_E=inline_e, NSQ=NSQ,
        num_warps=num_warps, num_stages=1, maxnreg=maxnreg,
    )
    return o, (St, lkt, txt, tvt, ct)


def falcon_fused_recurrent_bwd(q, k, v, beta, lam, do, dSt, dlkt, dtxt, dtvt, scale, eps, eps_gamma,
                               rule, window, lam_coupled, shift, S0, lk0, tx0, tv0, c0, cu_seqlens):
    regression, per_column, _ = rule_info(rule)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    W = window
    BK, BW = triton.next_power_of_2(K), triton.next_power_of_2(W)
    BV, num_warps = _bwd_config(K, V, W)
    if cu_seqlens is None:
        N, max_len = B, T
    else:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        N, max_len = lens.numel(), int(lens.max()) if lens.numel() else 0
    # chunk of C ~ sqrt(T) steps: (T/C + C) states of memory per head instead of T
    CH = int(min(64, max(8, triton.next_power_of_2(max(1, math.isqrt(max(max_len, 1)))))))
    if cu_seqlens is None:
        chunk_offsets, n_chunks = None, N * triton.cdiv(T, CH)
    else:
        nc = (lens + CH - 1) // CH
        chunk_offsets = torch.cat([nc.new_zeros(1), nc.cumsum(0)])
        n_chunks = int(chunk_offsets[-1])
    dev = q.device
    ckpt = torch.empty(max(n_chunks, 1), HV, K, V, device=dev, dtype=torch.float32)
    scratch = torch.empty(N * HV, CH, K, V, device=dev, dtype=torch.float32)
    dq = torch.zeros(B, T, H, K, device=dev, dtype=torch.float32)
    dk = torch.zeros_like(dq)
    dv = torch.zeros(B, T, HV, V, device=dev, dtype=torch.float32)
    dbeta = torch.zeros(beta.shape, device=dev, dtype=torch.float32)
    dlam = torch.zeros(lam.shape, device=dev, dtype=torch.float32) if lam is not None else None
    use_h0 = S0 is not None
    dS0 = torch.empty(S0.shape, device=dev, dtype=torch.float32) if use_h0 else None
    dlk0 = torch.zeros(lk0.shape, device=dev, dtype=torch.float32) if use_h0 else None
    dtx0 = torch.zeros(tx0.shape, device=dev, dtype=torch.float32) if use_h0 else None
    dtv0 = torch.zeros(tv0.shape, device=dev, dtype=torch.float32) if use_h0 else None
    use_dht = any(t is not None for t in (dSt, dlkt, dtxt, dtvt))
    if use_dht:
        # autograd may leave some final-state gradients undefined
        dSt = dSt if dSt is not None else torch.zeros(N, HV, K, V, device=dev)
        dlkt = dlkt if dlkt is not None else torch.zeros(N, H, K, device=dev)
        dtxt = dtxt if dtxt is not None else torch.zeros(N, H, W - 1, K, device=dev)
        dtvt = dtvt if dtvt is not None else torch.zeros(N, HV, W - 1, V, device=dev)
    grid = (triton.cdiv(V, BV), N * HV)
    falcon_fused_recurrent_bwd_kernel[grid](
        q, k, v, beta, lam, do, dSt, dlkt, dtxt, dtvt, S0, lk0, tx0, tv0, c0,
        cu_seqlens, chunk_offsets, ckpt, scratch,
        dq, dk, dv, dbeta, dlam, dS0, dlk0, dtx0, dtv0,
        scale, eps, eps_gamma, T, CH,
        H=H, HV=HV, K=K, V=V, W=W, BK=BK, BV=BV, BW=BW,
        REGRESSION=regression, PER_COLUMN=per_column, SHIFT=shift,
        USE_LAM=lam is not None, LAM_COUPLED=lam_coupled, USE_INITIAL_STATE=use_h0,
        USE_DHT=use_dht, IS_VARLEN=cu_seqlens is not None, NSQ=NSQ,
        num_warps=num_warps, num_stages=1,
    )
    return dq, dk, dv, dbeta, dlam, dS0, dlk0, dtx0, dtv0


class FusedRecurrentFalconFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, beta, lam, S0, lk0, tx0, tv0, c0, cu_seqlens, scale, eps, eps_gamma, rule,
                window, lam_coupled, shift, output_final_state):
        o, (St, lkt, txt, tvt, ct) = falcon_fused_recurrent_fwd(
            q, k, v, beta, lam, scale, eps, eps_gamma, rule, window, lam_coupled, shift,
            S0, lk0, tx0, tv0, c0, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, beta, lam, S0, lk0, tx0, tv0, c0, cu_seqlens)
        ctx.args = (scale, eps, eps_gamma, rule, window, lam_coupled, shift)
        if ct is not None:
            ctx.mark_non_differentiable(ct)
        return o, St, lkt, txt, tvt, ct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dSt, dlkt, dtxt, dtvt, dct):
        q, k, v, beta, lam, S0, lk0, tx0, tv0, c0, cu_seqlens = ctx.saved_tensors
        scale, eps, eps_gamma, rule, window, lam_coupled, shift = ctx.args
        # autograd's cotangents may be expanded views (e.g. the gradient of a .sum())
        do, dSt, dlkt, dtxt, dtvt = (None if g is None else g.contiguous() for g in (do, dSt, dlkt, dtxt, dtvt))
        dq, dk, dv, dbeta, dlam, dS0, dlk0, dtx0, dtv0 = falcon_fused_recurrent_bwd(
            q, k, v, beta, lam, do, dSt, dlkt, dtxt, dtvt, scale, eps, eps_gamma, rule, window, lam_coupled,
            shift, S0, lk0, tx0, tv0, c0, cu_seqlens)
        cast = lambda g, ref: None if g is None or ref is None else g.to(ref.dtype)  # noqa: E731
        return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dbeta, beta), cast(dlam, lam),
                cast(dS0, S0), cast(dlk0, lk0), cast(dtx0, tx0), cast(dtv0, tv0),
                None, None, None, None, None, None, None, None, None, None)


def fused_recurrent_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor | None = None,
    *,
    rule: str = 'falcon1',
    window: int = 1,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
    eps_gamma: float = DEFAULT_EPS_GAMMA,
    lam_coupled: bool = False,
    shift: bool = True,
    initial_state: FalconState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, FalconState | None]:
    r"""Falcon recurrence with fused Triton kernels (token by token; for decoding and short inputs).

    Same arguments, defaults and results as :func:`fla_falcon.ops.falcon.naive.naive_recurrent_falcon`
    (see there): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``beta [B, T, HV]`` or ``[B, T, HV, V]``
    (falcon2/2a), ``lam [B, T, HV]`` or None. State and accumulation are fp32 (bf16/fp16/fp32
    inputs); ``o`` has ``v``'s dtype and the final :class:`FalconState` is fp32 (fp64 for fp64
    inputs, computed in fp32). Differentiable in q, k, v, beta, lam and the initial state's
    ``S, last_k, tail_x, tail_v``, also through the returned final state.
    """
    scale, N = validate_falcon_inputs(
        q, k, v, beta, lam, rule=rule, window=window, scale=scale, eps=eps, eps_gamma=eps_gamma,
        lam_coupled=lam_coupled, shift=shift, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if q.shape[-1] > 256:
        # a program holds the full key dimension of its state slice in registers
        raise ValueError(f"fused_recurrent_falcon supports key head dims K <= 256, got K={q.shape[-1]}")
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    lam = lam.contiguous() if lam is not None else None
    if initial_state is not None:
        S0, lk0, tx0, tv0, c0 = (t.contiguous() for t in initial_state)
    else:
        S0 = lk0 = tx0 = tv0 = c0 = None
    args = (q, k, v, beta, lam, S0, lk0, tx0, tv0, c0, cu_seqlens, scale, float(eps), float(eps_gamma), rule,
            window, lam_coupled, shift, output_final_state)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, beta, lam, S0, lk0, tx0, tv0))
    if needs_grad:
        o, St, lkt, txt, tvt, ct = FusedRecurrentFalconFunction.apply(*args)
    else:
        # inference (decoding): no autograd bookkeeping
        o, (St, lkt, txt, tvt, ct) = falcon_fused_recurrent_fwd(
            q, k, v, beta, lam, scale, float(eps), float(eps_gamma), rule, window, lam_coupled, shift,
            S0, lk0, tx0, tv0, c0, output_final_state, cu_seqlens)
    final_state = None
    if output_final_state:
        final_state = FalconState(St, lkt, txt, tvt, ct)
        if q.dtype == torch.float64:
            final_state = FalconState(*(t.double() for t in final_state[:4]), ct)
    return o, final_state
