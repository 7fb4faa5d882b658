# -*- coding: utf-8 -*-
"""Chunk-parallel Triton kernels of falcon2, the per-column delta (NLMS) rule.

Per value head and value column c, with the shifted key ``x_t`` shared by all columns, the gain
``beta[t, c]``, ``eta[t, c] = beta[t, c] / (||x_t||^2 + lam'_t + eps)``, ``g[t, c] = log(1 - alpha)``
(``alpha = min(eta lam', 1 - eps_gamma)``) and ``G`` its cumulative sum inside a chunk::

    s_c <- exp(g[t, c]) s_c + x_t u[t, c],   u[t, c] = eta[t, c] r[t, c],   r[t, c] = v[t, c] - x_t . s_c

(the residual at the pre-update state), read after write ``o_t = scale S_t^T q_t``.

Chunk form. Inside a chunk that starts at ``S0``, with ``Gx_t = G_{t-1}`` (0 on the chunk's first row),
the prediction ``p_t = x_t . s_{t-1} = exp(Gx_t) (X S0)_t + sum_{j<t} (x_t . x_j) exp(Gx_t - G_j) u_j``,
so per column the written values solve the unit lower-triangular system

    (I + L_c) u_c = eta_c (v_c - exp(Gx_c) (X S0)_c),    L_c[t, j] = eta[t, c] exp(Gx[t, c] - G[j, c]) (x_t . x_j)

(the injected-value and projected-history paths in ONE solve). The key Gram ``X X^T`` is shared by
the columns; the solve is a forward substitution over the chunk's rows vectorized over a block of
value columns, inside the sequential state kernel (its right side needs ``S0``). Then, exactly as
falcon2a with ``u`` in place of ``eta v``:

    S_next[:, c] = exp(G[C, c]) S0[:, c] + sum_j exp(G[C, c] - G[j, c]) x_j u[j, c]
    o[t, c]      = scale (exp(G[t, c]) q_t . S0[:, c] + sum_{j <= t} exp(G[t, c] - G[j, c]) (q_t . x_j) u[j, c])

Every exponent is a difference ``G_a - G_b`` with b <= a, so every factor is <= 1. The forward stores
the residual ``r`` (``u = eta r``, and ``p = v - r`` which the backward needs, also where eta = 0) and
the chunk-start states.

Backward, per chunk and column, with ``du`` the direct gradient of u (the outputs' part
``_bwd_dv_local_col`` plus the state path ``exp(G_C - G_j) x_j . dS_next``): the transposed solve
``(I + L)^T drhs = du`` (sequential over chunks, since du needs dS_next), and

    dS0  = exp(G_C) dS_next + scale sum_t exp(G_t) q_t do_t - X^T (eta exp(Gx) drhs)
    dv   = eta drhs,    deta = drhs r  (the rhs and the L paths together),
    dM[t, j] = -sum_c eta drhs[t, c] exp(Gx[t, c] - G[j, c]) u[j, c]   (j < t; M = X X^T, dX += (dM + dM^T) X)
    dX  += -(eta exp(Gx) drhs) S0^T  (the X S0 path)   + the output / state paths of falcon2a,
    dG   = o do - u drhs + [last row] <S_next, dS_next>  - eta drhs p
           (-u du of the outputs / state and +u (du - drhs) of L's -G_j give -u drhs; the last term is
           through Gx = G - g, so it is also added back to dg directly),

then the gates' chain rule as for falcon2a (reverse cumsum, log1p(-alpha), the clamp, eta, E, lam,
lam_coupled) and the key gradient shifted back onto k / the carried last key.

Kernels: ``_prep_fwd`` (chunk.py: shift, the row gates, G per column; eta = beta / den is formed where it is read),
``_col_decay`` (the step factors F from G), ``_gram`` (the key Gram of each 16-row block, once per key head, kept for
the backward), ``_fwd_h_delta_col`` (sequential: chunk-start states, the solve, r), ``_fwd_o_col`` (chunk.py, fed
u = eta r); backward ``_bwd_dv_local_col`` (chunk.py), ``_col_decay`` (F again), ``_bwd_dhu_delta_col``
(sequential: state gradients, the transposed solve), ``_bwd_col_gates`` and ``_bwd_col_dqk`` (chunk.py, shared
with falcon2a, ``DELTA=True``: dq, dk, dv, dbeta, dlam).

The sequential kernels solve a chunk in blocks of 16 rows. A block's rows see the earlier blocks through
the state at the end of the previous block, ``S_ref``: ``p_t = exp(Gx_t - G_ref) x_t . S_ref + (the
block's own rows)``, a tensor-core product, and the state advances block by block. Only the block's own
rows need the row-by-row substitution, on [16, BV] register tiles. Each step loads its row of the (symmetric) Gram
block and its per-column decay factor ``F = exp(g) = exp(G_i - G_{i-1}) <= 1`` (the decayed history tile is rescaled
by it: a product of per-step factors, each <= 1, instead of 16 x BV exps per step), precomputed and straight from
memory, off the chain of dependent steps: taking them out of register tiles cost cross-thread reductions and layout
conversions on every step. Both are stored BT rows per chunk (0 / 1 on the rows past the end), so the steps read them
without masks: no predicate, select or exponential per step. The backward runs the
blocks in reverse with the gradient of the state at each block's end. (The first version substituted all 64 rows of
a chunk on [64, BV] tiles, reading a Gram row and a G row from memory at each step: 4.1 and 3.8 ms of falcon2's
11.5 ms at (4, 4096, 16, 128, 128) on an H200; the 16-row blocks with the coefficients taken out of register tiles:
1.8 and 2.5 ms.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.utils import get_multiprocessor_count

from fla_falcon.ops.falcon.chunk import (
    CONFIGS,
    _bwd_col_grads,
    _bwd_dv_local_col,
    _check_dht,
    _col_outputs,
    _col_rg,
    _fwd_o_col,
    _gate_grads,
    _join,
    _load_x,
    _meta,
    _next_state,
    _prep_fwd,
    _reduce_groups,
    _run,
    _seq_info,
    _seq_span,
)


@triton.autotune(configs=CONFIGS, key=['H', 'K', 'BT', 'BS', 'IS_VARLEN'])
@triton.jit
def _gram(k, last_k, count, M, cu_seqlens, chunk_indices, chunk_offsets, T,
          H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
          SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The key Gram X X^T of each BS-row block of a chunk ([rows, BS], fp32, BT rows per chunk: rows past the end
    are 0), once per key head: the substitutions only need the diagonal blocks (earlier blocks reach a row through
    the state)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_b = tl.arange(0, BS)
    for i_s in tl.static_range(BT // BS):
        o_t = i_t * BT + i_s * BS + o_b
        m_t = o_t < T
        b_x, valid = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
        b_M = tl.dot(b_x, tl.trans(b_x))
        # rows by chunk, BT per chunk (the sequence's last chunk padded with its zero rows: x = 0 past the end), so
        # that the substitution steps read them without a mask
        tl.store(M + (((boh + i_t) * BT + i_s * BS + o_b) * H + i_h)[:, None] * BS + o_b[None, :], b_M)


@triton.jit
def _block_rows(k, last_k, count, G, beta, rg, i_n, i_h, i_hv, bos, r0, c0, T, o_b, o_v, m_v,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BS: tl.constexpr,
                BK: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """One BS-row block of a chunk starting at row r0 (the chunk at c0): its keys x, the tile offsets and mask,
    G, Gx (G of the row before, 0 before the chunk), eta (= beta / den, formed here from beta and the row gates rg),
    G of the block's last row and of the row before the block (0 for the first). A block past the sequence's end
    (the sequential kernels run it: no branch) reads nothing: every tile is 0 and both G rows 0, so its state
    factor is 1 and it writes nothing into the state."""
    o_t = r0 + o_b
    m_t = o_t < T
    b_x, valid = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
    b_G = tl.load(G + p_tv, mask=m_tv, other=0)
    b_Gx = tl.load(G + p_tv - HV * V, mask=m_tv & (o_t > c0)[:, None], other=0)
    b_eta = tl.load(beta + p_tv, mask=m_tv, other=0).to(tl.float32) * _col_rg(rg, bos, o_t, m_t, i_hv, HV)[1][:, None]
    last = min(r0 + BS, T) - 1
    b_Gl = tl.load(G + ((bos + last) * HV + i_hv) * V + o_v, mask=m_v & ((r0 + o_v * 0) < T), other=0)
    b_Gr = tl.load(G + ((bos + r0 - 1) * HV + i_hv) * V + o_v, mask=m_v & ((r0 + o_v * 0) > c0) & ((r0 + o_v * 0) < T),
                   other=0)
    return b_x, m_tv, p_tv, b_G, b_Gx, b_eta, b_Gl, b_Gr


@triton.jit
def _col_decay(G, F, cu_seqlens, chunk_indices, chunk_offsets, T, HV: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The per-step decay factors F[t, c] = exp(G[t, c] - G[t - 1, c]) <= 1 (G of the row before the chunk: 0) that
    the sequential kernels' substitution steps read, forward and backward: stored BT rows per chunk with 1 on the rows
    past the sequence's end, so that the steps read them without a mask. (Written by _prep_fwd beside G, they cost it
    131 us at (4, 4096, 16, 128, 128) on the H200, twice this whole pass; thirty-first lease.)"""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_G = tl.load(G + p_tv, mask=m_tv, other=0)
        b_Gp = tl.load(G + p_tv - HV * V, mask=m_tv & (o_t > i_t * BT)[:, None], other=0)
        p_f = (((boh + i_t) * BT + tl.arange(0, BT)) * HV + i_hv)[:, None] * V + o_v[None, :]
        tl.store(F + p_f, tl.where(m_t[:, None], tl.exp(tl.minimum(b_G - b_Gp, 0.)), 1.), mask=(o_v < V)[None, :])


@triton.jit
def _fwd_step(i: tl.constexpr, b_y, b_r, b_w, b_eta, p_m, p_f, o_b, m_v, H: tl.constexpr, HV: tl.constexpr,
              V: tl.constexpr, BS: tl.constexpr):
    """Step i of a block's forward substitution: at step i, b_w[j] = exp(G_{i-1} - G_j) u_j (j < i, zero below),
    rescaled by exp(G_i - G_{i-1}) per step (the first step's factor would rescale nothing: b_w is 0); row i's
    residual is y_i minus the block's history sum_j (x_i.x_j) b_w[j], and u_i = eta_i r_i.

    The step's coefficients come straight from memory in the layouts the step uses (extracting them from register
    tiles took cross-thread reductions and layout conversions on every step of the chain): row i of the block's
    symmetric Gram block (p_m: the block's first row; 16 contiguous values) and the decay factor exp(g) of row i
    per column (p_f; precomputed: no exponential on the steps). Both are stored BT rows per chunk, 0 (Gram) and 1
    (factor) on the rows past the end: no mask but the columns', no select (an async copy fills masked values with
    0: the factor of a column past V is 0, which nothing reads)."""
    m_i = (o_b == i)[:, None]
    b_mi = tl.load(p_m + i * H * BS)
    b_ri = b_y - tl.sum(b_mi[:, None] * b_w, 0)[None, :]
    if i > 0:
        b_w = b_w * tl.load(p_f + i * HV * V, mask=m_v, other=0)[None, :]
    return tl.where(m_i, b_ri, b_r), tl.where(m_i, b_eta * b_ri, b_w)


@triton.jit
def _bwd_step(j: tl.constexpr, b_dr, b_z, b_eta, p_m, p_f, o_b, m_v, H: tl.constexpr, HV: tl.constexpr,
              V: tl.constexpr, BS: tl.constexpr):
    """Step j of a block's backward substitution: drhs_j = du_j - sum_{t>j} (x_t.x_j) exp(Gx_t - G_j) eta_t drhs_t,
    with b_z[t] = exp(Gx_t - G_j) eta_t drhs_t (t > j in the block, zero above), rescaled by exp(G_j - G_{j-1})
    per step (the first, j = BS - 1, would rescale nothing: b_z is 0). Coefficients as in _fwd_step."""
    m_j = (o_b == j)[:, None]
    b_mj = tl.load(p_m + j * H * BS)
    b_dr = tl.where(m_j, b_dr - tl.sum(b_mj[:, None] * b_z, 0)[None, :], b_dr)
    if j < BS - 1:
        b_z = b_z * tl.load(p_f + j * HV * V, mask=m_v, other=0)[None, :]
    return b_dr, tl.where(m_j, b_eta * b_dr, b_z)


# The sequential kernels' time is the latency of their row-by-row substitution (T / BS blocks of BS dependent steps,
# each with a reduction across the [BS, BV] tile), not arithmetic: narrow value blocks on few warps step faster and
# give more programs. At (4, 4096, 16, 128, 128) bf16 on the H200 (tenth lease's autotuning) _fwd_h_delta_col took
# 3.23 / 4.35 ms with BV = 64 on 4 / 8 warps and 2.43 / 4.88 ms with BV = 32; columns are independent, so 16 works too.
# With the step coefficients loaded from memory (_step_coefs; eleventh lease, GPU shared with other jobs, so only
# the ratios count) BV = 32 on 4 warps was the fastest: 2.4x the old kernel's time at that config, 1.3x its best.
# (BV = 32 on 2 warps spills 0.3-3.7 KB per thread, aot_check sm_90; BV = 16 on 2 warps at most 232 B.)
# The substitution's BS steps are unrolled (tl.static_range): in the thirteenth lease's sweep (GPU shared, ratios
# only) that took _fwd_h_delta_col from 9.05 to 4.37 ms at BV = 32 / 4 warps, _bwd_dhu_delta_col from 7.49 to 6.80.
# A chunk's four blocks carry no `if r0 < T` (a block past the end is masked to a no-op, _block_rows): one
# branch-free stretch, so the compiler issues a block's loads (keys, G, v, beta, the Gram columns) before the
# previous block's substitution ends, where with the branches each block's loads waited for the chain before them
# (loads inside scf.if are not pipelined). At (4, 4096, 16, 128, 128) bf16 on the H200 (twenty-eighth lease)
# _fwd_h_delta_col 1409 -> 1202 us, _bwd_dhu_delta_col 1764 -> 1213 us; the autotuner chose it over the branched
# configs (BV = 64 / 4 warps rolled, 32 / 4 and 16 / 2 unrolled, 16 / 1 rolled). The twenty-ninth lease timed the
# same substitution on separate [BV] row vectors (tl.split of the tiles, the Gram coefficients as scalars: no
# cross-thread reduction per step; benchmarks/results/dead_ends/col_rows.patch) at 1.53-3.06 ms forward and
# 1.64-3.07 ms backward on BV = 16-64, against 1.187 / 1.198 ms for this form: BV = 32 on 4 warps is the one config.
# The thirtieth lease timed the blocks in a runtime loop (20x less compile time: 3.5 / 4.0 s against 67 / 104 s for
# sm_90) at 4-20% slower, and BV = 16 (more programs for small batches) slower at both benchmark shapes, unrolled or
# not (benchmarks/results/dead_ends/). Nsight Compute (benchmarks/results/ncu_seq/): 2 blocks of 4 warps per SM,
# limited by registers; ~88 warp instructions per step, of which ~28 are the step and ~23 the pipeliner's copies of
# the next chunk's step coefficients, each with its own address, predicate and commit group. Since then the steps
# read precomputed decay factors and chunk-padded Gram rows without masks: SASS 7368 -> 4920 instructions forward,
# 8104 -> 5624 backward (sm_90); on the H200 (thirty-first lease, benchmarks/results/col_step/) 1185 -> 790 us and
# 1205 -> 851 us, ~62 / ~69 warp instructions per step, and falcon2 4575 -> 4044 us in all (writing F costs _prep_fwd
# 131 us, the backward's _col_decay 69).
CONFIGS_COL_H = [triton.Config({'BV': 32}, num_warps=4, num_stages=2)]


def _state_pass_programs(N: int, HV: int, V: int) -> int:
    """The programs of falcon2's sequential kernels (one per sequence, value head and value block)."""
    return N * HV * triton.cdiv(V, CONFIGS_COL_H[0].kwargs['BV'])


def _end_in_dhu(programs: int, device: torch.device) -> bool:
    """Whether falcon2's decay-gradient end terms are formed by _bwd_dhu_delta_col (END), given its program count.
    There the next state's per-chunk load is off the substitution's chain but not free: with a program alone on its
    multiprocessor, its latency adds to the sequential path. H100, forty-seventh lease (benchmarks/results/lease47):
    at (4, 4096, 16, 128, 128), 256 programs, the gates kernel's 135 us saved outweigh dhu's +51 us; at (1, 16384),
    64 programs, gates saved 89 and dhu lost 225."""
    return programs >= get_multiprocessor_count(device.index or 0)  # (1 under the CPU interpreter)


@triton.autotune(configs=CONFIGS_COL_H, key=['H', 'HV', 'K', 'V', 'BT', 'BS', 'IS_VARLEN'])
@triton.jit
def _fwd_h_delta_col(k, v, last_k, count, M, G, F, beta, rg, h, h0, ht, r,
                     cu_seqlens, chunk_offsets, T,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    """Sequential over chunks: stores the chunk-start states h, solves (I + L_c) u_c = rhs_c for a block
    of value columns, stores the residual r (u = eta r), advances the state.

    The solve runs block by block (BS rows): the history of the earlier blocks reaches a row through the
    state at the end of the previous block, S_ref (a [BS, K] x [K, BV] product), so the row-by-row
    forward substitution only covers the block's own rows, on [BS, BV] register tiles, its steps unrolled. No
    branch on the sequence's end (see CONFIGS_COL_H)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_b = tl.arange(0, BS)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = (o_k < K)[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)
    for i_t in range(NT):
        tl.store(h + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        for i_s in tl.static_range(BT // BS):
            r0 = i_t * BT + i_s * BS
            b_x, m_tv, p_tv, b_G, b_Gx, b_eta, b_Gl, b_Gr = _block_rows(
                k, last_k, count, G, beta, rg, i_n, i_h, i_hv, bos, r0, i_t * BT, T, o_b, o_v, m_v,
                H, HV, K, V, BS, BK, SHIFT, USE_INITIAL_STATE)
            b_v = tl.load(v + p_tv, mask=m_tv, other=0).to(tl.float32)
            # the residual against the state before the block, decayed to each row's read: exp(Gx_t - G_ref) <= 1
            # (min: rows past the end read G = 0)
            b_y = b_v - tl.dot(b_x, b_h.to(b_x.dtype)) * tl.exp(tl.minimum(b_Gx - b_Gr[None, :], 0.))
            # forward substitution, every column at once (_fwd_step)
            b_r = b_y
            b_w = tl.zeros([BS, BV], dtype=tl.float32)
            r0p = (boh + i_t) * BT + i_s * BS   # the block's first row in M and F (BT rows per chunk)
            p_m = M + (r0p * H + i_h) * BS + o_b
            p_f = F + (r0p * HV + i_hv) * V + o_v
            for i in tl.static_range(BS):
                b_r, b_w = _fwd_step(i, b_y, b_r, b_w, b_eta, p_m, p_f, o_b, m_v, H, HV, V, BS)
            tl.store(r + p_tv, b_r, mask=m_tv)
            # now b_w[j] = exp(G_last - G_j) u_j: the block's write into the state
            b_h = b_h * tl.exp(b_Gl - b_Gr)[None, :] + tl.dot(tl.trans(b_x), b_w.to(b_x.dtype))
    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * HV + i_hv) * K * V + p_kv, b_h, mask=m_kv)


@triton.autotune(configs=CONFIGS_COL_H, key=['H', 'HV', 'K', 'V', 'BT', 'BS', 'IS_VARLEN'])
@triton.jit
def _bwd_dhu_delta_col(q, k, last_k, count, M, G, F, beta, rg, do, du, dr, h, ht, dh, dht, dh0, end, scale,
                       cu_seqlens, chunk_offsets, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                       USE_FINAL_STATE_GRADIENT: tl.constexpr, END: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Reverse over chunks: dh[c] = gradient of the state at the end of chunk c; du (the outputs' part)
    plus the state path, the transposed solve (I + L)^T drhs = du (stored in dr), and
    dS0 = exp(G_C) dS_next + scale Q^T (exp(G) do) - X^T (eta exp(Gx) drhs). With END, also the decay gradient's
    end term of each chunk, end[c] = sum_k S_next * dS_next per column (S_next: the next chunk's start state h, or
    the final state ht), for _bwd_col_gates, which otherwise reads two [K, V] tiles per chunk for it; here dS_next is
    in registers already and the load of S_next is off the substitution's chain (see _end_in_dhu for when).

    Block by block in reverse, as the forward: b_e is the solve's gradient of the state at the end of the
    current block (the later blocks' rows reach its rows through it), so the backward substitution only
    covers the block's own rows, unrolled and branch-free as in _fwd_h_delta_col."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_b = tl.arange(0, BS)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = (o_k < K)[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)
    for i_t in range(NT - 1, -1, -1):
        p_h = ((boh + i_t) * HV + i_hv) * K * V + p_kv
        tl.store(dh + p_h, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        if END:
            b_hn = _next_state(h, ht, p_h, p_kv, m_kv, (i_t * BT + BT + o_k * 0 < T)[:, None], i_n, i_hv, HV, K, V,
                               USE_FINAL_STATE_GRADIENT)
            tl.store(end + ((boh + i_t) * HV + i_hv) * V + o_v, tl.sum(b_hn * b_dh, 0), mask=m_v)
        b_e = b_dh
        b_dq = tl.zeros([BK, BV], dtype=tl.float32)
        for i_sr in tl.static_range(BT // BS):
            i_s = BT // BS - 1 - i_sr
            r0 = i_t * BT + i_s * BS
            b_x, m_tv, p_tv, b_G, b_Gx, b_eta, b_Gl, b_Gr = _block_rows(
                k, last_k, count, G, beta, rg, i_n, i_h, i_hv, bos, r0, i_t * BT, T, o_b, o_v, m_v,
                H, HV, K, V, BS, BK, SHIFT, USE_INITIAL_STATE)
            b_q = tl.load(q + ((bos + r0 + o_b) * H + i_h)[:, None] * K + o_k[None, :],
                          mask=((r0 + o_b) < T)[:, None] & (o_k < K)[None, :], other=0)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0).to(tl.float32)
            # the outputs read S0 decayed by exp(G_t): their part of dS0
            b_dq += tl.dot(tl.trans(b_q), (b_do * tl.exp(b_G) * scale).to(b_q.dtype))
            # the state path of du: u_j enters the state at the block's end through exp(G_last - G_j) x_j
            b_dr = tl.load(du + p_tv, mask=m_tv, other=0) + tl.dot(b_x, b_e.to(b_x.dtype)) * tl.exp(
                b_Gl[None, :] - b_G)
            # backward substitution, rows in reverse (_bwd_step; the block's first row: G_{j-1} = G_ref)
            b_z = tl.zeros([BS, BV], dtype=tl.float32)
            r0p = (boh + i_t) * BT + i_s * BS   # as in _fwd_h_delta_col
            p_m = M + (r0p * H + i_h) * BS + o_b
            p_f = F + (r0p * HV + i_hv) * V + o_v
            for jj in tl.static_range(BS):
                b_dr, b_z = _bwd_step(BS - 1 - jj, b_dr, b_z, b_eta, p_m, p_f, o_b, m_v, H, HV, V, BS)
            tl.store(dr + p_tv, b_dr, mask=m_tv)
            # now b_z = exp(Gx - G_ref) eta drhs: the gradient of the state before the block
            b_e = b_e * tl.exp(b_Gl - b_Gr)[None, :] - tl.dot(tl.trans(b_x), b_z.to(b_x.dtype))
        b_dh = b_e + b_dq
    if USE_INITIAL_STATE:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + p_kv, b_dh, mask=m_kv)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

# rows of a substitution block: the sequential kernels solve row by row inside a block of SUB rows on
# [SUB, BV] register tiles; the earlier blocks of the chunk reach a row through the state (tensor cores)
SUB = 16


def _common(m, shift, use_init, cu_seqlens):
    return dict(H=m['H'], HV=m['HV'], K=m['K'], V=m['V'], BT=m['BT'], BK=m['BK'], BV=m['BV'], SHIFT=int(shift),
                USE_INITIAL_STATE=use_init, IS_VARLEN=cu_seqlens is not None)


def _step_factors(G, m, cu_seqlens):
    """falcon2's per-step decay factors F from G (_col_decay), [NTH * BT, HV, V] fp32."""
    F = torch.empty(m['NTH'] * m['BT'], m['HV'], m['V'], device=G.device, dtype=torch.float32)
    _col_decay[(m['NT'], m['B'] * m['HV'])](
        G, F, cu_seqlens, m['chunk_indices'], m['chunk_offsets'], m['T'], HV=m['HV'], V=m['V'], BT=m['BT'], BV=m['BV'],
        IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return F


def chunk_fwd_falcon2(q, k, v, beta, lam, S0, last_k, count, scale, eps, eps_gamma, lam_coupled, shift,
                output_final_state, cu_seqlens, chunk_size, outputs=None, gates=None, fork=None):
    """falcon2's chunk forward: (o, final S, saved tensors). The backward's recomputation passes ``outputs`` (the
    forward's (o, o_lo): no output kernel, o None, ``outputs`` in the saved tensors) and ``gates``, the saved
    (M, G, rg), which it does not form again; the decay factors F then come back last among the saved tensors, for
    the backward's state gradients (so the backward forms them once). With ``fork`` (chunk.py's _Fork: only where
    the state gradients do not read the states, _end_in_dhu false) the state pass runs on its stream; F is formed
    before, on this one, since the state gradients read it too."""
    m = _meta(q, v, chunk_size, cu_seqlens)
    B, T, HV, K, V, BV, NT, N = (m[x] for x in ('B', 'T', 'HV', 'K', 'V', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    common = _common(m, shift, S0 is not None, cu_seqlens)
    f32 = dict(device=dev, dtype=torch.float32)
    BS = min(SUB, m['BT'])
    if gates is None:
        G = torch.empty(B, T, HV, V, **f32)
        rg = torch.empty(B, T, HV, 2, **f32)   # the row gates (lam', 1 / den): eta = beta / den is formed where read
        _prep_fwd[(NT, B * HV)](
            k, v, beta, lam, last_k, count, None, None, G, None, None, None, None, rg, cu_seqlens, ci, co, eps,
            eps_gamma, T, PER_COL=True, WIN=0, HAS_LAM=lam is not None, LAM_COUPLED=lam_coupled, E_GIVEN=False,
            **common)
        # the key Grams of the substitution blocks (0 past the end), BT rows per chunk
        M = torch.empty(m['NTH'] * m['BT'], m['H'], BS, **f32)
        gram_kw = {key: val for key, val in common.items() if key in ('H', 'K', 'BT', 'BK', 'SHIFT',
                                                                      'USE_INITIAL_STATE', 'IS_VARLEN')}
        _gram[(NT, B * m['H'])](k, last_k, count, M, cu_seqlens, ci, co, T, BS=BS, **gram_kw)
    else:
        M, G, rg = gates
    # the substitution steps' decay factors exp(g) (1 past the end), BT rows per chunk
    F = _step_factors(G, m, cu_seqlens)
    h = torch.empty(m['NTH'], HV, K, V, device=dev, dtype=q.dtype)
    ht = torch.empty(N, HV, K, V, **f32) if output_final_state else None
    r = torch.empty(B, T, HV, V, **f32)
    common_h = {key: val for key, val in common.items() if key != 'BV'}
    _run(fork, lambda: _fwd_h_delta_col[lambda meta: (triton.cdiv(V, meta['BV']), N * HV)](
        k, v, last_k, count, M, G, F, beta, rg, h, S0, ht, r, cu_seqlens, co, T, BS=BS,
        STORE_FINAL_STATE=output_final_state, **common_h), [h, ht, r, F])
    if outputs is not None:
        return None, ht, (M, G, r, h, *outputs, rg, ht, F)
    del F
    # falcon2a's output kernel forms u = eta v: fed the residual, it forms u = eta r (and writes the output's
    # rounding residual o_lo for the decay gradient)
    o, o_lo = _col_outputs(v)
    _fwd_o_col[(triton.cdiv(V, BV), NT, B * HV)](
        q, k, r, last_k, count, G, beta, rg, h, o, o_lo, scale, cu_seqlens, ci, co, T, SAVE_LO=o_lo is not None,
        **common)
    return o, ht, (M, G, r, h, o, o_lo, rg, ht)


def chunk_bwd_falcon2(q, k, v, beta, lam, S0, last_k, count, saved, do, dht, scale, eps, eps_gamma, lam_coupled, shift,
                cu_seqlens, chunk_size, fork=None):
    """falcon2's chunk backward. ``fork``: the _Fork whose stream may still compute the recomputed states h, ht and
    the residual r; joined before the first kernel that reads them (_bwd_dhu_delta_col with END, else the gradients
    after it)."""
    # (F: the recomputation's decay factors, when it ran)
    M, G, r, h, o, o_lo, rg, ht, *F = saved
    _check_dht(dht, ht)   # before any launch: _bwd_dhu_delta_col reads ht with dht
    m = _meta(q, v, chunk_size, cu_seqlens)
    B, T, H, HV, K, V, BT, BV, NT, N = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BT', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    use_init = S0 is not None
    common = _common(m, shift, use_init, cu_seqlens)
    f32 = dict(device=dev, dtype=torch.float32)
    do = do.contiguous()
    du = torch.empty(B, T, HV, V, **f32)
    _bwd_dv_local_col[(triton.cdiv(V, BV), NT, B * HV)](
        q, k, last_k, count, G, None, None, None, None, do, du, scale, cu_seqlens, ci, co, T, STATE=False,
        HAS_FINAL=False, **common)
    dr = torch.empty(B, T, HV, V, **f32)
    dh = torch.empty_like(h)
    dh0 = torch.empty(N, HV, K, V, **f32) if use_init else None
    common_h = {key: val for key, val in common.items() if key != 'BV'}
    # as in the forward: from the backward's recomputation, or formed again (the forward does not keep them beside G)
    F = F[0] if F else _step_factors(G, m, cu_seqlens)
    # the decay gradient's end terms per chunk, formed by the sequential kernel or else by _bwd_col_gates (its program
    # count from CONFIGS_COL_H's one config: the choice is needed before the launch)
    end = torch.empty(m['NTH'], HV, V, **f32) if _end_in_dhu(_state_pass_programs(N, HV, V), dev) else None
    if end is not None:
        _join(fork)   # the end terms read the states (a fork is not made then: chunk.py's _overlap_recompute)
    _bwd_dhu_delta_col[lambda meta: (triton.cdiv(V, meta['BV']), N * HV)](
        q, k, last_k, count, M, G, F, beta, rg, do, du, dr, h, ht, dh, dht, dh0, end, scale, cu_seqlens, co, T,
        BS=M.shape[-1], USE_FINAL_STATE_GRADIENT=dht is not None, END=end is not None, **common_h)
    del F   # (held by the fork until its join when the recomputation was forked)
    _join(fork)   # the gradients below read h, ht and r
    # key-side gradients are per value head; with grouped heads they are summed afterwards in fp32
    kdt = q.dtype if HV == H else torch.float32
    dq = torch.empty(B, T, HV, K, device=dev, dtype=kdt)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=kdt)   # every row written (_store_dk)
    dv = torch.empty_like(v)
    dlast_k = torch.zeros(N, HV, K, **f32) if use_init else None
    dbeta, dlam = _gate_grads(beta, lam)
    _bwd_col_grads(q, k, v, r, beta, lam, rg, last_k, count, G, h, ht, dh, dht, o, o_lo, do, dr, dv, dq, dk, dbeta,
                   dlam, dlast_k, scale, eps_gamma, cu_seqlens, ci, co, m, True,
                   dict(HAS_LAM=lam is not None, LAM_COUPLED=lam_coupled), common, end=end)
    return _reduce_groups(dq, dk, dv, dbeta, dlam, dh0, dlast_k, H, HV)[:7]
