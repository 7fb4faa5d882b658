# -*- coding: utf-8 -*-
"""Chunk-parallel Triton kernels of the Falcon rules (training and prefill path).

Per value head, with the shifted key ``x_t`` (``k_{t-1}``, or ``k_t`` with ``shift=False``), the
per-token gates ``eta_t = beta_t / (E_t + lam_t + eps)``, ``alpha_t = min(eta_t lam_t, 1 - eps_gamma)``
and ``g_t = log(1 - alpha_t)`` (``G`` their cumulative sum inside a chunk), the supported rules
are a state recurrence ``S_t = exp(g_t) S_{t-1} + x_t u_t^T`` with

- falcon1a: ``u_t = eta_t v_t`` (scalar-gated linear attention on the shifted keys);
- falcon2a: the same with one gain/step/decay per value column (``g``, ``G``, ``eta`` are
  ``[T, V]``): the decay multiplies the columns of S, see the falcon2a section below;
- falcon1:  ``u_t = eta_t (v_t - S_{t-1}^T x_t)``. Inside a chunk starting at state ``S0`` this is the
  unit lower-triangular system ``(I + L) U = diag(eta) V - diag(eta exp(G_{t-1})) X S0`` with
  ``L_ts = eta_t exp(G_{t-1} - G_s) x_t.x_s`` (s < t), i.e. the gated delta rule with
  ``beta' = eta / gamma`` and ``v' = gamma v`` written without dividing by gamma. With
  ``A = (I + L)^-1``, ``W = A diag(eta exp(G_{t-1})) X`` and ``U0 = A diag(eta) V``: ``U = U0 - W S0``;
- falcon3a (window W <= 8): ``S_t = exp(g_t) S_{t-1} + c_t sum_{p in window(t)} x_p v_p^T`` with
  ``c_t = eta_t / B_t``, see the falcon3a section below.

Every exponent is a difference ``G_t - G_s`` with s <= t, so every factor is <= 1.

Forward: ``_prep_fwd`` (shift, energies, gates, local cumsum), falcon1's ``_wy_solve`` (A) and
``_wy_wu`` (W, U0), ``_fwd_h``
(sequential over chunks: chunk-start states, falcon1's corrected U), ``_fwd_o`` (outputs).
Backward: ``_bwd_dv_local`` + ``_bwd_dhu`` (state gradients, dU), ``_bwd_dqx`` (dq, the attention
part of dx, the decay gradients of the output/state paths; falcon1a finishes there with the gates'
chain rule) and, for falcon1, ``_bwd_gates`` (the WY backward, then the gates' chain rule).
falcon2a uses ``_fwd_o_col``, ``_bwd_dhu`` then ``_bwd_dv_local_col`` (du with its state path), ``_bwd_col_gates``
(gates) and ``_bwd_col_dqk`` (state paths, intra-chunk products, dq and dk) for the per-column parts.
The decay gradient uses the usual identities (every ``+G_t`` term of an output / every ``-G_s``
term of a write): ``dG_t = q_t.dq_t - x_t.dx_t`` (scalar decay) or ``o_t * do_t - u_t * du_t``
(per column), plus ``<S_next, dS_next>`` on the chunk's last row; ``dg`` is its reverse cumsum
inside the chunk. The chain rule then runs through ``log1p(-alpha)``, the clamp, ``eta`` and
``E = ||x||^2``, and the key gradient is written already shifted back onto k.

falcon3a (constexpr ``WIN`` = W; 0 for the other rules). The window of step t holds the real pairs at
positions t-W+1..t of the sequence (negative positions: the carried ``tail_x``/``tail_v``, whose last
``n_tail`` rows are real), ``B_t`` counts them and ``E_t`` is their mean ``||x||^2``; ``c_t = eta_t / B_t``.
Swapping the sums, pair p enters ``S_t`` (t >= p) with the weight
``M[t, p] = sum_{r = max(p, 0)}^{min(t, p + W - 1)} c_r exp(G_t - G_r)``. Once its window has ended
(t >= p + W - 1) that is ``exp(G_t - G_tau) mt_tau`` with ``tau = p + W - 1`` and
``mt_tau = sum_{d < W} c_{tau-d} exp(g_{tau-d+1} + ... + g_tau)``: falcon1a's GLA on the delayed rows
``x'_tau = x_{tau-W+1}``, ``u'_tau = mt_tau v_{tau-W+1}``, whose state ``S'`` the chunk kernels carry (same gates, same
kernels, the loads shifted by W - 1 rows). The pairs whose window has not ended add a band of W - 1 terms:
``S_t = S'_t + sum_{d < W-1} Mb[t, d] x_{t-d} v_{t-d}^T`` with ``Mb[t, d] = sum_{j <= d} c_{t-j} exp(g_{t-j+1} + ... +
g_t)`` (``_win_weights`` stores Mb and mt; every exponent <= 0). ``_fwd_o`` puts the band into the GLA's score product
(mt moves from the values onto the scores; the pairs of the band whose delayed rows lie past the chunk take one more
[BT, 16] block), ``_fwd_h`` adds it to the final state. The segment's initial state is S'_{-1} (the old steps'
weights are in it already).
Backward: falcon1a's kernels for the GLA with the band in the same products (mt applied to the unweighted scores
do_t.v'_s after the value loop, the band's weights on the diagonals above): ``_bwd_dv_local`` (the band's value
gradient of each delayed row, from this chunk's rows and the W - 1 before it) and ``_bwd_dqx`` (dq; dx' and dv' in
fp32; dG of the GLA; dMb and dmt turned into per-row terms of the gates' gradients, yz). ``_win_bwd_final`` handles the
sequence's last W - 1 pairs, which have no delayed row (their band, and the final state's band from dht),
``_win_bwd_gates`` gathers dc and dg (the gates' chain rule) and ``_win_bwd_pairs`` writes dk, dv of each pair (its
delayed row's or the last pairs' gradients, the window energy; the carried tail's in the first chunk). The final
state's tail is gathered on the host from k, v and the old tail (an indexing: autograd handles it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets

from fla_falcon.ops.falcon.utils import (
    DEFAULT_EPS,
    DEFAULT_EPS_GAMMA,
    FalconState,
    rule_info,
    validate_falcon_inputs,
)

SUPPORTED_RULES = ('falcon1', 'falcon1a', 'falcon2', 'falcon2a', 'falcon3', 'falcon3a')

# 8 warps keep the backward kernels free of register spills at K = V = 128 (ptxas, sm_90a); the
# interpreter keeps only the first config
CONFIGS = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)]
# the heavy per-chunk kernels (several [BT, BT] and [BT, K] fp32 tiles live at once) spill 1-3.5 KB of
# registers per thread with 4 warps at K = V = 128 (scripts/aot_check.py, sm_90): 8 warps only, which
# also halves their autotuning (compile) time
CONFIGS_8W = [triton.Config({}, num_warps=8, num_stages=s) for s in (2, 3)]
# the sequential state kernels run one program per (value block, sequence, head): narrower value
# blocks give more programs when there are few sequences. num_stages 3 prefetches the next chunk's tiles while the
# state is updated: fla's gated-delta chunk_fwd_h went from 0.165 to 0.112 ms with it at (4, 4096, 16, 128, 128)
# (BV = 64, 4 warps; its autotuning on the H200), where ours ran with 2 stages only
# _bwd_dqx: falcon1a's split build (SPLIT_1A) also fits 4 warps (255 registers, 16-32 B of stack for a few scalars
# outside its loops; aot_check, sm_90, K = V = 128 bf16), i.e. two programs per multiprocessor where the 8-warp
# build runs one; falcon1 and falcon3a keep 8 warps (their 4-warp builds spill; falcon3a's with its spills cut to
# 208-400 B tied main, sixty-sixth lease, benchmarks/results/dead_ends/f3a_4w.patch). H100, sixty-fifth lease
# (benchmarks/results/lease65): falcon1a's _bwd_dqx 601 -> 542 us at (4, 4096, 16, 128, 128) and 609 -> 558 at
# (1, 16384, ...); benchmarks/sweep_configs.py, both shapes: 4 warps 0.537-0.577 ms, 8 warps 0.644-0.739, unsplit
# (8 warps) 0.599-0.668
CONFIGS_DQX = CONFIGS_8W + [triton.Config({}, num_warps=4, num_stages=s) for s in (2, 3)]


def _dqx_prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    if args.get('DELTA') or args.get('WIN') or not args.get('SPLIT_1A'):
        return [c for c in configs if c.num_warps == 8]
    return configs


CONFIGS_H = [triton.Config({'BV': bv}, num_warps=w, num_stages=s) for s in (2, 3) for bv in (64, 32) for w in (4, 8)]
CONFIGS_H2 = [c for c in CONFIGS_H if c.num_stages == 2]   # falcon3's _bwd_dhu3: 3 stages need 234 KB at BV = 64
# the per-column backward's gates kernel, _bwd_col_gates, holds ~20 [BT, BV] fp32 tiles of one value block; a program
# takes NVP blocks of BV columns in a loop and writes its own slot of per-row sums (the host sizes them for the
# narrowest block, 16, and reads the split that ran back from best_config, so benchmarks/sweep_configs.py can time
# others). 32 x 2 on 4 warps: the fastest summed over both rules and shapes in the thirty-eighth lease's sweep (H100,
# benchmarks/results/col_nodot/sweep_*_bwd_col_gates_*.md): falcon2a 0.222 / 0.257 ms at
# (4, 4096) / (1, 16384) x (16, 128, 128), falcon2 0.408 / 0.413, against 0.236 / 0.261 and 0.435 / 0.464 at 32 x 4
# (the split of the twenty-third lease, when the kernel also loaded each chunk's keys for a product x dh), 32 x 1
# within 7% of it, 64 x 1 on 8 warps and 16 x 1 slower. No product, key or G in the kernel (the state path is
# _bwd_dv_local_col's): 1336 / 1728 SASS instructions and 9 / 12 barriers at K = V = 128 bf16 (aot_check sm_90),
# against 2504 and 63 with the product. The [BT, K] accumulators of the state paths are _bwd_col_dqk's (one kernel
# with both spilled 280-1080 B per thread at BV = 32-64).
CONFIGS_COLG = [triton.Config({'BV': 32, 'NVP': 2}, num_warps=4, num_stages=2)]


# ----------------------------------------------------------------------------------------------
# jit helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT: tl.constexpr,
              IS_VARLEN: tl.constexpr):
    """(sequence id, chunk index in the sequence, first token, length, first chunk of the sequence)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        T = eos - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        i_n = i_b
        bos = i_b * T
        boh = i_b * tl.cdiv(T, BT)
    return i_n, i_t, bos, T, boh


@triton.jit
def _seq_span(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """For the kernels sequential over one sequence's chunks: (first token, length, first chunk, chunks)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        bos = i_n * T
        boh = i_n * tl.cdiv(T, BT)
    return bos, T, boh, tl.cdiv(T, BT)


@triton.jit
def _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H: tl.constexpr, K: tl.constexpr,
            BK: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """The write features x of the rows o_t ([BT, BK] in k's dtype) and whether each row carries a pair.

    With the shift, x_t = k_{t-1}; the first token of a sequence takes the carried last key when the
    state has seen tokens (count > 0) and has no pair otherwise (no write, no decay)."""
    return _load_x_cols(k, last_k, count, i_n, i_h, bos, o_t, m_t, tl.arange(0, BK), H, K, SHIFT, USE_INITIAL_STATE)


@triton.jit
def _load_rows(x, bos, o_t, m_t, o_k, i_h, H: tl.constexpr, K: tl.constexpr, TRANS: tl.constexpr):
    """The rows o_t, columns o_k of head i_h of a [.., H, K] tensor: [len(o_t), len(o_k)], or transposed (TRANS)."""
    p = ((bos + o_t) * H + i_h) * K
    if TRANS:
        return tl.load(x + p[None, :] + o_k[:, None], mask=(o_k < K)[:, None] & m_t[None, :], other=0)
    else:
        return tl.load(x + p[:, None] + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0)


@triton.jit
def _load_x_cols(k, last_k, count, i_n, i_h, bos, o_t, m_t, o_k, H: tl.constexpr, K: tl.constexpr,
                 SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, TRANS: tl.constexpr = False):
    """_load_x for the key columns o_k only (the sequential state kernels' key blocks). TRANS: loaded as
    [len(o_k), len(o_t)] (as fla's chunk_fwd_kernel_h loads its keys; _fwd_h's KT)."""
    m_k = o_k < K
    r = o_t - SHIFT
    b_x = _load_rows(k, bos, r, m_t & (r >= 0), o_k, i_h, H, K, TRANS)
    valid = m_t
    if SHIFT:
        if USE_INITIAL_STATE:
            # a vector load: the interpreter cannot mix a scalar bool into a vector mask
            has_prev = tl.load(count + i_n + o_t * 0) > 0
            b_l = tl.load(last_k + (i_n * H + i_h) * K + o_k, mask=m_k, other=0).to(b_x.dtype)
            first = (o_t == 0) & has_prev & m_t
            if TRANS:
                b_x = tl.where(first[None, :], b_l[:, None], b_x)
            else:
                b_x = tl.where(first[:, None], b_l[None, :], b_x)
            valid = m_t & ((o_t > 0) | has_prev)
        else:
            valid = m_t & (o_t > 0)
    return b_x, valid


@triton.jit
def _keys_t(b_x, LOADED_T: tl.constexpr):
    """A [BT, BK] row tile (keys, or _bwd_dhu's queries and W) as [BK, BT], as the state products take it: b_x itself
    if _load_rows / _load_x_cols loaded it so (TRANS), else transposed here, at the product."""
    if LOADED_T:
        return b_x
    else:
        return tl.trans(b_x)


@triton.jit
def _stats(b_x, lam, bos, o_t, valid, i_hv, HV: tl.constexpr, eps, HAS_LAM: tl.constexpr,
           LAM_COUPLED: tl.constexpr):
    """Per-row energy E = ||x||^2, ridge lam' (lam, or lam * E with E a statistic) and E + lam' + eps."""
    b_E = tl.sum(b_x * b_x, 1)
    b_lp, b_den = _ridge(b_E, lam, bos, o_t, valid, i_hv, HV, eps, HAS_LAM, LAM_COUPLED)
    return b_E, b_lp, b_den


@triton.jit
def _ridge(b_E, lam, bos, o_t, valid, i_hv, HV: tl.constexpr, eps, HAS_LAM: tl.constexpr,
           LAM_COUPLED: tl.constexpr):
    """Ridge lam' (lam, or lam * E with E a statistic) and the denominator E + lam' + eps."""
    if HAS_LAM:
        b_lam = tl.load(lam + (bos + o_t) * HV + i_hv, mask=valid, other=0).to(tl.float32)
        if LAM_COUPLED:
            b_lp = b_lam * b_E
        else:
            b_lp = b_lam
    else:
        b_lp = tl.zeros_like(b_E)
    return b_lp, b_E + b_lp + eps


@triton.jit
def _gate(b_beta, b_lp, b_den, valid, eps_gamma):
    """eta = beta / den (0 without a pair or when den = 0), alpha = min(eta lam', 1 - eps_gamma), whether
    the clamp is active and g = log(1 - alpha); elementwise, so per row or per (row, column)."""
    ok = valid & (b_den > 0)
    b_eta = tl.where(ok, b_beta / tl.where(ok, b_den, 1.), 0.)
    b_a = b_eta * b_lp
    clamped = b_a > 1 - eps_gamma
    b_a = tl.minimum(b_a, 1 - eps_gamma)
    b_g = tl.where(valid, _log_decay(b_a, eps_gamma), 0.)
    return b_eta, b_a, clamped, b_g


@triton.jit
def _log_decay(b_a, eps_gamma):
    """g = log(1 - alpha) for alpha = min(eta lam', 1 - eps_gamma) (b_a, already clamped): log(eps_gamma) itself at the
    clamp, where 1 - alpha in fp32 is 1 - eps_gamma rounded (0 for eps_gamma < 2^-25: g = -inf and NaN outputs
    before, where the reference's decay is eps_gamma), else log1p(-alpha)."""
    return tl.where(b_a >= 1 - eps_gamma, tl.log(eps_gamma), _log1m(b_a))


@triton.jit
def _log1m(b_a):
    """log1p(-a) accurately in fp32 (Goldberg): log(u) * (-a) / (u - 1) with u = 1 - a rounded."""
    b_u = 1 - b_a
    return tl.where(b_u == 1, -b_a, tl.log(b_u) * (-b_a) / tl.where(b_u == 1, 1., b_u - 1))


@triton.jit
def _col_gate(b_beta, b_lp, b_rden, eps_gamma):
    """The per-column rules' gates from beta and the row gates (lam', 1 / den; 1 / den = 0 on rows without a pair):
    eta = beta / den, alpha = min(eta lam', 1 - eps_gamma), whether the clamp is active and g = log(1 - alpha), all
    0 without a pair. Elementwise: [rows, 1] row gates against [rows, BV] gains. eta = beta * (1 / den), as the
    kernels that read eta form it (no division per element), so that G and their eta agree to the bit.
    (Forming G this way where it is read instead of reading it was slower on the H200, twenty-fourth lease: the
    cumulative sums and logarithms in _fwd_o_col, _bwd_dv_local_col, _fwd_h, _bwd_dhu and _bwd_col_gates cost more
    than the fp32 G tiles they saved.)"""
    b_eta = b_beta * b_rden
    b_a = b_eta * b_lp
    clamped = b_a > 1 - eps_gamma
    b_a = tl.minimum(b_a, 1 - eps_gamma)
    return b_eta, b_a, clamped, _log_decay(b_a, eps_gamma)


@triton.jit
def _col_rg(rg, bos, o_t, m_t, i_hv, HV: tl.constexpr):
    """The row gates (lam', 1 / den) of the rows o_t ([BT] each), stored by _prep_fwd."""
    p_rg = rg + ((bos + o_t) * HV + i_hv) * 2
    return tl.load(p_rg, mask=m_t, other=0), tl.load(p_rg + 1, mask=m_t, other=0)


@triton.jit
def _col_eta(beta, rg, p, m, V: tl.constexpr):
    """eta = beta / den at the offsets p of a [B, T, HV, V] tensor, formed where it is read from beta and the row
    gates rg: the per-column rules store no fp32 [B, T, HV, V] eta (one write and three reads of it). For one row's
    columns: tiles take 1 / den as a vector of their rows (_col_rg) instead, since a gathered load per element costs
    a 64-bit address per element (registers: _bwd_col_dqk spilled 64-120 B at K = V = 128, aot_check sm_90)."""
    return tl.load(beta + p, mask=m, other=0).to(tl.float32) * tl.load(rg + (p // V) * 2 + 1, mask=m, other=0)


@triton.jit
def _gates(b_x, beta, lam, bos, o_t, valid, i_hv, HV: tl.constexpr, eps, eps_gamma,
           HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr):
    """Per-row gates of the scalar-gain rules: (E, lam', den, eta, alpha, clamped, g) in fp32."""
    b_E = tl.sum(b_x * b_x, 1)
    b_lp, b_den, b_eta, b_a, clamped, b_g = _gates_e(b_E, beta, lam, bos, o_t, valid, i_hv, HV, eps, eps_gamma,
                                                     HAS_LAM, LAM_COUPLED)
    return b_E, b_lp, b_den, b_eta, b_a, clamped, b_g


@triton.jit
def _gates_e(b_E, beta, lam, bos, o_t, valid, i_hv, HV: tl.constexpr, eps, eps_gamma,
             HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr):
    """_gates from a given energy E (summed over key blocks, or falcon3a's window energy): (lam', den, eta, alpha,
    clamped, g)."""
    b_lp, b_den = _ridge(b_E, lam, bos, o_t, valid, i_hv, HV, eps, HAS_LAM, LAM_COUPLED)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_hv, mask=valid, other=0).to(tl.float32)
    b_eta, b_a, clamped, b_g = _gate(b_beta, b_lp, b_den, valid, eps_gamma)
    return b_lp, b_den, b_eta, b_a, clamped, b_g


@triton.jit
def _gates_bwd(b_dG, b_dgd, b_deta, b_lp, b_den, b_eta, b_a, clamped, valid):
    """Chain rule of the scalar gates: from dG (gradient of the in-chunk cumulative log-decay), the
    direct gradient of g and that of eta to (dbeta, dlam', dden). Float factors instead of bool masks:
    Triton cannot move i1 tensors between layouts through shared memory."""
    # g_t enters G_s for every s >= t of the chunk
    b_dg = tl.sum(b_dG, 0) - tl.cumsum(b_dG, 0) + b_dG + b_dgd
    ok = valid & (b_den > 0)
    b_rden = tl.where(ok, 1 / tl.where(ok, b_den, 1.), 0.)
    # no gradient through alpha where the clamp is active; g = log(1 - alpha)
    b_dalpha = tl.where(clamped, 0., -b_dg / (1 - b_a)) * valid.to(tl.float32)
    b_deta += b_dalpha * b_lp
    b_dden = -b_deta * b_eta * b_rden
    return b_deta * b_rden, b_dalpha * b_eta + b_dden, b_dden


@triton.jit
def _store_gates(b_dbeta, b_dlp, b_E, dbeta, dlam, bos, o_t, m_t, i_hv, HV: tl.constexpr, HAS_LAM: tl.constexpr,
                 LAM_COUPLED: tl.constexpr):
    """Writes dbeta and dlam (no gradient through the E factor of a coupled ridge)."""
    tl.store(dbeta + (bos + o_t) * HV + i_hv, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    if HAS_LAM:
        if LAM_COUPLED:
            b_dlp = b_dlp * b_E
        tl.store(dlam + (bos + o_t) * HV + i_hv, b_dlp.to(dlam.dtype.element_ty), mask=m_t)


@triton.jit
def _store_dk(b_dx, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, T, HV: tl.constexpr, K: tl.constexpr,
              BK: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """Writes dx as dk (x_t = k_{t-SHIFT}, so shifted back by one row; row -1 is the carried last key)."""
    _store_dk_cols(b_dx, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, tl.arange(0, BK), T, HV, K, SHIFT,
                   USE_INITIAL_STATE)


@triton.jit
def _store_dk_cols(b_dx, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, o_k, T, HV: tl.constexpr,
                   K: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """_store_dk for the key columns o_k only."""
    r = o_t - SHIFT
    p_dk = dk + ((bos + r) * HV + i_hv)[:, None] * K + o_k[None, :]
    m_dk = (m_t & (r >= 0))[:, None] & (o_k < K)[None, :]
    tl.store(p_dk, b_dx.to(p_dk.dtype.element_ty), mask=m_dk)
    if SHIFT:
        # the sequence's last key is no write feature (x_t = k_{t-1}), so nothing above writes its row: its zero
        # gradient is stored here, instead of zero-filling all of dk before the backward
        tl.store(dk + ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :],
                 tl.zeros_like(b_dx).to(dk.dtype.element_ty), mask=(o_t == T - 1)[:, None] & (o_k < K)[None, :])
        if USE_INITIAL_STATE:
            b_first = tl.sum(b_dx * ((o_t == 0).to(tl.float32) * valid.to(tl.float32))[:, None], 0)
            if i_t == 0:
                tl.store(dlast_k + (i_n * HV + i_hv) * K + o_k, b_first, mask=o_k < K)


@triton.jit
def _store_gate_grads(b_x, b_dx, b_dbeta, b_dlp, b_dden, b_E, valid, dk, dlast_k, dbeta, dlam, i_n, i_t, i_hv,
                      bos, o_t, m_t, T, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, SHIFT: tl.constexpr,
                      HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """Adds the energy path (dE = dden, E = ||x||^2) to dx, writes dk, dbeta and dlam."""
    _store_gates(b_dbeta, b_dlp, b_E, dbeta, dlam, bos, o_t, m_t, i_hv, HV, HAS_LAM, LAM_COUPLED)
    _store_dk(b_dx + (2 * b_dden)[:, None] * b_x, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, T, HV, K, BK,
              SHIFT, USE_INITIAL_STATE)


# ----------------------------------------------------------------------------------------------
# falcon3a helpers: pairs at in-sequence positions p (p < 0: the carried tail), the window gates, the delayed
# GLA rows
# ----------------------------------------------------------------------------------------------

@triton.jit
def _n_tail(count, i_n, o_p, WIN: tl.constexpr, SHIFT: tl.constexpr):
    """Real pairs in the carried tail (count read clamped into [0, W]), as a vector over o_p."""
    b_c = tl.minimum(tl.maximum(tl.load(count + i_n + o_p * 0), 0), WIN)
    if SHIFT:
        b_n = tl.maximum(b_c - 1, 0)
    else:
        b_n = tl.minimum(b_c, WIN - 1)
    return b_n


@triton.jit
def _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, H: tl.constexpr, K: tl.constexpr,
                BK: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """x ([n, BK], k's dtype) and validity of the pairs at positions o_p of the sequence; p < 0 reads
    row W - 1 + p of the carried tail (its last n_tail rows are real pairs)."""
    return _load_win_x_cols(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, tl.arange(0, BK), H, K, WIN, SHIFT,
                            USE_INITIAL_STATE)


@triton.jit
def _load_win_x_cols(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, o_k, H: tl.constexpr, K: tl.constexpr,
                     WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """_load_win_x for the key columns o_k only."""
    b_x, valid = _load_x_cols(k, last_k, count, i_n, i_h, bos, o_p, m_p & (o_p >= 0), o_k, H, K, SHIFT,
                              USE_INITIAL_STATE)
    if USE_INITIAL_STATE:
        if WIN > 1:
            m_tl = m_p & (o_p < 0) & (o_p >= -_n_tail(count, i_n, o_p, WIN, SHIFT))
            b_tx = tl.load(tail_x + ((i_n * H + i_h) * (WIN - 1) + WIN - 1 + o_p)[:, None] * K + o_k[None, :],
                           mask=m_tl[:, None] & (o_k < K)[None, :], other=0).to(b_x.dtype)
            b_x = tl.where(m_tl[:, None], b_tx, b_x)
            valid = valid | m_tl
    return b_x, valid


@triton.jit
def _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_p, m_p, o_v, HV: tl.constexpr, V: tl.constexpr,
                WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """Values (fp32) of the pairs at positions o_p (p < 0: the carried tail)."""
    m_v = o_v < V
    b_v = tl.load(v + ((bos + o_p) * HV + i_hv)[:, None] * V + o_v[None, :],
                  mask=(m_p & (o_p >= 0))[:, None] & m_v[None, :], other=0).to(tl.float32)
    if USE_INITIAL_STATE:
        if WIN > 1:
            m_tl = m_p & (o_p < 0) & (o_p >= -_n_tail(count, i_n, o_p, WIN, SHIFT))
            b_tv = tl.load(tail_v + ((i_n * HV + i_hv) * (WIN - 1) + WIN - 1 + o_p)[:, None] * V + o_v[None, :],
                           mask=m_tl[:, None] & m_v[None, :], other=0)
            b_v = tl.where(m_tl[:, None], b_tv, b_v)
    return b_v


@triton.jit
def _win_gates(k, last_k, count, tail_x, beta, lam, E, i_n, i_h, i_hv, bos, o_t, m_t, eps, eps_gamma,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, WIN: tl.constexpr,
               SHIFT: tl.constexpr, HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr,
               USE_INITIAL_STATE: tl.constexpr, E_GIVEN: tl.constexpr):
    """The windowed rules' per-step gates from the window t-W+1..t: (valid, 1/B_t, E_t, lam', den, eta, alpha,
    clamped, g); B_t counts the real pairs of the window. E_t = mean ||x_j||^2 (falcon3a), or read from E
    ([tokens, H]: falcon3's lambda_max / B_t, from fused_recurrent's window-energy kernel) with E_GIVEN."""
    b_x, valid = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, H, K, BK, WIN, SHIFT,
                             USE_INITIAL_STATE)
    b_x = b_x.to(tl.float32)
    b_sq = tl.sum(b_x * b_x, 1)
    b_nb = valid.to(tl.float32)
    for d in tl.static_range(1, WIN):
        b_xd, valid_d = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t - d, m_t, H, K, BK, WIN, SHIFT,
                                    USE_INITIAL_STATE)
        b_xd = b_xd.to(tl.float32)
        b_sq += tl.where(valid_d, tl.sum(b_xd * b_xd, 1), 0.)
        b_nb += valid_d.to(tl.float32)
    b_rB = tl.where(valid, 1 / tl.maximum(b_nb, 1.), 0.)
    if E_GIVEN:
        b_E = tl.load(E + (bos + o_t) * H + i_h, mask=valid, other=0)
    else:
        b_E = b_sq * b_rB
    b_lp, b_den, b_eta, b_a, clamped, b_g = _gates_e(b_E, beta, lam, bos, o_t, valid, i_hv, HV, eps, eps_gamma,
                                                     HAS_LAM, LAM_COUPLED)
    return valid, b_rB, b_E, b_lp, b_den, b_eta, b_a, clamped, b_g


@triton.jit
def _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H: tl.constexpr, K: tl.constexpr,
                WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """The keys of the GLA rows o_t (key columns o_k) and whether each row carries a pair: x_t, or for falcon3a
    (WIN > 0) x_{t-W+1}, the pair whose window ends at step t."""
    if WIN > 0:
        b_x, valid = _load_win_x_cols(k, last_k, count, tail_x, i_n, i_h, bos, o_t - (WIN - 1), m_t, o_k, H, K, WIN,
                                      SHIFT, USE_INITIAL_STATE)
    else:
        b_x, valid = _load_x_cols(k, last_k, count, i_n, i_h, bos, o_t, m_t, o_k, H, K, SHIFT, USE_INITIAL_STATE)
    return b_x, valid


@triton.jit
def _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV: tl.constexpr, V: tl.constexpr,
                WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """The values (fp32) of the GLA rows o_t: v_t, or for falcon3a v_{t-W+1} (see _load_gla_x)."""
    if WIN > 0:
        b_v = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_t - (WIN - 1), m_t, o_v, HV, V, WIN, SHIFT,
                          USE_INITIAL_STATE)
    else:
        b_v = tl.load(v + ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :],
                      mask=m_t[:, None] & (o_v < V)[None, :], other=0).to(tl.float32)
    return b_v


@triton.jit
def _band_w(wm, bos, i_hv, HV: tl.constexpr, o_t, m_t, o_s, WIN: tl.constexpr, TRANS: tl.constexpr):
    """falcon3a's band weights between the steps o_t (m_t: real steps) and the delayed GLA rows o_s: Mb[t, d] where
    s = t + W - 1 - d, d < W - 1 (the pair p = s - W + 1 = t - d, whose window has not ended at step t), else 0.
    [len(o_t), len(o_s)], or [len(o_s), len(o_t)] with TRANS."""
    if TRANS:
        b_w = tl.zeros_like((o_s[:, None] + o_t[None, :]).to(tl.float32))
    else:
        b_w = tl.zeros_like((o_t[:, None] + o_s[None, :]).to(tl.float32))
    for d in tl.static_range(WIN - 1):
        b_wd = tl.load(wm + ((bos + o_t) * HV + i_hv) * 8 + d, mask=m_t, other=0)
        if TRANS:
            b_w = tl.where(o_s[:, None] - o_t[None, :] == WIN - 1 - d, b_wd[None, :], b_w)
        else:
            b_w = tl.where(o_s[None, :] - o_t[:, None] == WIN - 1 - d, b_wd[:, None], b_w)
    return b_w


# ----------------------------------------------------------------------------------------------
# forward kernels
# ----------------------------------------------------------------------------------------------

@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'BT', 'PER_COL', 'WIN', 'E_GIVEN', 'IS_VARLEN'])
@triton.jit
def _prep_fwd(k, v, beta, lam, last_k, count, tail_x, E, G, eta, gl, Ew, rBw, rg,
              cu_seqlens, chunk_indices, chunk_offsets, eps, eps_gamma, T,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              SHIFT: tl.constexpr, PER_COL: tl.constexpr, WIN: tl.constexpr,
              HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
              IS_VARLEN: tl.constexpr, E_GIVEN: tl.constexpr, WIN_AUX: tl.constexpr = False):
    """Shift, energies, gates and the in-chunk cumulative log-decay G over BT steps; `eta` holds eta (the windowed
    rules: c = eta / B_t). E_GIVEN: the window energies are read from E (falcon3, see _win_gates). WIN_AUX (falcon3a):
    also the log-decay g, the window energy and 1 / B_t per step (gl, Ew, rBw), which _win_weights and the backward
    read instead of reloading the window's keys. PER_COL: the row gates rg = (lam', 1 / den) per step (0 without a
    pair) in place of eta, which the kernels form from beta and rg where they read it (eta = beta * (1 / den))."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_xl, valid = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
    if PER_COL:
        # falcon2a: one gain, step, decay and cumulative log-decay per value column
        # (eta itself is not stored: the kernels form it from beta and the row gates, _col_eta)
        b_E, b_lp, b_den = _stats(b_xl.to(tl.float32), lam, bos, o_t, valid, i_hv, HV, eps, HAS_LAM, LAM_COUPLED)
        ok = valid & (b_den > 0)
        b_rden = tl.where(ok, 1 / tl.where(ok, b_den, 1.), 0.)
        p_rg = rg + ((bos + o_t) * HV + i_hv) * 2
        tl.store(p_rg, b_lp, mask=m_t)
        tl.store(p_rg + 1, b_rden, mask=m_t)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
            b_beta = tl.load(beta + p_tv, mask=m_tv, other=0).to(tl.float32)
            b_eta, b_a, clamped, b_g = _col_gate(b_beta, b_lp[:, None], b_rden[:, None], eps_gamma)
            tl.store(G + p_tv, tl.cumsum(b_g, 0), mask=m_tv)
    elif WIN > 0:
        # falcon3a / falcon3: the window energy and B_t; the step weight c_t = eta_t / B_t is what the kernels read
        valid, b_rB, b_E, b_lp, b_den, b_eta, b_a, clamped, b_g = _win_gates(
            k, last_k, count, tail_x, beta, lam, E, i_n, i_h, i_hv, bos, o_t, m_t, eps, eps_gamma, H, HV, K, BK, WIN,
            SHIFT, HAS_LAM, LAM_COUPLED, USE_INITIAL_STATE, E_GIVEN)
        tl.store(G + (bos + o_t) * HV + i_hv, tl.cumsum(b_g, 0), mask=m_t)
        tl.store(eta + (bos + o_t) * HV + i_hv, b_eta * b_rB, mask=m_t)
        if WIN_AUX:
            tl.store(gl + (bos + o_t) * HV + i_hv, b_g, mask=m_t)
            tl.store(Ew + (bos + o_t) * HV + i_hv, b_E, mask=m_t)
            tl.store(rBw + (bos + o_t) * HV + i_hv, b_rB, mask=m_t)
    else:
        b_E, b_lp, b_den, b_eta, b_a, clamped, b_g = _gates(
            b_xl.to(tl.float32), beta, lam, bos, o_t, valid, i_hv, HV, eps, eps_gamma, HAS_LAM, LAM_COUPLED)
        tl.store(G + (bos + o_t) * HV + i_hv, tl.cumsum(b_g, 0), mask=m_t)
        tl.store(eta + (bos + o_t) * HV + i_hv, b_eta, mask=m_t)


@triton.jit
def _win_ce(c, gl, bos, i_hv, HV: tl.constexpr, o_t, m_t, o_d, BT: tl.constexpr, WIN: tl.constexpr):
    """[BT, 8] tiles of c_{t-d} and e[t, d] = exp(g_{t-d+1} + ... + g_t) for d < W (c = 0, e = 1 beyond, and c = 0
    before the sequence): the running sum of at most W - 1 log-decays (<= 0), across chunk boundaries."""
    b_lg = tl.zeros([BT], dtype=tl.float32)
    b_c = tl.zeros([BT, 8], dtype=tl.float32)
    b_e = tl.zeros([BT, 8], dtype=tl.float32) + 1.
    for d in tl.static_range(WIN):
        r = o_t - d
        m_r = m_t & (r >= 0)
        if d > 0:
            b_lg += tl.load(gl + (bos + r + 1) * HV + i_hv, mask=m_r, other=0)
        b_c = tl.where(o_d[None, :] == d, tl.load(c + (bos + r) * HV + i_hv, mask=m_r, other=0)[:, None], b_c)
        b_e = tl.where(o_d[None, :] == d, tl.exp(b_lg)[:, None], b_e)
    return b_c, b_e


@triton.jit
def _win_weights(c, gl, wm, mt, cu_seqlens, chunk_indices, chunk_offsets, T,
                 HV: tl.constexpr, BT: tl.constexpr, WIN: tl.constexpr, IS_VARLEN: tl.constexpr):
    """falcon3a's weights per step t: wm[t, d] = sum_{j <= d} c_{t-j} exp(g_{t-j+1} + ... + g_t) for d < W (the band's
    Mb[t, d] for d < W - 1), and mt_t = wm[t, W - 1] (the delayed GLA row's value weight); see _win_ce."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, 8)
    b_c, b_e = _win_ce(c, gl, bos, i_hv, HV, o_t, m_t, o_d, BT, WIN)
    b_w = tl.cumsum(b_c * b_e, 1)    # slots d >= W hold mt too (c = 0 there)
    tl.store(wm + ((bos + o_t) * HV + i_hv)[:, None] * 8 + o_d[None, :], b_w, mask=m_t[:, None])
    tl.store(mt + (bos + o_t) * HV + i_hv, tl.sum(b_c * b_e, 1), mask=m_t)


# ----------------------------------------------------------------------------------------------
# falcon1's WY representation: A = (I + P)^-1 with P[t, s] = eta_t exp(G_{t-1} - G_s) x_t.x_s (s < t in
# the chunk), W = A diag(eta exp(G_{t-1})) X, U0 = A diag(eta) V. As fla's fused kkt-solve: P by
# 16-row blocks, forward substitution inside the diagonal blocks (16x16 tiles: cheap row steps),
# then the blocks below the diagonal by products of the diagonal inverses.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _wy_rows(k, last_k, count, G, eta, i_n, i_h, i_hv, bos, t0, r0, T, H: tl.constexpr, HV: tl.constexpr,
             K: tl.constexpr, BK: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """The 16 rows from r0: shifted keys x, G_t, G_{t-1} (0 on the chunk's first row), eta_t, real-row mask."""
    o_t = r0 + tl.arange(0, 16)
    m_t = o_t < T
    b_x, _ = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_Gx = tl.load(G + (bos + o_t - 1) * HV + i_hv, mask=m_t & (o_t > t0), other=0)
    b_eta = tl.load(eta + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    return b_x, b_G, b_Gx, b_eta, m_t


@triton.jit
def _wy_block(b_xi, b_xj, b_Gxi, b_Gj, b_etai, m_i, DIAG: tl.constexpr):
    """P's [16, 16] block of row block i and column block j (strictly lower on the diagonal, real rows)."""
    o_i = tl.arange(0, 16)
    m = m_i[:, None] & (o_i[:, None] > o_i[None, :]) if DIAG else m_i[:, None] & (o_i[None, :] >= 0)
    b_kk = tl.dot(b_xi, tl.trans(b_xj))
    return tl.where(m, b_etai[:, None] * tl.exp(tl.where(m, b_Gxi[:, None] - b_Gj[None, :], 0.)) * b_kk, 0.)


@triton.jit
def _wy_diag_inv(b_P):
    """(I + P)^-1 of a strictly lower [16, 16] block: row i of its strict part is -P_i - P_i M (rows < i)."""
    o_i = tl.arange(0, 16)
    b_M = -b_P
    for i in range(2, 16):
        b_a = tl.sum(tl.where((o_i == i)[:, None], -b_P, 0.), 0)
        b_a = tl.where(o_i < i, b_a, 0.)
        b_a = b_a + tl.sum(b_a[:, None] * b_M, 0)
        b_M = tl.where((o_i == i)[:, None], b_a[None, :], b_M)
    return b_M + (o_i[:, None] == o_i[None, :]).to(tl.float32)


@triton.jit
def _wy_lower1(b_Ai00, b_P10, b_P11):
    """Rows 16-31 of (I + P)^-1 from its first 16 rows' inverse and P's blocks (1, 0) and (1, 1) (strictly lower):
    A11 = (I + P11)^-1, A10 = -A11 P10 A00. fp32 products as tf32x3 (plain TF32 loses the solve's accuracy)."""
    b_Ai11 = _wy_diag_inv(b_P11)
    b_Ai10 = -tl.dot(tl.dot(b_Ai11, b_P10, input_precision="tf32x3"), b_Ai00, input_precision="tf32x3")
    return b_Ai10, b_Ai11


@triton.jit
def _wy_lower2(b_Ai00, b_Ai10, b_Ai11, b_P20, b_P21, b_P30, b_P31, b_P32, b_P22, b_P33):
    """Rows 32-63 of (I + P)^-1 (blocks (2, 0..2), (3, 0..3)) from rows 0-31 of it and P's blocks."""
    b_Ai22 = _wy_diag_inv(b_P22)
    b_Ai33 = _wy_diag_inv(b_P33)
    b_Ai21 = -tl.dot(tl.dot(b_Ai22, b_P21, input_precision="tf32x3"), b_Ai11, input_precision="tf32x3")
    b_Ai32 = -tl.dot(tl.dot(b_Ai33, b_P32, input_precision="tf32x3"), b_Ai22, input_precision="tf32x3")
    b_Ai20 = -tl.dot(b_Ai22, tl.dot(b_P20, b_Ai00, input_precision="tf32x3")
                     + tl.dot(b_P21, b_Ai10, input_precision="tf32x3"), input_precision="tf32x3")
    b_Ai31 = -tl.dot(b_Ai33, tl.dot(b_P31, b_Ai11, input_precision="tf32x3")
                     + tl.dot(b_P32, b_Ai21, input_precision="tf32x3"), input_precision="tf32x3")
    b_Ai30 = -tl.dot(b_Ai33, tl.dot(b_P30, b_Ai00, input_precision="tf32x3")
                     + tl.dot(b_P31, b_Ai10, input_precision="tf32x3")
                     + tl.dot(b_P32, b_Ai20, input_precision="tf32x3"), input_precision="tf32x3")
    return b_Ai20, b_Ai21, b_Ai22, b_Ai30, b_Ai31, b_Ai32, b_Ai33


@triton.jit
def _wy_store(A, b_blk, bos, i_hv, r0, c0, T, HV: tl.constexpr, BT: tl.constexpr):
    o_i = tl.arange(0, 16)
    tl.store(A + ((bos + r0 + o_i) * HV + i_hv)[:, None] * BT + (c0 + o_i)[None, :], b_blk,
             mask=((r0 + o_i) < T)[:, None] & (o_i >= 0)[None, :])


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (1, 2, 4)],
                 key=['H', 'HV', 'K', 'BT', 'IS_VARLEN'])
@triton.jit
def _wy_solve(k, last_k, count, G, eta, A, cu_seqlens, chunk_indices, chunk_offsets, T,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A = (I + P)^-1 of the chunk (BT = 16, 32 or 64: one, two or four row blocks), stored whole
    (zeros above the diagonal) for _wy_wu and the backward."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = i_t * BT
    b_x0, b_G0, b_Gx0, b_eta0, m_0 = _wy_rows(k, last_k, count, G, eta, i_n, i_h, i_hv, bos, t0, t0, T, H, HV, K,
                                              BK, SHIFT, USE_INITIAL_STATE)
    b_Ai00 = _wy_diag_inv(_wy_block(b_x0, b_x0, b_Gx0, b_G0, b_eta0, m_0, True))
    _wy_store(A, b_Ai00, bos, i_hv, t0, 0, T, HV, BT)
    b_zero = tl.zeros([16, 16], dtype=tl.float32)
    if BT >= 32:
        b_x1, b_G1, b_Gx1, b_eta1, m_1 = _wy_rows(k, last_k, count, G, eta, i_n, i_h, i_hv, bos, t0, t0 + 16, T,
                                                  H, HV, K, BK, SHIFT, USE_INITIAL_STATE)
        b_Ai10, b_Ai11 = _wy_lower1(b_Ai00, _wy_block(b_x1, b_x0, b_Gx1, b_G0, b_eta1, m_1, False),
                                    _wy_block(b_x1, b_x1, b_Gx1, b_G1, b_eta1, m_1, True))
        _wy_store(A, b_zero, bos, i_hv, t0, 16, T, HV, BT)
        _wy_store(A, b_Ai10, bos, i_hv, t0 + 16, 0, T, HV, BT)
        _wy_store(A, b_Ai11, bos, i_hv, t0 + 16, 16, T, HV, BT)
    if BT >= 64:
        b_x2, b_G2, b_Gx2, b_eta2, m_2 = _wy_rows(k, last_k, count, G, eta, i_n, i_h, i_hv, bos, t0, t0 + 32, T,
                                                  H, HV, K, BK, SHIFT, USE_INITIAL_STATE)
        b_x3, b_G3, b_Gx3, b_eta3, m_3 = _wy_rows(k, last_k, count, G, eta, i_n, i_h, i_hv, bos, t0, t0 + 48, T,
                                                  H, HV, K, BK, SHIFT, USE_INITIAL_STATE)
        b_Ai20, b_Ai21, b_Ai22, b_Ai30, b_Ai31, b_Ai32, b_Ai33 = _wy_lower2(
            b_Ai00, b_Ai10, b_Ai11,
            _wy_block(b_x2, b_x0, b_Gx2, b_G0, b_eta2, m_2, False),
            _wy_block(b_x2, b_x1, b_Gx2, b_G1, b_eta2, m_2, False),
            _wy_block(b_x3, b_x0, b_Gx3, b_G0, b_eta3, m_3, False),
            _wy_block(b_x3, b_x1, b_Gx3, b_G1, b_eta3, m_3, False),
            _wy_block(b_x3, b_x2, b_Gx3, b_G2, b_eta3, m_3, False),
            _wy_block(b_x2, b_x2, b_Gx2, b_G2, b_eta2, m_2, True),
            _wy_block(b_x3, b_x3, b_Gx3, b_G3, b_eta3, m_3, True))
        _wy_store(A, b_zero, bos, i_hv, t0, 32, T, HV, BT)
        _wy_store(A, b_zero, bos, i_hv, t0, 48, T, HV, BT)
        _wy_store(A, b_zero, bos, i_hv, t0 + 16, 32, T, HV, BT)
        _wy_store(A, b_zero, bos, i_hv, t0 + 16, 48, T, HV, BT)
        _wy_store(A, b_Ai20, bos, i_hv, t0 + 32, 0, T, HV, BT)
        _wy_store(A, b_Ai21, bos, i_hv, t0 + 32, 16, T, HV, BT)
        _wy_store(A, b_Ai22, bos, i_hv, t0 + 32, 32, T, HV, BT)
        _wy_store(A, b_zero, bos, i_hv, t0 + 32, 48, T, HV, BT)
        _wy_store(A, b_Ai30, bos, i_hv, t0 + 48, 0, T, HV, BT)
        _wy_store(A, b_Ai31, bos, i_hv, t0 + 48, 16, T, HV, BT)
        _wy_store(A, b_Ai32, bos, i_hv, t0 + 48, 32, T, HV, BT)
        _wy_store(A, b_Ai33, bos, i_hv, t0 + 48, 48, T, HV, BT)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'BT', 'IS_VARLEN'])
@triton.jit
def _wy_wu(k, v, last_k, count, G, eta, A, W, U, cu_seqlens, chunk_indices, chunk_offsets, T,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """W = A diag(eta exp(G_{t-1})) X and U0 = A diag(eta) V (inputs' dtype, fp32 accumulation)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = i_t * BT
    o_s = tl.arange(0, BT)
    o_t = t0 + o_s
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    b_xl, _ = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
    b_Gx = tl.load(G + (bos + o_t - 1) * HV + i_hv, mask=m_t & (o_t > t0), other=0)
    b_eta = tl.load(eta + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_Al = tl.load(A + ((bos + o_t) * HV + i_hv)[:, None] * BT + o_s[None, :], mask=m_t[:, None],
                   other=0).to(k.dtype.element_ty)
    b_w = tl.dot(b_Al, (b_xl * (b_eta * tl.exp(b_Gx))[:, None]).to(k.dtype.element_ty))
    tl.store(W + ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :], b_w.to(W.dtype.element_ty),
             mask=m_t[:, None] & (o_k < K)[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0).to(tl.float32)
        b_u = tl.dot(b_Al, (b_v * b_eta[:, None]).to(k.dtype.element_ty))
        tl.store(U + p_v, b_u.to(U.dtype.element_ty), mask=m_tv)


@triton.autotune(configs=CONFIGS_H, key=['H', 'HV', 'K', 'V', 'BT', 'BK', 'DELTA', 'PER_COL', 'WIN', 'IS_VARLEN'])
@triton.jit
def _fwd_h(k, v, last_k, count, tail_x, tail_v, G, eta, W, U, h, h0, ht, vn, wm, beta, rg,
           cu_seqlens, chunk_offsets, T,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           SHIFT: tl.constexpr, DELTA: tl.constexpr, PER_COL: tl.constexpr, WIN: tl.constexpr,
           USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
           KT: tl.constexpr = True):
    """Forward over chunks: h[c] = the state at the start of chunk c, [BK, BV] per program. The rules without a delta
    term may split the key dimension (BK < K, one block per program axis 1): their state's key rows evolve
    independently; falcon1's delta term W S needs all of them (BK covers K). falcon3a: the delayed GLA rows (eta
    holds mt), and the band's pairs added to the final state. falcon2a (PER_COL): eta = beta / den formed from beta
    and the row gates rg, not read."""
    # the keys loaded as [BK, BT] (KT), as the product takes them, not loaded as [BT, BK] and transposed (a layout
    # conversion in shared memory): falcon1a's _fwd_h 0.296 -> 0.194 ms at (1, 16384, 16, 128, 128), key block 32
    # (H100, fifty-fourth lease). At the 64-wide key blocks (wgmma, the default since) the two forms tie to 1%
    # (falcon1 / falcon1a / falcon2a, both benchmark shapes, fifty-fifth lease), with fewer registers in this one.
    # Not falcon3a's window rows. KT=0 (benchmarks/sweep_configs.py) times the other form.
    KEYS_T: tl.constexpr = KT and WIN == 0
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)
    for i_t in range(NT):
        tl.store(h + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        last = min(i_t * BT + BT, T) - 1
        if KEYS_T:
            b_x, valid = _load_x_cols(k, last_k, count, i_n, i_h, bos, o_t, m_t, o_k, H, K, SHIFT, USE_INITIAL_STATE,
                                      TRANS=True)
        else:
            b_x, valid = _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H, K, WIN, SHIFT,
                                     USE_INITIAL_STATE)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        if PER_COL:
            b_G = tl.load(G + p_tv, mask=m_tv, other=0)
            b_Gl = tl.load(G + ((bos + last) * HV + i_hv) * V + o_v, mask=o_v < V, other=0)
            b_rd = _col_rg(rg, bos, o_t, m_t, i_hv, HV)[1]
            b_eta = tl.load(beta + p_tv, mask=m_tv, other=0).to(tl.float32) * b_rd[:, None]
            b_u = tl.load(v + p_tv, mask=m_tv, other=0).to(tl.float32) * b_eta
            b_u = (b_u * tl.exp(b_Gl[None, :] - b_G)).to(k.dtype.element_ty)
            b_h = b_h * tl.exp(b_Gl)[None, :] + tl.dot(_keys_t(b_x, KEYS_T), b_u)
        else:
            b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
            b_Gl = tl.load(G + (bos + last) * HV + i_hv)
            if DELTA:
                b_w = tl.load(W + ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :],
                              mask=m_t[:, None] & (o_k < K)[None, :], other=0)
                b_u = tl.load(U + p_tv, mask=m_tv, other=0).to(tl.float32)
                b_u -= tl.dot(b_w, b_h.to(b_w.dtype))
                tl.store(vn + p_tv, b_u.to(vn.dtype.element_ty), mask=m_tv)
                b_u = b_u * tl.exp(b_Gl - b_G)[:, None]
            else:
                b_eta = tl.load(eta + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
                b_u = _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT,
                                  USE_INITIAL_STATE) * (b_eta * tl.exp(b_Gl - b_G))[:, None]
            b_h = b_h * tl.exp(b_Gl) + tl.dot(_keys_t(b_x, KEYS_T), b_u.to(k.dtype.element_ty))
    if STORE_FINAL_STATE:
        if WIN > 1:
            # falcon3a: the full state adds the pairs p = T-1-d (d < W - 1) whose window has not ended, Mb[T-1, d]
            o_p = T - 16 + tl.arange(0, 16)
            m_p = (o_p >= T - (WIN - 1)) & (o_p * 0 + T > 0)   # none in an empty sequence
            b_xp, valid_p = _load_win_x_cols(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, o_k, H, K, WIN, SHIFT,
                                             USE_INITIAL_STATE)
            b_wp = tl.load(wm + ((bos + T - 1) * HV + i_hv) * 8 + (T - 1 - o_p), mask=m_p, other=0)
            b_vp = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_p, m_p, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
            b_h += tl.dot(tl.trans(b_xp), (b_vp * b_wp[:, None]).to(k.dtype.element_ty))
        tl.store(ht + (i_n * HV + i_hv) * K * V + p_kv, b_h, mask=m_kv)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'BT', 'DELTA', 'WIN', 'IS_VARLEN'])
@triton.jit
def _fwd_o(q, k, v, last_k, count, tail_x, tail_v, G, eta, vn, h, wm, o, scale,
           cu_seqlens, chunk_indices, chunk_offsets, T,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           SHIFT: tl.constexpr, DELTA: tl.constexpr, WIN: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
           IS_VARLEN: tl.constexpr):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :],
                  mask=m_t[:, None] & (o_k < K)[None, :], other=0)
    b_x, valid = _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H, K, WIN, SHIFT,
                             USE_INITIAL_STATE)
    b_h = tl.load(h + ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
    b_o = tl.dot(b_q, b_h.to(b_q.dtype)) * tl.exp(b_G)[:, None]
    b_s = tl.dot(b_q, tl.trans(b_x))
    # real rows t only: a padded row reads G = 0 and exp(0 - G_s) overflows once G_s < -88 (0 * inf)
    m_s = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_a = tl.where(m_s, tl.exp(tl.where(m_s, b_G[:, None] - b_G[None, :], 0.)), 0.)
    if DELTA:
        b_o += tl.dot((b_s * b_a).to(b_q.dtype), tl.load(vn + p_tv, mask=m_tv, other=0).to(b_q.dtype))
    elif WIN > 1:
        # falcon3a: the delayed row's weight mt moves from the values onto the scores, so that the band joins the
        # same product: the pair p = t - d (d < W - 1) of row t has its delayed row tau = t + W - 1 - d, weight Mb[t, d]
        b_a = b_a * tl.load(eta + (bos + o_t) * HV + i_hv, mask=m_t, other=0)[None, :] + _band_w(
            wm, bos, i_hv, HV, o_t, m_t, o_t, WIN, False)
        # the band's last W - 1 pairs, p = E - W + 1 .. E - 1, have their delayed rows past the chunk (or past the
        # sequence's end): one more [BT, 16] block of scores
        E = min(i_t * BT + BT, T)
        o_j = tl.arange(0, 16)
        o_p = E - (WIN - 1) + o_j
        m_p = o_j < WIN - 1
        b_ae = _band_w(wm, bos, i_hv, HV, o_t, m_t, o_p + WIN - 1, WIN, False)
        b_v = _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        b_o += tl.dot((b_s * b_a).to(b_q.dtype), b_v.to(b_q.dtype))
        b_xe, valid_e = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, H, K, BK, WIN, SHIFT,
                                    USE_INITIAL_STATE)
        b_ve = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_p, m_p, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        b_o += tl.dot((tl.dot(b_q, tl.trans(b_xe)) * b_ae).to(b_q.dtype), b_ve.to(b_q.dtype))
    else:
        b_eta = tl.load(eta + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
        b_u = (_load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
               * b_eta[:, None]).to(q.dtype.element_ty)
        b_o += tl.dot((b_s * b_a).to(b_q.dtype), b_u)
    tl.store(o + p_tv, (b_o * scale).to(o.dtype.element_ty), mask=m_tv)


# ----------------------------------------------------------------------------------------------
# backward kernels
# ----------------------------------------------------------------------------------------------

@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'BT', 'WIN', 'BAND', 'IS_VARLEN'])
@triton.jit
def _bwd_dv_local(q, k, last_k, count, tail_x, G, wm, do, du, dvb, scale,
                  cu_seqlens, chunk_indices, chunk_offsets, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  SHIFT: tl.constexpr, WIN: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
                  BAND: tl.constexpr = 0):
    """dU from the outputs of the same chunk: scale (Q X^T * D)^T dO, computed as (X Q^T * D^T) dO (falcon3a: on its
    delayed GLA rows, and with BAND 0 (BAND_FORM 'fold') the band's value gradient of those rows' pairs into dvb, see
    below)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :],
                  mask=m_t[:, None] & (o_k < K)[None, :], other=0)
    b_x, valid = _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H, K, WIN, SHIFT,
                             USE_INITIAL_STATE)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_sr = tl.dot(b_x, tl.trans(b_q))           # [s, t]
    m_s = (o_t[:, None] <= o_t[None, :]) & m_t[None, :]   # real t only (see _fwd_o)
    b_st = tl.where(m_s, b_sr * tl.exp(tl.where(m_s, b_G[None, :] - b_G[:, None], 0.)), 0.) * scale
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
    b_do = tl.load(do + p_tv, mask=m_tv, other=0)
    b_du = tl.dot(b_st.to(b_do.dtype), b_do)
    tl.store(du + p_tv, b_du, mask=m_tv)
    if WIN > 1 and BAND == 0:
        # falcon3a's band, seen from the pairs: the pair of delayed row tau is in the band of the rows t = tau - W + 1
        # .. tau - 1 with weight Mb[t, d], d = t - tau + W - 1, and gets scale Mb[t, d] (q_t.x'_tau) do_t. Those rows
        # are this chunk's (the scores X' Q^T above) or the W - 1 rows before it (a [BT, 16] block)
        o_j = tl.arange(0, 16)
        o_r = i_t * BT - 16 + o_j
        m_r = (o_j >= 16 - (WIN - 1)) & (o_r >= 0)
        b_qr = tl.load(q + ((bos + o_r) * H + i_h)[:, None] * K + o_k[None, :],
                       mask=m_r[:, None] & (o_k < K)[None, :], other=0)
        b_dor = tl.load(do + ((bos + o_r) * HV + i_hv)[:, None] * V + o_v[None, :],
                        mask=m_r[:, None] & (o_v < V)[None, :], other=0)
        b_bw = _band_w(wm, bos, i_hv, HV, o_t, m_t, o_t, WIN, True)
        b_br = _band_w(wm, bos, i_hv, HV, o_r, m_r, o_t, WIN, True)
        b_dvb = tl.dot((b_sr * b_bw * scale).to(b_do.dtype), b_do)
        b_dvb += tl.dot((tl.dot(b_x, tl.trans(b_qr)) * b_br * scale).to(b_do.dtype), b_dor)
        tl.store(dvb + p_tv, b_dvb, mask=m_tv)


@triton.autotune(configs=CONFIGS_H, key=['H', 'HV', 'K', 'V', 'BT', 'BK', 'DELTA', 'PER_COL', 'IS_VARLEN'],
                 restore_value=['du'])
@triton.jit
def _bwd_dhu(q, k, last_k, count, G, W, do, du, dh, dht, dh0, scale,
             cu_seqlens, chunk_offsets, T,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             SHIFT: tl.constexpr, DELTA: tl.constexpr, PER_COL: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
             USE_FINAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr, QT: tl.constexpr = True):
    """Reverse over chunks: dh[c] = gradient of the state at the end of chunk c (falcon1 also adds the
    state path exp(G_C - G) X dh to dU, which its state gradient needs). Key blocks as in _fwd_h (BK covers K
    for falcon1: its dU sums over all of them). The queries and W loaded as [BK, BT], as the products take them
    (QT, as _fwd_h's KT; QT=0 in benchmarks/sweep_configs.py times the transposed form: a tie at the 64-wide key
    blocks, fifty-fifth lease)."""
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0).to(tl.float32)
    for i_t in range(NT - 1, -1, -1):
        tl.store(dh + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        last = min(i_t * BT + BT, T) - 1
        b_q = _load_rows(q, bos, o_t, m_t, o_k, i_h, H, K, QT)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0)
        if PER_COL:
            b_G = tl.load(G + p_tv, mask=m_tv, other=0)
            b_Gl = tl.load(G + ((bos + last) * HV + i_hv) * V + o_v, mask=o_v < V, other=0)
            b_dod = (b_do * tl.exp(b_G) * scale).to(b_q.dtype)
            b_dh_next = b_dh
            b_dh = b_dh * tl.exp(b_Gl)[None, :] + tl.dot(_keys_t(b_q, QT), b_dod)
        else:
            b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
            b_Gl = tl.load(G + (bos + last) * HV + i_hv)
            b_dod = (b_do * (tl.exp(b_G) * scale)[:, None]).to(b_q.dtype)
            b_dh_next = b_dh
            b_dh = b_dh * tl.exp(b_Gl) + tl.dot(_keys_t(b_q, QT), b_dod)
        if DELTA:
            # the state path of dU is needed here (dS0 -= W^T dU); the other rules add it in the
            # parallel per-chunk kernel, which keeps this sequential loop short
            b_x, valid = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
            b_du = tl.load(du + p_tv, mask=m_tv, other=0)
            b_du += tl.dot(b_x, b_dh_next.to(b_q.dtype)) * tl.exp(b_Gl - b_G)[:, None]
            tl.store(du + p_tv, b_du, mask=m_tv)
            b_w = _load_rows(W, bos, o_t, m_t, o_k, i_hv, HV, K, QT)
            b_dh -= tl.dot(_keys_t(b_w, QT), b_du.to(b_w.dtype))
    if USE_INITIAL_STATE:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + p_kv, b_dh, mask=m_kv)


@triton.jit
def _dqx_state_side(v, tail_v, count, dh, du, dv, dvb, dtail_v, b_x, b_G, b_Gl, b_eta, b_dxs, b_deta, i_n, i_hv, bos,
                    o_t, m_t, o_v, p_kv, m_kv, p_tv, m_tv, HV: tl.constexpr, V: tl.constexpr, WIN: tl.constexpr,
                    SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """_bwd_dqx's state side for one value block (falcon1a, falcon3a): dU gets its state path (falcon1 added it in
    _bwd_dhu), dv = eta dU (falcon3a: + the band's part that _bwd_dv_local or _win_bwd_band left in dvb) is stored;
    returns the accumulated u dh^T (the state's share of dx) and deta = rowsum(dU * v). dh feeds tensor-core
    products only (see the <h, dh> loop of _bwd_dqx)."""
    dt = b_x.dtype
    b_dh = tl.load(dh + p_kv, mask=m_kv, other=0)
    b_du = tl.load(du + p_tv, mask=m_tv, other=0)
    b_du += tl.dot(b_x, b_dh.to(dt)) * tl.exp(b_Gl - b_G)[:, None]
    b_v = _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
    b_deta += tl.sum(b_du * b_v, 1)
    b_dvs = b_du * b_eta[:, None]
    if WIN > 1:
        b_dvs += tl.load(dvb + p_tv, mask=m_tv, other=0).to(tl.float32)
        # dv' of the delayed row t is dv of its pair p = t - (W - 1), stored there; the sequence's first W - 1 rows
        # are the carried tail's pairs, whose gradient is state: fp32, in dtail_v
        if USE_INITIAL_STATE:
            tl.store(dtail_v + ((i_n * HV + i_hv) * (WIN - 1) + o_t)[:, None] * V + o_v[None, :], b_dvs,
                     mask=m_tv & (o_t < WIN - 1)[:, None])
        tl.store(dv + p_tv - (WIN - 1) * HV * V, b_dvs.to(dv.dtype.element_ty), mask=m_tv & (o_t >= WIN - 1)[:, None])
    else:
        tl.store(dv + p_tv, b_dvs.to(dv.dtype.element_ty), mask=m_tv)
    b_dxs += tl.dot((b_v * b_eta[:, None]).to(dt), tl.trans(b_dh.to(dt)))
    return b_dxs, b_deta


@triton.autotune(configs=CONFIGS_DQX, key=['H', 'HV', 'K', 'V', 'BT', 'DELTA', 'WIN', 'HAS_FINAL', 'BAND',
                                              'IS_VARLEN', 'SPLIT_1A'],
                 prune_configs_by={'early_config_prune': _dqx_prune})
@triton.jit
def _bwd_dqx(q, k, v, beta, lam, last_k, count, tail_x, tail_v, G, eta, vn, h, dh, do, du, dq, dx, dG, dw, dv, dvb,
             dtail_v, dxt, dk, dlast_k, dbeta, dlam, ds_buf, c, gl, wm, fm, yz, dqb, dxb, dMb, scale, eps, eps_gamma,
             cu_seqlens, chunk_indices, chunk_offsets, T,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             SHIFT: tl.constexpr, DELTA: tl.constexpr, WIN: tl.constexpr, HAS_LAM: tl.constexpr,
             LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
             HAS_FINAL: tl.constexpr = False, BAND: tl.constexpr = 0, SPLIT_1A: tl.constexpr = False):
    """Per chunk: dq, the output/state part of dx and dG of those paths. falcon1 stores them with
    dW = -dU h^T for `_bwd_gates`; falcon1a (dv = eta dU, deta = rowsum(dU * v)) finishes here with
    the gates' chain rule and writes dk, dbeta, dlam (SPLIT_1A: in two value passes, see SPLIT below). falcon3a (its
    delayed GLA rows, eta = mt) also does the band (see _fwd_o) and stores dq, dx' and dv' (summed in fp32; dv' = mt
    dU' + the band's part that _bwd_dv_local left in dvb), dG of the GLA, and the window weights' gradients as per-row
    terms yz (see _win_bwd_gates). The band (BAND_FORM): BAND 0 ('fold') on the GLA's score products; 1 ('gather') its
    dq, dx', dv' and dMb from _win_bwd_band (dqb, dxb, dvb, dMb)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    last = min(i_t * BT + BT, T) - 1
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    # falcon3a (SPLIT; falcon1a with SPLIT_1A) runs the value blocks twice: the output side (dq and the scores) first,
    # finished and stored before the state side (du, dv, dx) begins, so that the two [BT, BK] fp32 accumulators are not
    # live together (one pass held 255 registers per thread and spilled 8-56 B at K = V = 128 bf16; aot_check, sm_90).
    # falcon1a's split (LATE) also loads q and x after the output side, which reads neither
    SPLIT: tl.constexpr = WIN > 0 or (not DELTA and SPLIT_1A)
    LATE: tl.constexpr = SPLIT and WIN == 0
    dt: tl.constexpr = q.dtype.element_ty
    p_q = q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    if not LATE:
        b_q = tl.load(p_q, mask=m_tk, other=0)
        b_x, valid = _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H, K, WIN, SHIFT,
                                 USE_INITIAL_STATE)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_Gl = tl.load(G + (bos + last) * HV + i_hv)
    b_eta = tl.load(eta + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dxs = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)
    b_deta = tl.zeros([BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    if WIN > 1 and BAND == 0:
        # falcon3a's band beyond the chunk's [BT, BT] scores: for its rows, the last W - 1 pairs o_e of the chunk (their
        # delayed rows lie past it, see _fwd_o); for its delayed rows, the W - 1 rows o_r before the chunk
        o_j = tl.arange(0, 16)
        o_e = last + 1 - (WIN - 1) + o_j
        m_e = o_j < WIN - 1
        b_xe, valid_e = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_e, m_e, H, K, BK, WIN, SHIFT,
                                    USE_INITIAL_STATE)
        o_r = i_t * BT - 16 + o_j
        m_r = (o_j >= 16 - (WIN - 1)) & (o_r >= 0)
        b_dse = tl.zeros([BT, 16], dtype=tl.float32)     # do_t.v_e
        b_dsr = tl.zeros([BT, 16], dtype=tl.float32)     # v'_s.do_r
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
        p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_h = tl.load(h + p_kv, mask=m_kv, other=0)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0)
        if DELTA:
            b_dh = tl.load(dh + p_kv, mask=m_kv, other=0)
            b_du = tl.load(du + p_tv, mask=m_tv, other=0)
            b_u = tl.load(vn + p_tv, mask=m_tv, other=0).to(dt)
            b_dw += tl.dot(b_du.to(dt), tl.trans(b_h.to(dt)))
            b_ds += tl.dot(b_do.to(dt), tl.trans(b_u))
            b_dst += tl.dot(b_u, tl.trans(b_do.to(dt)))
            b_dxs += tl.dot(b_u, tl.trans(b_dh.to(dt)))
        elif WIN > 0:
            # falcon3a: the unweighted scores do_t.v'_s (mt is applied after the loop, the band's weights too)
            b_vd = _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
            b_ds += tl.dot(b_do.to(dt), tl.trans(b_vd.to(dt)))
            if WIN > 1 and BAND == 0:
                b_ve = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_e, m_e, o_v, HV, V, WIN, SHIFT,
                                   USE_INITIAL_STATE)
                b_dse += tl.dot(b_do.to(dt), tl.trans(b_ve.to(dt)))
                b_dor = tl.load(do + ((bos + o_r) * HV + i_hv)[:, None] * V + o_v[None, :],
                                mask=m_r[:, None] & (o_v < V)[None, :], other=0)
                b_dsr += tl.dot(b_vd.to(dt), tl.trans(b_dor.to(dt)))
        else:
            b_v = _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
            b_ds += tl.dot(b_do.to(dt), tl.trans((b_v * b_eta[:, None]).to(dt)))
            if not SPLIT:
                b_dxs, b_deta = _dqx_state_side(v, tail_v, count, dh, du, dv, dvb, dtail_v, b_x, b_G, b_Gl, b_eta,
                                                b_dxs, b_deta, i_n, i_hv, bos, o_t, m_t, o_v, p_kv, m_kv, p_tv, m_tv,
                                                HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        b_dq += tl.dot(b_do.to(dt), tl.trans(b_h.to(dt)))
    if LATE:
        b_q = tl.load(p_q, mask=m_tk, other=0)
        b_x, valid = _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H, K, WIN, SHIFT,
                                 USE_INITIAL_STATE)
    m_s = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]   # real t only (see _fwd_o)
    b_dsw = b_ds
    b_ds = tl.where(m_s, b_ds * tl.exp(tl.where(m_s, b_G[:, None] - b_G[None, :], 0.)), 0.) * scale
    if WIN > 0:
        b_ds *= b_eta[None, :]
    # the decay gradient below is the GLA's, q.dq - x.dx: the band's shares of q.dq (b_qb) and x.dx (b_xb) come out
    b_qb = tl.zeros([BT], dtype=tl.float32)
    b_xb = tl.zeros([BT], dtype=tl.float32)
    b_dM = tl.zeros([BT, 8], dtype=tl.float32)
    o_d = tl.arange(0, 8)
    if WIN > 1 and BAND == 1:
        b_dM = tl.load(dMb + ((bos + o_t) * HV + i_hv)[:, None] * 8 + o_d[None, :],
                       mask=m_t[:, None] & (o_d < WIN - 1)[None, :], other=0)
        if HAS_FINAL:   # the final state's band (_win_bwd_final), on the sequence's last step
            b_fm = tl.load(fm + (i_n * HV + i_hv) * 16 + 15 - o_d, mask=o_d < WIN - 1, other=0)
            b_dM += tl.where((o_t == T - 1)[:, None], b_fm[None, :], 0.)
    elif WIN > 1:
        # the band: scale Mb[t, d] on the same scores at s = t + W - 1 - d (see _fwd_o), so its dq and dx' ride on
        # the GLA's two products below; dMb[t, d] = scale (q_t.x'_s)(do_t.v'_s) there
        b_sd = b_dsw * tl.dot(b_q, tl.trans(b_x)) * scale
        b_se = tl.dot(b_q, tl.trans(b_xe)) * b_dse * scale
        b_bw = _band_w(wm, bos, i_hv, HV, o_t, m_t, o_t, WIN, False)
        b_be = _band_w(wm, bos, i_hv, HV, o_t, m_t, o_e + WIN - 1, WIN, False)
        for d in tl.static_range(WIN - 1):
            m_d = o_t[None, :] - o_t[:, None] == WIN - 1 - d
            m_de = o_t[:, None] - o_e[None, :] == d
            b_dMd = tl.sum(tl.where(m_d, b_sd, 0.), 1) + tl.sum(tl.where(m_de, b_se, 0.), 1)
            if HAS_FINAL:   # the final state's band (_win_bwd_final), on the sequence's last step
                b_dMd += tl.load(fm + (i_n * HV + i_hv) * 16 + 15 - d + o_t * 0, mask=m_t & (o_t == T - 1), other=0)
            b_dM = tl.where(o_d[None, :] == d, b_dMd[:, None], b_dM)
        b_ds += b_dsw * b_bw * scale
        b_sd *= b_bw
        b_qb = tl.sum(b_sd, 1) + tl.sum(b_se * b_be, 1)
        b_xb = tl.sum(b_sd, 0)
    # dq first, stored before dx is formed: fewer [BT, BK] fp32 tiles live at once
    b_dq = b_dq * (tl.exp(b_G) * scale)[:, None] + tl.dot(b_ds.to(dt), b_x)
    if WIN > 1 and BAND == 0:
        b_dq += tl.dot((b_dse * b_be * scale).to(dt), b_xe)
    # decay gradient of the output and state paths: q.dq - x.dx, plus <dh_next, S_next> at the last row
    b_dG = tl.sum(b_q.to(tl.float32) * b_dq, 1) - b_qb
    if WIN > 1 and BAND == 1:   # the band's dq, after the GLA's decay gradient
        b_dq += tl.load(dqb + ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    p_tk = ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :]
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    o_s = tl.arange(0, BT)
    if DELTA:
        m_st = (o_t[:, None] <= o_t[None, :]) & m_t[None, :]
        b_dst = tl.where(m_st, b_dst * tl.exp(tl.where(m_st, b_G[None, :] - b_G[:, None], 0.)), 0.) * scale
    else:
        # falcon1a, falcon3a: ds^T through a scratch buffer (a transposed dot result fed into tl.dot miscompiles on
        # Hopper) instead of a second [BT, BT] product accumulated in the value loop: with both, ptxas spilled ~260 B
        # per thread at K = V = 128 (aot_check, sm_90)
        tl.store(ds_buf + ((bos + o_t) * HV + i_hv)[:, None] * BT + o_s[None, :], b_ds, mask=m_t[:, None])
        tl.debug_barrier()
    if SPLIT:
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
            p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
            b_dxs, b_deta = _dqx_state_side(v, tail_v, count, dh, du, dv, dvb, dtail_v, b_x, b_G, b_Gl, b_eta, b_dxs,
                                            b_deta, i_n, i_hv, bos, o_t, m_t, o_v, p_kv, m_kv, p_tv, m_tv, HV, V, WIN,
                                            SHIFT, USE_INITIAL_STATE)
    # <h, dh> from loads of their own. Triton 3.6's pipeliner (Hopper, num_stages >= 2) gives a tile that feeds both an
    # asynchronous tl.dot and register code one shared-memory slot too few: the copy of a later value block then lands
    # in the slot the dot above still reads (dq, dx wrong now and then on the H200; scripts/wgmma_hazards.py finds it
    # in the compiled kernel). So h and dh above feed tensor-core products only
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
        p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        b_hdh += tl.sum(tl.load(h + p_kv, mask=m_kv, other=0).to(tl.float32) *
                        tl.load(dh + p_kv, mask=m_kv, other=0).to(tl.float32), 1)
    if not DELTA:
        b_dst = tl.load(ds_buf + ((bos + o_t) * HV + i_hv)[None, :] * BT + o_s[:, None], mask=m_t[None, :], other=0)
    b_xf = b_x.to(tl.float32)
    b_dxs = b_dxs * tl.exp(b_Gl - b_G)[:, None]
    b_end = tl.exp(b_Gl) * tl.sum(b_hdh, 0) + tl.sum(tl.sum(b_xf * b_dxs, 1), 0)
    if LATE:   # again: not held in registers through the state side
        b_q = tl.load(p_q, mask=m_tk, other=0)
    b_dx = b_dxs + tl.dot(b_dst.to(dt), b_q)
    if WIN > 1 and BAND == 0:
        # the rows before the chunk: scale Mb[r, d] (q_r.x'_s)(do_r.v'_s) at s = r + W - 1 - d
        b_qr = tl.load(q + ((bos + o_r) * H + i_h)[:, None] * K + o_k[None, :],
                       mask=m_r[:, None] & (o_k < K)[None, :], other=0)
        b_dsr = b_dsr * _band_w(wm, bos, i_hv, HV, o_r, m_r, o_t, WIN, True) * scale
        b_dx += tl.dot(b_dsr.to(dt), b_qr)
        b_xb += tl.sum(b_dsr * tl.dot(b_x, tl.trans(b_qr)), 1)
    b_dG -= tl.sum(b_xf * b_dx, 1) - b_xb
    b_dG += tl.where(o_t == last, b_end, 0.)
    if WIN > 1 and BAND == 1:   # the band's dx', after the GLA's decay gradient
        b_dx += tl.load(dxb + ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    if DELTA:
        tl.store(dx + p_tk, b_dx, mask=m_tk)
        tl.store(dG + (bos + o_t) * HV + i_hv, b_dG, mask=m_t)
        tl.store(dw + p_tk, -b_dw, mask=m_tk)
    elif WIN > 0:
        tl.store(dx + p_tk, b_dx.to(dx.dtype.element_ty), mask=m_tk)
        if USE_INITIAL_STATE:   # the sequence's first W rows: dx' of the pairs that give the carried state's gradients
            tl.store(dxt + ((i_n * HV + i_hv) * 8 + o_t)[:, None] * K + o_k[None, :], b_dx,
                     mask=m_tk & (o_t < WIN)[:, None])
        tl.store(dG + (bos + o_t) * HV + i_hv, b_dG, mask=m_t)
        # the window weights' gradients (dmt = deta, dMb) as per-row terms: with w[t, d] = dmt_t + sum_{d' >= d}
        # dMb[t, d'] (mt = wm[., W - 1], Mb[t, d] = wm[t, d] = sum_{j <= d} c_{t-j} e[t, j], e[t, j] = exp(g_{t-j+1} +
        # ... + g_t)): dc_{t-j} += w[t, j] e[t, j] =: y[t, j], and g_s (t - j < s <= t) gets z[t, j] = y[t, j] c_{t-j},
        # so dg_{t-i} += Zs[t, i + 1] = sum_{j > i} z[t, j]. Stores y (yz[., 0:8]) and Zs (yz[., 8:16])
        b_wt = b_deta[:, None] + (tl.sum(b_dM, 1)[:, None] - tl.cumsum(b_dM, 1) + b_dM)
        b_c, b_e = _win_ce(c, gl, bos, i_hv, HV, o_t, m_t, o_d, BT, WIN)
        b_y = tl.where(o_d[None, :] < WIN, b_wt * b_e, 0.)
        b_z = b_y * b_c
        p_yz = ((bos + o_t) * HV + i_hv)[:, None] * 16 + o_d[None, :]
        tl.store(yz + p_yz, b_y, mask=m_t[:, None])
        tl.store(yz + p_yz + 8, tl.sum(b_z, 1)[:, None] - tl.cumsum(b_z, 1) + b_z, mask=m_t[:, None])
    else:
        b_E, b_lp, b_den, b_eta, b_a, clamped, b_g = _gates(
            b_xf, beta, lam, bos, o_t, valid, i_hv, HV, eps, eps_gamma, HAS_LAM, LAM_COUPLED)
        b_dbeta, b_dlp, b_dden = _gates_bwd(b_dG, tl.zeros([BT], dtype=tl.float32), b_deta, b_lp, b_den, b_eta,
                                            b_a, clamped, valid)
        _store_gate_grads(b_xf, b_dx, b_dbeta, b_dlp, b_dden, b_E, valid, dk, dlast_k, dbeta, dlam, i_n, i_t,
                          i_hv, bos, o_t, m_t, T, HV, K, BK, SHIFT, HAS_LAM, LAM_COUPLED, USE_INITIAL_STATE)


@triton.autotune(configs=CONFIGS, key=['H', 'HV', 'K', 'V', 'BT', 'IS_VARLEN'])
@triton.jit
def _bwd_gates(k, v, beta, lam, last_k, count, G, A, dP, dx, dG, dw, du, dv, dk, dlast_k, dbeta, dlam,
               eps, eps_gamma, cu_seqlens, chunk_indices, chunk_offsets, T,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               SHIFT: tl.constexpr, HAS_LAM: tl.constexpr, LAM_COUPLED: tl.constexpr,
               USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """falcon1's WY backward, then the gates' chain rule; writes dk (shifted back by one token), the
    carried last key's gradient, dv, dbeta and dlam. Keys go in BK-wide blocks (BK <= 64) and the gates scale
    the [BT, BT] products after them, so no [BT, K] tile outlives its block: with all of K at once the kernel
    held 255 registers per thread at 8 warps (one program per SM) and spilled 600 B at 4 (aot_check, sm_90)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_s = tl.arange(0, BT)
    dt = k.dtype.element_ty   # matmul inputs in the inputs' dtype, as in the forward
    p_A = ((bos + o_t) * HV + i_hv)[:, None] * BT + o_s[None, :]
    # A^T, loaded through transposed pointers (row s of A^T is column s of A)
    p_At = ((bos + i_t * BT + o_s) * HV + i_hv)[None, :] * BT + o_s[:, None]
    b_At = tl.load(A + p_At, mask=m_t[None, :], other=0).to(dt)
    # W = A diag(b) X: dA = dW (bX)^T + ... = (dW X^T) diag(b); first the key blocks' products, which need no gate:
    # the energy E, dW X^T, X X^T and db = rowsum(A^T dW * X)
    b_E = tl.zeros([BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dWX = tl.zeros([BT, BT], dtype=tl.float32)
    b_XX = tl.zeros([BT, BT], dtype=tl.float32)
    valid = m_t
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_x, valid = _load_x_cols(k, last_k, count, i_n, i_h, bos, o_t, m_t, o_k, H, K, SHIFT, USE_INITIAL_STATE)
        b_dw = tl.load(dw + ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(dt)
        b_xf = b_x.to(tl.float32)
        b_E += tl.sum(b_xf * b_xf, 1)
        b_dWX += tl.dot(b_dw, tl.trans(b_x))
        b_XX += tl.dot(b_x, tl.trans(b_x))
        b_db += tl.sum(tl.dot(b_At, b_dw) * b_xf, 1)
    b_lp, b_den, b_eta, b_a, clamped, b_g = _gates_e(b_E, beta, lam, bos, o_t, valid, i_hv, HV, eps, eps_gamma,
                                                     HAS_LAM, LAM_COUPLED)
    b_G = tl.load(G + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_Gx = b_G - b_g
    b_b = b_eta * tl.exp(b_Gx)
    # U0 = A diag(eta) V: dA += (dU V^T) diag(eta)
    b_dA = b_dWX * b_b[None, :]
    b_deta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0)
        b_du = tl.load(du + p_tv, mask=m_tv, other=0).to(dt)
        b_dA += tl.dot(b_du, tl.trans(b_v.to(dt))) * b_eta[None, :]
        b_Atdu = tl.dot(b_At, b_du)
        tl.store(dv + p_tv, (b_Atdu * b_eta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_deta += tl.sum(b_Atdu * b_v.to(tl.float32), 1)
    # A = (I + L)^-1: dL = -A^T dA A^T on the strictly lower part
    b_dL = -tl.dot(tl.dot(b_At, b_dA.to(dt)).to(dt), b_At)
    m_l = (o_s[:, None] > o_s[None, :]) & m_t[:, None]   # real t only (see _fwd_o)
    b_F = tl.where(m_l, tl.exp(tl.where(m_l, b_Gx[:, None] - b_G[None, :], 0.)), 0.)    # [t, s]
    b_P = b_dL * b_F * b_eta[:, None]
    # P^T through a scratch buffer: a transposed dot result fed into tl.dot miscompiles on Hopper
    tl.store(dP + p_A, b_P.to(dP.dtype.element_ty), mask=m_t[:, None])
    b_R = b_dL * b_F * b_XX
    b_deta += tl.sum(b_R, 1)
    b_Q = b_R * b_eta[:, None]
    b_dG = tl.load(dG + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_dG += tl.sum(b_Q, 1) - tl.sum(b_Q, 0)
    b_dgd = -tl.sum(b_Q, 1)   # direct gradient of g_t (outside the cumsum)
    b_deta += b_db * tl.exp(b_Gx)
    b_dG += b_db * b_b
    b_dgd -= b_db * b_b
    b_dbeta, b_dlp, b_dden = _gates_bwd(b_dG, b_dgd, b_deta, b_lp, b_den, b_eta, b_a, clamped, valid)
    _store_gates(b_dbeta, b_dlp, b_E, dbeta, dlam, bos, o_t, m_t, i_hv, HV, HAS_LAM, LAM_COUPLED)
    tl.debug_barrier()
    # dX = P X + P^T X + (A^T dW) diag(b) + dx + 2 dden X (the energy); P and P^T do not overlap (strictly lower
    # and upper), so their sum in dt rounds as each alone
    b_PP = (b_P + tl.load(dP + p_At, mask=m_t[None, :], other=0).to(tl.float32)).to(dt)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :]
        b_x, _ = _load_x_cols(k, last_k, count, i_n, i_h, bos, o_t, m_t, o_k, H, K, SHIFT, USE_INITIAL_STATE)
        b_dw = tl.load(dw + p_tk, mask=m_tk, other=0).to(dt)
        b_dx = tl.dot(b_PP, b_x) + tl.dot(b_At, b_dw) * b_b[:, None] + tl.load(dx + p_tk, mask=m_tk, other=0)
        b_dx += (2 * b_dden)[:, None] * b_x.to(tl.float32)
        _store_dk_cols(b_dx, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, o_k, T, HV, K, SHIFT,
                       USE_INITIAL_STATE)


# ----------------------------------------------------------------------------------------------
# falcon2a: per-column decays. Inside a chunk, exp(G_t - G_s) differs per value column, so it cannot be folded
# into a [BT, BT] score matrix as GLA folds its per-key decays. The intra-chunk products go by 16-row sub-chunks,
# each factored at one reference row r: exp(G_t - G_s) = exp(G_t - G_r) exp(G_r - G_s), one factor on each side of
# a tensor-core product. With r the first row of the output sub-chunk (outputs; the last row of the input
# sub-chunk for dU), every factor is <= 1 except inside the sub-chunk itself, where it is at most e^span, span =
# the decay across the sub-chunk (max over columns of G_f - G_t): when span <= DIAG_SPAN (factors in
# [e^-80, e^80]: no fp32 or bf16 overflow), one product covers the whole causal range. Strong decay (the clamp
# active for a few steps in a row) takes the exact path: the other sub-chunks factored at the boundary row (both
# factors <= 1) and the diagonal 16 x 16 block one offset at a time, elementwise in fp32 (_diag16_offsets).
# ----------------------------------------------------------------------------------------------

DIAG_SPAN = tl.constexpr(80.0)
# A chunk whose decay spans at most CHUNK_SPAN in every column (the usual case: the clamp is rarely active for long)
# goes in one [BT, BT] product, factored at one row of the chunk (its first; the last for dU), instead of one product
# per 16-row sub-chunk: four times fewer exponentials of [BT, BV] tiles, and 64-wide tensor-core tiles. The bound
# keeps the factors that grow (<= e^CHUNK_SPAN) far from fp32's and bf16's range; a larger span takes the sub-chunks.
CHUNK_SPAN = tl.constexpr(40.0)


@triton.jit
def _diag16_offsets(b_acc, b_P, r_p, X, beta, rg, G, b_Gc, bos, row0, i_hv, T, r_c, m_vc, o_v, m_v,
                    HV: tl.constexpr, V: tl.constexpr, FWD: tl.constexpr):
    """b_acc [BV, 16], transposed (columns c: the rows r_c = row0 + 0..15 of one sub-chunk), plus that sub-chunk's
    diagonal block one offset d at a time, elementwise in fp32: the exact path when the decay inside it spans more
    than DIAG_SPAN. P [BT, 16] holds the chunk's rows r_p against the sub-chunk's, masked to the causal side.
    FWD: sum_{d <= c} P[row0 + d, c] exp(G_c - G_d) eta_d X_d; else sum_{d >= c} P[row0 + d, c] exp(G_d - G_c) X_d."""
    for d in range(16):
        r_d = row0 + d
        b_pd = tl.sum(tl.where((r_p == r_d)[:, None], b_P, 0.), 0)
        p_d = ((bos + r_d) * HV + i_hv) * V + o_v
        # (vector masks: the interpreter cannot mix a scalar bool into one)
        m_d1 = m_v & ((r_d + o_v * 0) < T)
        b_Gd = tl.load(G + p_d, mask=m_d1, other=0)
        b_xd = tl.load(X + p_d, mask=m_d1, other=0).to(tl.float32)
        # the exponent is masked to the causal side of real rows: elsewhere it may be large and positive
        if FWD:
            b_xd = b_xd * _col_eta(beta, rg, p_d, m_d1, V)
            m_dc = m_vc & ((r_c >= r_d) & ((r_d + r_c * 0) < T))[None, :]
            b_e = tl.where(m_dc, b_Gc - b_Gd[:, None], 0.)
        else:
            m_dc = m_vc & ((r_c <= r_d) & ((r_d + r_c * 0) < T))[None, :]
            b_e = tl.where(m_dc, b_Gd[:, None] - b_Gc, 0.)
        b_acc += tl.where(m_dc, b_xd[:, None] * b_pd[None, :] * tl.exp(b_e), 0.)
    return b_acc


@triton.autotune(configs=[triton.Config({}, num_warps=w, num_stages=2) for w in (4, 8)],
                 key=['H', 'HV', 'K', 'V', 'BT', 'IS_VARLEN'])
@triton.jit
def _fwd_o_col(q, k, v, last_k, count, G, beta, rg, h, o, o_lo, scale,
               cu_seqlens, chunk_indices, chunk_offsets, T,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, SAVE_LO: tl.constexpr, IS_VARLEN: tl.constexpr):
    """o_t = scale (exp(G_t) * (q_t^T S0) + sum_{s <= t} (q_t.x_s) exp(G_t - G_s) * u_s) per column, u = eta v.

    Computed transposed, a [BV, 16] tile per 16-row sub-chunk a of output rows, so that every product has BV or BT
    rows (Hopper's tensor-core tiles have 64; with 16-row products this kernel took 849 us where fla's simple-GLA
    output kernel takes 131). For each a, one product over all s <= t factored at a's first row f:
    exp(G_t - G_f) <= 1 outside, exp(G_f - G_s) <= 1 for s < f and <= e^DIAG_SPAN inside a when the decay there
    spans at most DIAG_SPAN; else the earlier rows factored at the row before f (both factors <= 1) and the
    diagonal block one offset at a time. A chunk whose decay spans at most CHUNK_SPAN takes one [BV, BT] tile for all
    its rows instead, factored at its first row."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # the chunk's rows s: x [BT, BK], G and u transposed [BV, BT]; the state transposed [BV, BK]
    r_s = i_t * BT + tl.arange(0, BT)
    m_s = r_s < T
    b_x, valid = _load_x(k, last_k, count, i_n, i_h, bos, r_s, m_s, H, K, BK, SHIFT, USE_INITIAL_STATE)
    m_vs = m_v[:, None] & m_s[None, :]
    p_vs = ((bos + r_s) * HV + i_hv)[None, :] * V + o_v[:, None]
    b_Gs = tl.load(G + p_vs, mask=m_vs, other=0)
    b_rdT = _col_rg(rg, bos, r_s, m_s, i_hv, HV)[1]
    b_us = (tl.load(v + p_vs, mask=m_vs, other=0).to(tl.float32) * tl.load(beta + p_vs, mask=m_vs, other=0).to(
        tl.float32) * b_rdT[None, :])
    b_hT = tl.load(h + ((boh + i_t) * HV + i_hv) * K * V + o_k[None, :] * V + o_v[:, None],
                   mask=m_v[:, None] & m_k[None, :], other=0).to(dt)
    # the whole chunk at once when its decay spans at most CHUNK_SPAN, factored at its first row r
    b_Gr = tl.load(G + ((bos + i_t * BT) * HV + i_hv) * V + o_v, mask=m_v, other=0)
    # the whole chunk's q loaded with the other tiles, before the span decision: one round trip to memory less on
    # the whole-chunk branch's serial path (-2.6% / -2.0% at (4, 4096) / (1, 16384), H100, forty-second lease)
    # (b_qC: a name of its own: the 16-row loop below assigns b_qT at [BK, 16], and Triton 3.6 refuses a
    # loop-carried variable whose shape changes)
    b_qC = tl.load(q + ((bos + r_s) * H + i_h)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_s[None, :],
                   other=0)
    span_c = tl.max(tl.max(tl.where(m_vs, b_Gr[:, None] - b_Gs, 0.), 1), 0)
    if span_c <= CHUNK_SPAN:
        b_o = tl.dot(b_hT, b_qC) * tl.exp(b_Gs)
        b_At = tl.where(r_s[:, None] <= r_s[None, :], tl.dot(b_x, b_qC), 0.)
        b_in = tl.where(m_vs, b_us * tl.exp(tl.where(m_vs, b_Gr[:, None] - b_Gs, 0.)), 0.)
        b_o += tl.where(m_vs, tl.dot(b_in.to(dt), b_At.to(dt)) * tl.exp(tl.where(m_vs, b_Gs - b_Gr[:, None], 0.)), 0.)
        b_o = b_o * scale
        b_oh = b_o.to(o.dtype.element_ty)
        tl.store(o + p_vs, b_oh, mask=m_vs)
        if SAVE_LO:
            tl.store(o_lo + p_vs, (b_o - b_oh.to(tl.float32)).to(o_lo.dtype.element_ty), mask=m_vs)
    else:
        for a in range(BT // 16):
            f = i_t * BT + a * 16
            r_t = f + o_c
            m_t = r_t < T
            m_vt = m_v[:, None] & m_t[None, :]
            p_vt = ((bos + r_t) * HV + i_hv)[None, :] * V + o_v[:, None]
            b_qT = tl.load(q + ((bos + r_t) * H + i_h)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                           other=0)
            b_Gt = tl.load(G + p_vt, mask=m_vt, other=0)
            b_o = tl.dot(b_hT, b_qT) * tl.exp(b_Gt)
            # x_s . q_t for s <= t: [BT, 16]
            b_At = tl.where(r_s[:, None] <= r_t[None, :], tl.dot(b_x, b_qT), 0.)
            b_Gf = tl.load(G + ((bos + f) * HV + i_hv) * V + o_v, mask=m_v & ((f + o_v * 0) < T), other=0)
            span = tl.max(tl.max(tl.where(m_vt, b_Gf[:, None] - b_Gt, 0.), 1), 0)
            if span <= DIAG_SPAN:
                m_in = m_vs & (r_s < f + 16)[None, :]
                b_Gr = b_Gf
            else:
                # rows s < f: G at the row before f (a = 0 has none: the load is masked, m_in empty)
                m_in = m_vs & (r_s < f)[None, :]
                b_Gr = tl.load(G + ((bos + f - 1) * HV + i_hv) * V + o_v, mask=m_v & ((f + o_v * 0) > i_t * BT),
                               other=0)
            b_in = tl.where(m_in, b_us * tl.exp(tl.where(m_in, b_Gr[:, None] - b_Gs, 0.)), 0.)
            b_o += tl.where(m_vt, tl.dot(b_in.to(dt), b_At.to(dt))
                            * tl.exp(tl.where(m_vt, b_Gt - b_Gr[:, None], 0.)), 0.)
            if span > DIAG_SPAN:
                b_o = _diag16_offsets(b_o, b_At, r_s, v, beta, rg, G, b_Gt, bos, f, i_hv, T, r_t, m_vt, o_v,
                                      m_v, HV, V, True)
            b_o = b_o * scale
            b_oh = b_o.to(o.dtype.element_ty)
            tl.store(o + p_vt, b_oh, mask=m_vt)
            if SAVE_LO:
                # the output's rounding residual for the decay gradient (dG = o * do - u * du: _col_outputs)
                tl.store(o_lo + p_vt, (b_o - b_oh.to(tl.float32)).to(o_lo.dtype.element_ty), mask=m_vt)


@triton.jit
def _next_state(h, ht, p_h, p_kv, m, m_next, i_n, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                HAS_FINAL: tl.constexpr):
    """A tile of the state at a chunk's end, fp32: the next chunk's start state (h at p_h, this chunk's, plus one
    chunk) where m_next, else (the sequence's last chunk) the final state ht at p_kv of sequence i_n when HAS_FINAL
    (its gradient was given), else 0 (no gradient reaches it)."""
    b_h = tl.load(h + p_h + HV * K * V, mask=m & m_next, other=0).to(tl.float32)
    if HAS_FINAL:
        b_h += tl.load(ht + (i_n * HV + i_hv) * K * V + p_kv, mask=m & ~m_next, other=0)
    return b_h


@triton.autotune(configs=[triton.Config({}, num_warps=w, num_stages=2) for w in (4, 8)],
                 key=['H', 'HV', 'K', 'V', 'BT', 'IS_VARLEN'])
@triton.jit
def _bwd_dv_local_col(q, k, last_k, count, G, h, ht, dh, end, do, du, scale,
                      cu_seqlens, chunk_indices, chunk_offsets, T,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STATE: tl.constexpr,
                      HAS_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dU_s = scale sum_{t >= s} (q_t.x_s) exp(G_t - G_s) * do_t per column, transposed as _fwd_o_col: a [BV, 16]
    tile per 16-row sub-chunk b of rows s, one product over all t >= s factored at b's last row l
    (exp(G_l - G_s) <= 1 outside, exp(G_t - G_l) <= 1 for t > l and <= e^DIAG_SPAN inside b when the decay there
    spans at most DIAG_SPAN; else only the rows after b in the product and the diagonal block one offset at a
    time). A chunk whose decay spans at most CHUNK_SPAN takes one [BV, BT] tile, factored at its last row.

    STATE (falcon2a, after the state gradients): plus the state path exp(G_C - G_s) x_s . dh per column (dh: the
    gradient of the chunk's end state), so that du is the written vectors' whole gradient (falcon2's sequential
    kernel adds its own); and, with dh at hand, the decay gradient's end term sum_k S_next * dS_next per column into
    end ([chunks, HV, V]: S_next the next chunk's start state h, or at the sequence's end the final state ht when
    its gradient was given, HAS_FINAL; see _bwd_col_gates)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    last = min(i_t * BT + BT, T) - 1
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # the chunk's rows t: q [BT, BK], G and do transposed [BV, BT]
    r_t = i_t * BT + tl.arange(0, BT)
    m_t = r_t < T
    b_q = tl.load(q + ((bos + r_t) * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
    m_vt = m_v[:, None] & m_t[None, :]
    p_vt = ((bos + r_t) * HV + i_hv)[None, :] * V + o_v[:, None]
    b_Gt = tl.load(G + p_vt, mask=m_vt, other=0)
    b_doT = tl.load(do + p_vt, mask=m_vt, other=0).to(tl.float32)
    # the whole chunk at once when its decay spans at most CHUNK_SPAN, factored at its last row l
    b_Gl = tl.load(G + ((bos + last) * HV + i_hv) * V + o_v, mask=m_v, other=0)
    if STATE:
        # the chunk's end-state gradient and end state (the next chunk's start, or the final state), transposed
        p_hT = ((boh + i_t) * HV + i_hv) * K * V + o_k[None, :] * V + o_v[:, None]
        m_vk = m_v[:, None] & m_k[None, :]
        b_dhT = tl.load(dh + p_hT, mask=m_vk, other=0)
        m_next = (i_t * BT + BT + o_k * 0) < T
        b_hnT = _next_state(h, ht, p_hT, o_k[None, :] * V + o_v[:, None], m_vk, m_next[None, :], i_n, i_hv,
                            HV, K, V, HAS_FINAL)
        tl.store(end + ((boh + i_t) * HV + i_hv) * V + o_v, tl.sum(b_hnT * b_dhT.to(tl.float32), 1), mask=m_v)
        b_dhT = b_dhT.to(dt)
    span_c = tl.max(tl.max(tl.where(m_vt, b_Gt - b_Gl[:, None], 0.), 1), 0)
    if span_c <= CHUNK_SPAN:
        b_x, valid = _load_x(k, last_k, count, i_n, i_h, bos, r_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
        b_A = tl.where(r_t[:, None] >= r_t[None, :], tl.dot(b_q, tl.trans(b_x)), 0.)   # [t, s]
        b_in = tl.where(m_vt, b_doT * tl.exp(tl.where(m_vt, b_Gt - b_Gl[:, None], 0.)), 0.)
        b_du = tl.dot(b_in.to(dt), b_A.to(dt)) * scale
        if STATE:
            b_du += tl.dot(b_dhT, tl.trans(b_x))
        b_du = tl.where(m_vt, b_du * tl.exp(tl.where(m_vt, b_Gl[:, None] - b_Gt, 0.)), 0.)
        tl.store(du + p_vt, b_du, mask=m_vt)
    else:
        for b in range(BT // 16):
            f = i_t * BT + b * 16
            r_s = f + o_c
            m_s = r_s < T
            m_vs = m_v[:, None] & m_s[None, :]
            p_vs = ((bos + r_s) * HV + i_hv)[None, :] * V + o_v[:, None]
            b_x, valid = _load_x(k, last_k, count, i_n, i_h, bos, r_s, m_s, H, K, BK, SHIFT, USE_INITIAL_STATE)
            b_Gs = tl.load(G + p_vs, mask=m_vs, other=0)
            # q_t . x_s for t >= s: [BT, 16]
            b_A = tl.where(r_t[:, None] >= r_s[None, :], tl.dot(b_q, tl.trans(b_x)), 0.)
            # G at b's last real row (none when b is past the sequence's end: every mask below is then empty)
            b_Gb = tl.load(G + ((bos + min(f + 15, last)) * HV + i_hv) * V + o_v, mask=m_v & ((f + o_v * 0) <= last),
                           other=0)
            span = tl.max(tl.max(tl.where(m_vs, b_Gs - b_Gb[:, None], 0.), 1), 0)
            if span <= DIAG_SPAN:
                m_in = m_vt & (r_t >= f)[None, :]
            else:
                m_in = m_vt & (r_t >= f + 16)[None, :]
            b_in = tl.where(m_in, b_doT * tl.exp(tl.where(m_in, b_Gt - b_Gb[:, None], 0.)), 0.)
            b_du = tl.where(m_vs, tl.dot(b_in.to(dt), b_A.to(dt))
                            * tl.exp(tl.where(m_vs, b_Gb[:, None] - b_Gs, 0.)), 0.)
            if span > DIAG_SPAN:
                b_du = _diag16_offsets(b_du, b_A, r_t, do, None, None, G, b_Gs, bos, f, i_hv, T, r_s, m_vs, o_v,
                                       m_v, HV, V, False)
            b_du = b_du * scale
            if STATE:
                # the state path, factored at the chunk's last row: exp(G_C - G_s) <= 1
                b_du += tl.where(m_vs, tl.dot(b_dhT, tl.trans(b_x)) * tl.exp(tl.where(m_vs, b_Gl[:, None] - b_Gs, 0.)),
                                 0.)
            tl.store(du + p_vs, b_du, mask=m_vs)


@triton.autotune(configs=CONFIGS_COLG, key=['H', 'HV', 'K', 'V', 'BT', 'DELTA', 'IS_VARLEN'])
@triton.jit
def _bwd_col_gates(v, val, beta, rg, h, ht, dh, end, o, o_lo, do, dval, dv, dbeta, rowp, NTOK, eps_gamma,
                   cu_seqlens, chunk_indices, chunk_offsets, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVP: tl.constexpr,
                   SHIFT: tl.constexpr, DELTA: tl.constexpr, HAS_FINAL: tl.constexpr, END: tl.constexpr,
                   HAS_LO: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The per-column rules per chunk, first kernel, one program per NVP value blocks of BV columns (one config:
    each program writes its own slot of the row partial sums rowp, so the host reads the split back): the decay
    gradient dG = o * do - u * dval (+ <S_next, dS_next> per column on the last row), its reverse cumsum and the
    gates' chain rule (dbeta and dv written), and this program's share of the per-row sums d(lam') and d(den)
    (rowp[i_vp]: _bwd_col_dqk adds the programs' shares). The row statistics are loaded once per program and the
    value blocks taken in a loop; the row gates (lam', 1 / den) are the forward's (rg, _prep_fwd),
    not recomputed from the keys' energies. The written vectors are u = eta * val, and dval is their whole gradient:

    - falcon2a (DELTA=False): val = v; dval from _bwd_dv_local_col (the outputs' part and the state path);
    - falcon2 (DELTA=True, chunk_col.py): val = r = v - x.S_{t-1} (the residual), dval = drhs from the
      transposed solve (all paths). On top: Gx = G - g in L (-a p with p = v - r the prediction,
      a = eta drhs), which g_t itself does not enter.

    The chunk's last row also carries G_C's path through the next state, S_next = exp(G_C) S0 + sum_s exp(G_C - G_s)
    x_s u_s: sum_k S_next * dS_next per column, from end (END: formed by falcon2a's _bwd_dv_local_col, falcon2's
    _bwd_dhu_delta_col) or here from the next chunk's start state h (the sequence's last chunk: the final state ht
    when its gradient dht was given, HAS_FINAL; else dS_next = 0) and dh. No key and no matrix product in
    this kernel (nor G: only that product's factor exp(G_C - G) read it): the product held every tile of the gate
    chain in the tensor-core accumulator layout, ~13 layout conversions through shared memory per value block (TTGIR,
    thirty-second session)."""
    i_vp, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_s = tl.arange(0, BT)
    o_t = i_t * BT + o_s
    m_t = o_t < T
    last = min(i_t * BT + BT, T) - 1
    o_k = tl.arange(0, BK)
    # where S_next is: the next chunk's start state, or (the sequence's last chunk) the final state
    m_next = (i_t * BT + BT + o_k * 0) < T
    # per-row float factors, not bool masks: Triton cannot move i1 tensors between layouts through shared memory,
    # and these rows meet the tiles' layouts below. 1 / den is 0 on rows without a pair (and where den = 0): their
    # eta and every gradient below are 0
    p_rg = rg + ((bos + o_t) * HV + i_hv) * 2
    b_lp = tl.load(p_rg, mask=m_t, other=0)
    b_rden = tl.load(p_rg + 1, mask=m_t, other=0)
    b_dlp = tl.zeros([BT], dtype=tl.float32)
    b_dden = tl.zeros([BT], dtype=tl.float32)
    for j in range(NVP):
        o_v = (i_vp * NVP + j) * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = (o_k < K)[:, None] & m_v[None, :]
        p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        if END:
            b_end = tl.load(end + ((boh + i_t) * HV + i_hv) * V + o_v, mask=m_v, other=0)
        else:
            b_hn = _next_state(h, ht, p_kv, o_k[:, None] * V + o_v[None, :], m_kv, m_next[:, None], i_n, i_hv,
                               HV, K, V, HAS_FINAL)
            b_end = tl.sum(b_hn * tl.load(dh + p_kv, mask=m_kv, other=0).to(tl.float32), 0)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0).to(tl.float32)
        b_val = tl.load(val + p_tv, mask=m_tv, other=0).to(tl.float32)
        b_beta = tl.load(beta + p_tv, mask=m_tv, other=0).to(tl.float32)
        b_eta = b_beta * b_rden[:, None]
        b_al = b_eta * b_lp[:, None]
        clamped = b_al > 1 - eps_gamma
        b_al = tl.minimum(b_al, 1 - eps_gamma)
        b_u = b_eta * b_val
        b_dval = tl.load(dval + p_tv, mask=m_tv, other=0).to(tl.float32)
        # per-column decay gradient, reverse cumsum in the chunk, the gates' chain rule
        b_o = tl.load(o + p_tv, mask=m_tv, other=0).to(tl.float32)
        if HAS_LO:
            b_o += tl.load(o_lo + p_tv, mask=m_tv, other=0).to(tl.float32)
        b_dG = b_o * b_do - b_u * b_dval
        if DELTA:
            b_dGx = -b_eta * b_dval * (tl.load(v + p_tv, mask=m_tv, other=0).to(tl.float32) - b_val)
        else:
            b_dGx = tl.zeros([BT, BV], dtype=tl.float32)
        b_dG += b_dGx
        b_dG += tl.where((o_t == last)[:, None], b_end[None, :], 0.)
        b_dg = tl.sum(b_dG, 0)[None, :] - tl.cumsum(b_dG, 0) + b_dG - b_dGx
        b_dalpha = tl.where(clamped, 0., -b_dg / (1 - b_al))
        b_deta = b_dval * b_val + b_dalpha * b_lp[:, None]
        b_dbeta = b_deta * b_rden[:, None]
        tl.store(dbeta + p_tv, b_dbeta.to(dbeta.dtype.element_ty), mask=m_tv)
        tl.store(dv + p_tv, (b_dval * b_eta).to(dv.dtype.element_ty), mask=m_tv)
        # this block's share of d(lam') and d(den) per row
        b_dlp += tl.sum(b_dalpha * b_eta, 1)
        b_dden += -tl.sum(b_deta * b_eta, 1) * b_rden
    p_row = rowp + ((i_vp * NTOK + bos + o_t) * HV + i_hv) * 2
    tl.store(p_row, b_dlp, mask=m_t)
    tl.store(p_row + 1, b_dden, mask=m_t)


@triton.jit
def _col_rows(G, beta, b_rd, val, i_v, bos, o_t, m_t, i_hv, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Value block i_v of a chunk's rows o_t: its columns and their mask, the rows' mask [BT, BV], G and the
    written vectors u = eta * val (fp32), eta = beta / den with the rows' 1 / den b_rd."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_sv = m_t[:, None] & m_v[None, :]
    p_sv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
    b_G = tl.load(G + p_sv, mask=m_sv, other=0)
    b_u = (tl.load(beta + p_sv, mask=m_sv, other=0).to(tl.float32) * b_rd[:, None]
           * tl.load(val + p_sv, mask=m_sv, other=0).to(tl.float32))
    return o_v, m_v, m_sv, b_G, b_u


# 8 warps: with 4, ptxas spills 192-320 B at K = V = 128 (scripts/aot_check.py, sm_90a)
@triton.autotune(configs=[triton.Config({}, num_warps=8, num_stages=s) for s in (1, 2)],
                 key=['H', 'HV', 'K', 'V', 'BT', 'BV', 'NV_ROW', 'DELTA', 'HAS_LAM', 'LAM_COUPLED', 'IS_VARLEN'])
@triton.jit
def _bwd_col_dqk(q, k, val, lam, last_k, count, G, beta, rg, h, dh, do, dval, rowp, NTOK, ds_buf, dm_buf,
                 dq, dk, dlast_k, dlam, scale, cu_seqlens, chunk_indices, chunk_offsets, T,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV_ROW: tl.constexpr,
                 BVA: tl.constexpr, SHIFT: tl.constexpr, DELTA: tl.constexpr, HAS_LAM: tl.constexpr,
                 LAM_COUPLED: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The per-column rules per chunk, after _bwd_col_gates: dq, dk (dx shifted back by one row) and dlam.

    - the intra-chunk products ds_ts = sum_v do_t u_s exp(G_t - G_s) (falcon2: and the Gram path
      dM[t, j] = -sum_v a_t u_j exp(Gx_t - G_j)), built transposed, [BT, 16] per 16-row sub-chunk a of rows t
      (64-row products: Hopper's wgmma), one product over all s <= t factored at a's first row as in
      _fwd_o_col (a chunk whose decay spans at most CHUNK_SPAN: one [BT, BT] product per value block, factored at
      its first row), into ds_buf, from which the dq and dx products read them back in both orientations;
    - the chunk-start state's paths: dq += exp(G) do h^T (scaled), dx += exp(G_C - G) u dh^T (falcon2: minus the
      X S0 path of the right-hand side, a exp(Gx) h^T with a = eta drhs);
    - the energy path 2 dden x and dlam, from _bwd_col_gates' per-row shares of d(lam') and d(den) (rowp).
    (One kernel: the state paths were a kernel of their own whose fp32 [B, T, HV, K] results this one read. For
    falcon2a's chunks within CHUNK_SPAN they share the value pass of the intra-chunk products.)"""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    dt = k.dtype.element_ty
    o_s = tl.arange(0, BT)
    o_t = i_t * BT + o_s
    m_t = o_t < T
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    # the rows' 1 / den (eta = beta / den)
    b_rd = _col_rg(rg, bos, o_t, m_t, i_hv, HV)[1]
    # the whole chunk at once when its decay spans at most CHUNK_SPAN in every column, factored at its first row r
    # (falcon2: with Gx at the first row, 0, in the span)
    # (every column in one load, BVA = V rounded up to a power of two: one round trip to memory on the program's
    # serial path, not one per value block; 0.556 against 0.598 ms for falcon2a, H100, forty-second lease)
    last = min(i_t * BT + BT, T) - 1
    o_va = tl.arange(0, BVA)
    b_G0 = tl.load(G + ((bos + i_t * BT) * HV + i_hv) * V + o_va, mask=o_va < V, other=0)
    span_c = tl.max(b_G0 - tl.load(G + ((bos + last) * HV + i_hv) * V + o_va, mask=o_va < V, other=0), 0)
    if DELTA:
        span_c = tl.maximum(span_c, tl.max(-b_G0, 0))
    if span_c <= CHUNK_SPAN:
        b_dsT = tl.zeros([BT, BT], dtype=tl.float32)
        b_dmT = tl.zeros([BT, BT], dtype=tl.float32)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dx = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            # the chunk's rows s [BT, BV]
            o_v, m_v, m_sv, b_G, b_u = _col_rows(G, beta, b_rd, val, i_v, bos, o_t, m_t, i_hv, HV, V, BV)
            b_Gr = tl.load(G + ((bos + i_t * BT) * HV + i_hv) * V + o_v, mask=m_v, other=0)
            b_ur = tl.where(m_sv, b_u * tl.exp(tl.where(m_sv, b_Gr[None, :] - b_G, 0.)), 0.).to(dt)
            # the rows t from the same tiles (tl.trans of loaded tiles, not of a dot result), and the chunk-start
            # state's paths (the pass below) in this one: G, beta, val and do (falcon2: and dval) read once, not
            # two or three times
            p_sv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
            b_do = tl.load(do + p_sv, mask=m_sv, other=0).to(tl.float32)
            b_dor = tl.where(m_sv, b_do * tl.exp(tl.where(m_sv, b_G - b_Gr[None, :], 0.)), 0.)
            b_dsT += tl.dot(b_ur, tl.trans(b_dor.to(dt)))
            m_kv = (o_k < K)[:, None] & m_v[None, :]
            p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
            b_Gl = tl.load(G + ((bos + last) * HV + i_hv) * V + o_v, mask=m_v, other=0)
            b_h = tl.load(h + p_kv, mask=m_kv, other=0).to(dt)
            b_dh = tl.load(dh + p_kv, mask=m_kv, other=0).to(dt)
            b_dq += tl.dot((b_do * tl.exp(b_G)).to(dt), tl.trans(b_h))
            b_dx += tl.dot((b_u * tl.exp(b_Gl[None, :] - b_G)).to(dt), tl.trans(b_dh))
            if DELTA:
                # a = eta drhs at rows t, Gx_t = G_{t-1} (0 on the chunk's first row)
                b_a = (tl.load(beta + p_sv, mask=m_sv, other=0).to(tl.float32) * b_rd[:, None]
                       * tl.load(dval + p_sv, mask=m_sv, other=0))
                b_Gx = tl.load(G + p_sv - HV * V, mask=m_sv & (o_s >= 1)[:, None], other=0)
                b_ar = tl.where(m_sv, b_a * tl.exp(tl.where(m_sv, b_Gx - b_Gr[None, :], 0.)), 0.)
                b_dmT += tl.dot(b_ur, tl.trans(b_ar.to(dt)))
                b_dx -= tl.dot((b_a * tl.exp(b_Gx)).to(dt), tl.trans(b_h))   # the X S0 path
        p_aT = ((bos + o_t) * HV + i_hv)[None, :] * BT + o_s[:, None]
        tl.store(ds_buf + p_aT, tl.where(o_t[:, None] <= o_t[None, :], b_dsT, 0.) * scale, mask=m_t[None, :])
        if DELTA:
            tl.store(dm_buf + p_aT, -tl.where(o_t[:, None] < o_t[None, :], b_dmT, 0.), mask=m_t[None, :])
    else:
        for a in range(BT // 16):
            f = i_t * BT + a * 16
            r_a = f + o_c
            m_a = r_a < T
            b_rda = _col_rg(rg, bos, r_a, m_a, i_hv, HV)[1]
            b_dsT = tl.zeros([BT, 16], dtype=tl.float32)
            b_dmT = tl.zeros([BT, 16], dtype=tl.float32)
            for i_v in range(tl.cdiv(V, BV)):
                # the chunk's rows s [BT, BV]; a's rows t transposed [BV, 16]
                o_v, m_v, m_sv, b_G, b_u = _col_rows(G, beta, b_rd, val, i_v, bos, o_t, m_t, i_hv, HV, V, BV)
                m_vt = m_v[:, None] & m_a[None, :]
                p_vt = ((bos + r_a) * HV + i_hv)[None, :] * V + o_v[:, None]
                b_doT = tl.load(do + p_vt, mask=m_vt, other=0).to(tl.float32)
                b_GtT = tl.load(G + p_vt, mask=m_vt, other=0)
                b_Gf = tl.load(G + ((bos + f) * HV + i_hv) * V + o_v, mask=m_v & ((f + o_v * 0) < T), other=0)
                span = tl.max(tl.max(tl.where(m_vt, b_Gf[:, None] - b_GtT, 0.), 1), 0)
                if DELTA:
                    b_aT = (tl.load(beta + p_vt, mask=m_vt, other=0).to(tl.float32) * b_rda[None, :]
                            * tl.load(dval + p_vt, mask=m_vt, other=0))
                    # Gx_t = G_{t-1} (0 before the chunk's first row: G is the chunk-local cumsum)
                    b_GxT = tl.load(G + p_vt - HV * V, mask=m_vt & (r_a > i_t * BT)[None, :], other=0)
                    span = tl.maximum(span, tl.max(tl.max(tl.where(m_vt, b_GxT - b_Gf[:, None], 0.), 1), 0))
                if span <= DIAG_SPAN:
                    m_in = m_sv & (o_t < f + 16)[:, None]
                    b_Gr = b_Gf
                else:
                    # rows s < f only, factored at the row before f (a = 0 has none)
                    m_in = m_sv & (o_t < f)[:, None]
                    b_Gr = tl.load(G + ((bos + f - 1) * HV + i_hv) * V + o_v, mask=m_v & ((f + o_v * 0) > i_t * BT),
                                   other=0)
                b_ur = tl.where(m_in, b_u * tl.exp(tl.where(m_in, b_Gr[None, :] - b_G, 0.)), 0.).to(dt)
                b_dor = tl.where(m_vt, b_doT * tl.exp(tl.where(m_vt, b_GtT - b_Gr[:, None], 0.)), 0.)
                b_dsT += tl.dot(b_ur, b_dor.to(dt))
                if DELTA:
                    b_ar = tl.where(m_vt, b_aT * tl.exp(tl.where(m_vt, b_GxT - b_Gr[:, None], 0.)), 0.)
                    b_dmT += tl.dot(b_ur, b_ar.to(dt))
                if span > DIAG_SPAN:
                    # a's diagonal block one row s = f + d at a time, elementwise in fp32
                    for d in range(16):
                        r_d = f + d
                        p_d = ((bos + r_d) * HV + i_hv) * V + o_v
                        m_d1 = m_v & ((r_d + o_v * 0) < T)
                        b_Gd = tl.load(G + p_d, mask=m_d1, other=0)
                        b_ud = _col_eta(beta, rg, p_d, m_d1, V) * tl.load(val + p_d, mask=m_d1, other=0).to(
                            tl.float32)
                        m_dt = m_vt & ((r_a >= r_d) & ((r_d + o_c * 0) < T))[None, :]
                        b_sum = tl.sum(tl.where(m_dt, b_doT * b_ud[:, None]
                                                * tl.exp(tl.where(m_dt, b_GtT - b_Gd[:, None], 0.)), 0.), 0)
                        # a float factor: a bool mask must not be converted into the dot accumulator's layout
                        b_row = (o_t == r_d).to(tl.float32)
                        b_dsT += b_row[:, None] * b_sum[None, :]
                        if DELTA:
                            m_dd = m_vt & ((r_a > r_d) & ((r_d + o_c * 0) < T))[None, :]
                            b_sum2 = tl.sum(tl.where(m_dd, b_aT * b_ud[:, None]
                                                     * tl.exp(tl.where(m_dd, b_GxT - b_Gd[:, None], 0.)), 0.), 0)
                            b_dmT += b_row[:, None] * b_sum2[None, :]
            # ds[t, s] for t in a, s <= t (dM: s < t), into the scratch rows of a
            p_aT = ((bos + r_a) * HV + i_hv)[None, :] * BT + o_s[:, None]
            tl.store(ds_buf + p_aT, tl.where(o_t[:, None] <= r_a[None, :], b_dsT, 0.) * scale, mask=m_a[None, :])
            if DELTA:
                tl.store(dm_buf + p_aT, -tl.where(o_t[:, None] < r_a[None, :], b_dmT, 0.), mask=m_a[None, :])
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dx = tl.zeros([BT, BK], dtype=tl.float32)
    # ds^T (and dM^T) read back transposed from the scratch (tl.trans of a dot result fed into tl.dot
    # miscompiles on Hopper)
    tl.debug_barrier()
    b_xl, valid = _load_x(k, last_k, count, i_n, i_h, bos, o_t, m_t, H, K, BK, SHIFT, USE_INITIAL_STATE)
    # the chunk-start state's paths (the fast branch has done them)
    if span_c > CHUNK_SPAN:
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_kv = (o_k < K)[:, None] & m_v[None, :]
            p_kv = ((boh + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
            b_G = tl.load(G + p_tv, mask=m_tv, other=0)
            b_Gl = tl.load(G + ((bos + last) * HV + i_hv) * V + o_v, mask=m_v, other=0)
            b_eta = tl.load(beta + p_tv, mask=m_tv, other=0).to(tl.float32) * b_rd[:, None]
            b_do = tl.load(do + p_tv, mask=m_tv, other=0).to(tl.float32)
            b_h = tl.load(h + p_kv, mask=m_kv, other=0).to(dt)
            b_dq += tl.dot((b_do * tl.exp(b_G)).to(dt), tl.trans(b_h))
            b_u = b_eta * tl.load(val + p_tv, mask=m_tv, other=0).to(tl.float32)
            b_dh = tl.load(dh + p_kv, mask=m_kv, other=0).to(dt)
            b_dx += tl.dot((b_u * tl.exp(b_Gl[None, :] - b_G)).to(dt), tl.trans(b_dh))
            if DELTA:
                b_a = b_eta * tl.load(dval + p_tv, mask=m_tv, other=0)
                b_Gx = tl.load(G + p_tv - HV * V, mask=m_tv & (o_s >= 1)[:, None], other=0)
                b_dx -= tl.dot((b_a * tl.exp(b_Gx)).to(dt), tl.trans(b_h))   # the X S0 path
    p_A = ((bos + o_t) * HV + i_hv)[:, None] * BT + o_s[None, :]
    p_At = ((bos + i_t * BT + o_s) * HV + i_hv)[None, :] * BT + o_s[:, None]
    p_tk = ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :]
    b_ds = tl.load(ds_buf + p_A, mask=m_t[:, None], other=0)
    b_dq = b_dq * scale + tl.dot(b_ds.to(dt), b_xl)
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    b_q = tl.load(q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    b_dst = tl.load(ds_buf + p_At, mask=m_t[None, :], other=0)
    b_dx += tl.dot(b_dst.to(dt), b_q)
    if DELTA:
        b_dm = tl.load(dm_buf + p_A, mask=m_t[:, None], other=0).to(tl.float32)
        b_dmt = tl.load(dm_buf + p_At, mask=m_t[None, :], other=0).to(tl.float32)
        b_dx += tl.dot((b_dm + b_dmt).to(dt), b_xl)   # the Gram path: d(x_t.x_j) into both keys
    # d(lam') and d(den) per row: the value blocks' shares; the energy path E = ||x||^2 into dx
    b_dlp = tl.zeros([BT], dtype=tl.float32)
    b_dden = tl.zeros([BT], dtype=tl.float32)
    for j in tl.static_range(NV_ROW):
        p_row = rowp + ((j * NTOK + bos + o_t) * HV + i_hv) * 2
        b_dlp += tl.load(p_row, mask=m_t, other=0)
        b_dden += tl.load(p_row + 1, mask=m_t, other=0)
    b_xf = b_xl.to(tl.float32)
    b_dx += (2 * b_dden)[:, None] * b_xf
    _store_dk(b_dx, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, T, HV, K, BK, SHIFT, USE_INITIAL_STATE)
    if HAS_LAM:
        b_dlp += b_dden
        if LAM_COUPLED:
            b_dlp = b_dlp * tl.sum(b_xf * b_xf, 1)
        tl.store(dlam + (bos + o_t) * HV + i_hv, b_dlp.to(dlam.dtype.element_ty), mask=m_t)


# ----------------------------------------------------------------------------------------------
# falcon3a backward after falcon1a's kernels on the delayed GLA rows, which also do the band (see the module docstring):
#   _win_bwd_final: the sequence's last W - 1 pairs (no delayed row): their band, and the final state's band from dht;
#   _win_bwd_gates: per step, dc and dg gathered from the rows t = s .. s + W - 1 (yz, from _bwd_dqx), with dG of the
#                   GLA: the gates' chain rule, and the window energy's weight 2 dE / B;
#   _win_bwd_pairs: per pair p, dx and dv from its delayed GLA row p + W - 1 (or _win_bwd_final's) and the window
#                   energy; the first chunk also does the carried tail's pairs.
# ----------------------------------------------------------------------------------------------

# falcon3a's band in the backward, row by row (BAND_FORM 'gather'). The band's part of the output is
# o_t += scale sum_{d < W-1} Mb[t, d] (q_t.x_p) v_p with p = t - d, so its gradients are products of rows at most
# W - 1 apart, with no [BT, BT] tiles: for the rows t, dMb[t, d] = scale (q_t.x_p)(do_t.v_p) and
# dq_t = scale sum_d Mb[t, d] (do_t.v_p) x_p; for the delayed GLA rows s (their pair p = s - W + 1 is in the band of
# the rows r = p + d < s, some before the chunk), dx'_s = scale sum_d Mb[r, d] (do_r.v_p) q_r and
# dv'_s = scale sum_d Mb[r, d] (q_r.x_p) do_r. [BT, 8] tiles hold one slot per d. The pairs with no delayed row (the
# sequence's last W - 1) are _win_bwd_final's.

@triton.jit
def _band_keys(q, k, last_k, count, tail_x, wm, b_q, b_xs, i_n, i_h, i_hv, bos, o_t, m_t, o_k, o_d, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
               WIN: tl.constexpr, SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """The key side ([BT, 8]): a = q_t.x_p and Mb[t, d] of the rows, Mb[r, d] of the pairs' rows and
    c2 = scale Mb[r, d] (q_r.x'_s), the weight of do_r in dv'_s. b_q, b_xs: the rows' q and pairs' x' (fp32)."""
    b_a = tl.zeros([BT, 8], dtype=tl.float32)
    b_c2 = tl.zeros([BT, 8], dtype=tl.float32)
    b_w = tl.zeros([BT, 8], dtype=tl.float32)
    b_w2 = tl.zeros([BT, 8], dtype=tl.float32)
    for d in tl.static_range(WIN - 1):
        b_xp, valid_p = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t - d, m_t, H, K, BK, WIN, SHIFT,
                                    USE_INITIAL_STATE)
        o_r = o_t - (WIN - 1) + d
        m_r = m_t & (o_r >= 0)
        b_qr = tl.load(q + ((bos + o_r) * H + i_h)[:, None] * K + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :],
                       other=0).to(tl.float32)
        b_wr = tl.load(wm + ((bos + o_r) * HV + i_hv) * 8 + d, mask=m_r, other=0)
        b_a = tl.where(o_d[None, :] == d, tl.sum(b_q * b_xp.to(tl.float32), 1)[:, None], b_a)
        b_c2 = tl.where(o_d[None, :] == d, (tl.sum(b_qr * b_xs, 1) * b_wr * scale)[:, None], b_c2)
        b_w = tl.where(o_d[None, :] == d, tl.load(wm + ((bos + o_t) * HV + i_hv) * 8 + d, mask=m_t, other=0)[:, None],
                       b_w)
        b_w2 = tl.where(o_d[None, :] == d, b_wr[:, None], b_w2)
    return b_a, b_w, b_w2, b_c2


@triton.jit
def _band_values(v, tail_v, do, count, b_do, b_vs, b_b, b_b2, b_c2, i_n, i_hv, bos, o_t, m_t, o_v, o_d,
                 HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, WIN: tl.constexpr,
                 SHIFT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """One value block (o_v; b_do: the rows' do, b_vs: the pairs' v', fp32): adds do_t.v_p to b and do_r.v'_s to b2,
    and returns them with the block's dv'_s = sum_d c2[s, d] do_r."""
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for d in tl.static_range(WIN - 1):
        b_vp = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_t - d, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        o_r = o_t - (WIN - 1) + d
        m_r = m_t & (o_r >= 0)
        b_dor = tl.load(do + ((bos + o_r) * HV + i_hv)[:, None] * V + o_v[None, :],
                        mask=m_r[:, None] & (o_v < V)[None, :], other=0).to(tl.float32)
        b_b += tl.where(o_d[None, :] == d, tl.sum(b_do * b_vp, 1)[:, None], 0.)
        b_b2 += tl.where(o_d[None, :] == d, tl.sum(b_dor * b_vs, 1)[:, None], 0.)
        b_dv += tl.sum(tl.where(o_d[None, :] == d, b_c2, 0.), 1)[:, None] * b_dor
    return b_b, b_b2, b_dv


@triton.jit
def _band_dq(k, last_k, count, tail_x, b_cq, i_n, i_h, bos, o_t, m_t, o_d, H: tl.constexpr, K: tl.constexpr,
             BK: tl.constexpr, BT: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
             USE_INITIAL_STATE: tl.constexpr):
    """The rows' dq: sum_d cq[t, d] x_{t-d} ([BT, BK], fp32)."""
    b_acc = tl.zeros([BT, BK], dtype=tl.float32)
    for d in tl.static_range(WIN - 1):
        b_xp, valid_p = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t - d, m_t, H, K, BK, WIN, SHIFT,
                                    USE_INITIAL_STATE)
        b_acc += tl.sum(tl.where(o_d[None, :] == d, b_cq, 0.), 1)[:, None] * b_xp.to(tl.float32)
    return b_acc


@triton.jit
def _band_dx(q, b_cx, i_h, bos, o_t, m_t, o_k, o_d, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
             BT: tl.constexpr, WIN: tl.constexpr):
    """The pairs' dx': sum_d cx[s, d] q_r, r = s - W + 1 + d ([BT, BK], fp32)."""
    b_acc = tl.zeros([BT, BK], dtype=tl.float32)
    for d in tl.static_range(WIN - 1):
        o_r = o_t - (WIN - 1) + d
        m_r = m_t & (o_r >= 0)
        b_qr = tl.load(q + ((bos + o_r) * H + i_h)[:, None] * K + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :],
                       other=0).to(tl.float32)
        b_acc += tl.sum(tl.where(o_d[None, :] == d, b_cx, 0.), 1)[:, None] * b_qr
    return b_acc


# (4 warps spilled 96-800 B per thread at K = V = 128, aot_check sm_90; 8 warps none)
@triton.autotune(configs=CONFIGS_8W, key=['H', 'HV', 'K', 'V', 'BT', 'WIN', 'IS_VARLEN'])
@triton.jit
def _win_bwd_band(q, k, v, last_k, count, tail_x, tail_v, wm, do, dqb, dxb, dvb, dMb, scale,
                  cu_seqlens, chunk_indices, chunk_offsets, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
                  USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """falcon3a's band in the backward in its own kernel (BAND_FORM 'gather', see _band_keys): dq (dqb), dx' (dxb),
    dv' (dvb) and dMb per chunk, fp32, which _bwd_dqx adds to the GLA's."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    o_d = tl.arange(0, 8)
    b_q = tl.load(q + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_xs, valid = _load_gla_x(k, last_k, count, tail_x, i_n, i_h, bos, o_t, m_t, o_k, H, K, WIN, SHIFT,
                              USE_INITIAL_STATE)
    b_a, b_w, b_w2, b_c2 = _band_keys(q, k, last_k, count, tail_x, wm, b_q, b_xs.to(tl.float32), i_n, i_h, i_hv, bos,
                                      o_t, m_t, o_k, o_d, scale, H, HV, K, BK, BT, WIN, SHIFT, USE_INITIAL_STATE)
    b_b = tl.zeros([BT, 8], dtype=tl.float32)
    b_b2 = tl.zeros([BT, 8], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0).to(tl.float32)
        b_vs = _load_gla_v(v, tail_v, count, i_n, i_hv, bos, o_t, m_t, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        b_b, b_b2, b_dv = _band_values(v, tail_v, do, count, b_do, b_vs, b_b, b_b2, b_c2, i_n, i_hv, bos, o_t, m_t,
                                       o_v, o_d, HV, V, BT, BV, WIN, SHIFT, USE_INITIAL_STATE)
        tl.store(dvb + p_tv, b_dv, mask=m_tv)
    tl.store(dMb + ((bos + o_t) * HV + i_hv)[:, None] * 8 + o_d[None, :], b_a * b_b * scale, mask=m_t[:, None])
    p_tk = ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :]
    tl.store(dqb + p_tk, _band_dq(k, last_k, count, tail_x, b_w * b_b * scale, i_n, i_h, bos, o_t, m_t, o_d, H, K, BK,
                                  BT, WIN, SHIFT, USE_INITIAL_STATE), mask=m_tk)
    tl.store(dxb + p_tk, _band_dx(q, b_w2 * b_b2 * scale, i_h, bos, o_t, m_t, o_k, o_d, H, K, BK, BT, WIN), mask=m_tk)


@triton.jit
def _win_bwd_final(q, k, v, last_k, count, tail_x, tail_v, wm, do, dht, fx, fv, fm, scale, cu_seqlens, chunk_offsets, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
                   USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_FINAL: tl.constexpr):
    """The sequence's last W - 1 pairs p = T - W + 1 .. T - 1 have no delayed GLA row: the band and the final state are
    all of their gradient. Rows j = p - (T - 16) of fx (their dx), fv (dv) and fm (the gradient of Mb[T-1, d]): the band
    of the rows t = p .. T - 1, scale Mb[t, t - p] ((do_t.v_p) q_t and (q_t.x_p) do_t), and with dht (HAS_FINAL) the
    final state's band, S_T += sum_d Mb[T-1, d] x_p v_p^T (p = T-1-d): Mb dht v_p, Mb dht^T x_p and x_p^T dht v_p."""
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh, NT = _seq_span(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_j = tl.arange(0, 16)
    o_p = T - 16 + o_j
    m_p = (o_p >= T - (WIN - 1)) & (o_p * 0 + T > 0)   # none in an empty sequence
    m_z = m_p & (o_p >= 0)                              # the same positions as rows t
    o_k = tl.arange(0, BK)
    b_x, valid_p = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, H, K, BK, WIN, SHIFT,
                               USE_INITIAL_STATE)
    b_qz = tl.load(q + ((bos + o_p) * H + i_h)[:, None] * K + o_k[None, :], mask=m_z[:, None] & (o_k < K)[None, :],
                   other=0).to(b_x.dtype)
    # [pair j, row i]: scale Mb[t_i, t_i - p_j] (the pair's delayed row p_j + W - 1)
    b_bz = _band_w(wm, bos, i_hv, HV, o_p, m_z, o_p + WIN - 1, WIN, True) * scale
    b_sz = tl.dot(b_x, tl.trans(b_qz)) * b_bz
    b_x = b_x.to(tl.float32)
    b_w = tl.load(wm + ((bos + T - 1) * HV + i_hv) * 8 + (T - 1 - o_p), mask=m_p, other=0)
    b_fx = tl.zeros([16, BK], dtype=tl.float32)
    b_fm = tl.zeros([16], dtype=tl.float32)
    b_dsz = tl.zeros([16, 16], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = _load_win_v(v, tail_v, count, i_n, i_hv, bos, o_p, m_p, o_v, HV, V, WIN, SHIFT, USE_INITIAL_STATE)
        b_doz = tl.load(do + ((bos + o_p) * HV + i_hv)[:, None] * V + o_v[None, :],
                        mask=m_z[:, None] & (o_v < V)[None, :], other=0)
        b_fvb = tl.dot(b_sz.to(b_doz.dtype), b_doz)
        b_dsz += tl.dot(b_v.to(b_doz.dtype), tl.trans(b_doz))
        if HAS_FINAL:
            b_dht = tl.load(dht + (i_nh * K + o_k[:, None]) * V + o_v[None, :],
                            mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0)
            b_fv = tl.dot(b_x, b_dht, input_precision="ieee")                  # [16, BV]: rows x_p^T dht
            b_fm += tl.sum(b_fv * b_v, 1)
            b_fx += tl.dot(b_v, tl.trans(b_dht), input_precision="ieee")      # [16, BK]: rows (dht v_p)^T
            b_fvb += b_fv * b_w[:, None]
        tl.store(fv + (i_nh * 16 + o_j)[:, None] * V + o_v[None, :], b_fvb, mask=(o_v < V)[None, :])
    b_fx = b_fx * b_w[:, None] + tl.dot((b_dsz * b_bz).to(b_qz.dtype), b_qz)
    tl.store(fx + (i_nh * 16 + o_j)[:, None] * K + o_k[None, :], b_fx, mask=(o_k < K)[None, :])
    tl.store(fm + i_nh * 16 + o_j, b_fm)


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (2, 4)],
                 key=['HV', 'BT', 'WIN', 'IS_VARLEN'])
@triton.jit
def _win_bwd_gates(beta, lam, Ew, rBw, dG, yz, dbeta, dlam, wE, eps, eps_gamma,
                   cu_seqlens, chunk_indices, chunk_offsets, T,
                   HV: tl.constexpr, BT: tl.constexpr, WIN: tl.constexpr, HAS_LAM: tl.constexpr,
                   LAM_COUPLED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per step s: dc_s = sum_d y[s + d, d], the direct dg_s = sum_{i < W-1} Zs[s + i, i + 1] (see _bwd_dqx)
    and dG of the GLA (its in-chunk reverse cumsum), through the gates (c = eta / B); wE = 2 dE / B for the keys."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_dc = tl.zeros([BT], dtype=tl.float32)
    b_dgd = tl.zeros([BT], dtype=tl.float32)
    for d in tl.static_range(WIN):
        m_r = m_t & (o_t + d < T)
        b_dc += tl.load(yz + ((bos + o_t + d) * HV + i_hv) * 16 + d, mask=m_r, other=0)
        if d < WIN - 1:
            b_dgd += tl.load(yz + ((bos + o_t + d) * HV + i_hv) * 16 + 9 + d, mask=m_r, other=0)
    b_rB = tl.load(rBw + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_E = tl.load(Ew + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    valid = m_t & (b_rB > 0)
    b_lp, b_den, b_eta, b_a, clamped, b_g = _gates_e(b_E, beta, lam, bos, o_t, valid, i_hv, HV, eps, eps_gamma,
                                                     HAS_LAM, LAM_COUPLED)
    b_dG = tl.load(dG + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_dbeta, b_dlp, b_dden = _gates_bwd(b_dG, b_dgd, b_dc * b_rB, b_lp, b_den, b_eta, b_a, clamped, valid)
    _store_gates(b_dbeta, b_dlp, b_E, dbeta, dlam, bos, o_t, m_t, i_hv, HV, HAS_LAM, LAM_COUPLED)
    tl.store(wE + (bos + o_t) * HV + i_hv, 2 * b_dden * b_rB, mask=m_t)


@triton.jit
def _win_pair_grads(k, last_k, count, tail_x, dxd, dxt, wE, fx, fv, dv_out, r_dv, i_n, i_h, i_hv, bos, T,
                    o_p, m_p, R: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
                    USE_INITIAL_STATE: tl.constexpr):
    """dx (returned, fp32, with the pairs' validity) of the R pairs o_p: dx' of the delayed GLA row p + W - 1 (the GLA
    and the band, _bwd_dqx), or for the sequence's last W - 1 pairs fx (_win_bwd_final), and the window energy
    x_p sum_{r = p}^{p + W - 1} wE_r. dv: _bwd_dqx stores dv' at the pairs; here only those last W - 1 pairs' fv
    (stored at dv_out + r_dv)."""
    o_k = tl.arange(0, BK)
    b_x, valid_p = _load_win_x(k, last_k, count, tail_x, i_n, i_h, bos, o_p, m_p, H, K, BK, WIN, SHIFT,
                               USE_INITIAL_STATE)
    r_g = o_p + WIN - 1             # the pair's delayed GLA row
    m_g = m_p & (r_g < T)
    j_f = o_p - (T - 16)            # its row in fx / fv when it has none
    m_f = m_p & (r_g >= T)
    if WIN > 1:
        if tl.max(m_f.to(tl.int32), 0) > 0:
            for i_v in range(tl.cdiv(V, BV)):
                o_v = i_v * BV + tl.arange(0, BV)
                m_fv = m_f[:, None] & (o_v < V)[None, :]
                b_dv = tl.load(fv + ((i_n * HV + i_hv) * 16 + j_f)[:, None] * V + o_v[None, :], mask=m_fv, other=0)
                tl.store(dv_out + r_dv[:, None] + o_v[None, :], b_dv.to(dv_out.dtype.element_ty), mask=m_fv)
    m_pk = (o_k < K)[None, :]
    p_dx = dxd + ((bos + r_g) * HV + i_hv)[:, None] * K + o_k[None, :]
    if USE_INITIAL_STATE:   # rows r_g < W (the pairs of last_k and the tail) from dxt, in fp32
        m_h = r_g < WIN
        b_dx = tl.load(dxt + ((i_n * HV + i_hv) * 8 + r_g)[:, None] * K + o_k[None, :],
                       mask=(m_g & m_h)[:, None] & m_pk, other=0)
        b_dx += tl.load(p_dx, mask=(m_g & (r_g >= WIN))[:, None] & m_pk, other=0).to(tl.float32)
    else:
        b_dx = tl.load(p_dx, mask=m_g[:, None] & m_pk, other=0).to(tl.float32)
    if WIN > 1:
        b_dx += tl.load(fx + ((i_n * HV + i_hv) * 16 + j_f)[:, None] * K + o_k[None, :], mask=m_f[:, None] & m_pk,
                        other=0)
    # the window energy: pair p is in the windows of the steps r = p .. p + W - 1
    b_ws = tl.zeros([R], dtype=tl.float32)
    for d in tl.static_range(WIN):
        r = o_p + d
        b_ws += tl.load(wE + (bos + r) * HV + i_hv, mask=m_p & (r >= 0) & (r < T), other=0)
    b_dx += b_ws[:, None] * b_x.to(tl.float32)
    return b_dx, valid_p


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8)],
                 key=['H', 'HV', 'K', 'V', 'BT', 'WIN', 'IS_VARLEN'])
@triton.jit
def _win_bwd_pairs(k, last_k, count, tail_x, dxd, dxt, wE, fx, fv, dk, dv, dlast_k, dtail_x, dtail_v,
                   cu_seqlens, chunk_indices, chunk_offsets, T,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, WIN: tl.constexpr, SHIFT: tl.constexpr,
                   USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dk and dv of the chunk's pairs (see _win_pair_grads); the first chunk of a sequence with a carried tail also
    writes the tail's gradient (its pairs p = -(W-1) .. -1)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T, boh = _seq_info(i_t, i_b, chunk_indices, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_dx, valid = _win_pair_grads(k, last_k, count, tail_x, dxd, dxt, wE, fx, fv, dv,
                                  ((bos + o_t) * HV + i_hv) * V, i_n, i_h, i_hv, bos, T, o_t, m_t, BT, H, HV, K, V, BK,
                                  BV, WIN, SHIFT, USE_INITIAL_STATE)
    _store_dk(b_dx, valid, dk, dlast_k, i_n, i_t, i_hv, bos, o_t, m_t, T, HV, K, BK, SHIFT, USE_INITIAL_STATE)
    if USE_INITIAL_STATE:
        if WIN > 1:
            if i_t == 0:
                o_p = tl.arange(0, 8) - 8
                m_p = o_p >= -(WIN - 1)
                r_tail = (i_n * HV + i_hv) * (WIN - 1) + WIN - 1 + o_p
                b_dxp, valid_p = _win_pair_grads(k, last_k, count, tail_x, dxd, dxt, wE, fx, fv, dtail_v,
                                                 r_tail * V, i_n, i_h, i_hv, bos, T, o_p, m_p, 8, H, HV, K, V, BK, BV,
                                                 WIN, SHIFT, USE_INITIAL_STATE)
                o_k = tl.arange(0, BK)
                tl.store(dtail_x + r_tail[:, None] * K + o_k[None, :], b_dxp, mask=m_p[:, None] & (o_k < K)[None, :])


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

# The sequential state kernels (_fwd_h, _bwd_dhu) want about this many programs; fewer leave SMs idle. 64, not 128:
# splitting K further, to 32, compiles their products to mma.sync instead of wgmma (whose M, the key block, is at
# least 64; scripts/aot_check.py). H100, fifty-fourth lease, CUDA graph, fwd+bwd ms at (1, 16384, 16, 128, 128), key
# block 32 / 64 / 128 (128 / 64 / 32 programs): falcon1a 1.773 / 1.402 / 1.540, falcon2a 2.767 / 2.505 / 2.586,
# falcon3a 2.191 / 1.799 / 1.950 (simple GLA 1.569).
STATE_PROGRAMS = 64


def _state_key_block(BK, NHV, V, delta):
    """Key block of the sequential state kernels: all of K, or for the rules without a delta term (whose state
    rows evolve independently) halves of it, down to 32, while (sequence, head, 64-wide value block) programs are
    fewer than STATE_PROGRAMS. At (B, H) = (1, 16) falcon2a's _fwd_h / _bwd_dhu took 438 / 396 us on an H200
    with 32-64 programs, 158 / 131 us at B = 4 with 4x as many (2026-12-01 profile, same work)."""
    bk = BK
    if not delta:
        while bk > 32 and _state_programs(NHV, V, BK // bk) < STATE_PROGRAMS:
            bk //= 2
    return bk


def _state_programs(NHV, V, key_blocks):
    """Programs of a sequential state pass: NHV sequence-heads x 64-wide value blocks x key blocks."""
    return NHV * triton.cdiv(V, 64) * key_blocks


# Narrow heads (K or V < 64) get 64-wide key and value blocks, masked past the head: the tiles, and so the compiled
# matmuls, of K = V = 64, which the GPU tests cover in fp32 and bf16. With blocks as narrow as the head, bf16 K = V =
# 16 / 32 went wrong on the H200 (Triton 3.6) in several kernels and configs: illegal memory accesses in falcon3a's
# _fwd_o (8 warps, BK = BV = 16), falcon1's _bwd_gates (4 warps, 16) and falcon3's _bwd_gates3 (4 warps, 32), NaN
# gradients of falcon3a at 32 (8 warps) and falcon1's dk 27% off at 32 (nineteenth and twentieth leases,
# scripts/locate_fault.py); fp32 was right at every config. Limiting narrow heads to 4 warps did not help.
MIN_BLOCK = 64


def _key_block(K):
    """The key block of the chunk kernels: all of K, at least MIN_BLOCK wide."""
    return max(triton.next_power_of_2(K), MIN_BLOCK)


def _meta(q, v, chunk_size, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    BT = chunk_size
    if cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, BT)
        NT, N, NTH = len(chunk_indices), len(cu_seqlens) - 1, len(chunk_indices)
    else:
        chunk_indices = chunk_offsets = None
        NT, N = triton.cdiv(T, BT), B
        NTH = B * NT
    BK = _key_block(K)
    BV = MIN_BLOCK   # value blocks: 64 wide at every V (the kernels loop over them)
    return dict(B=B, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, NT=NT, N=N, NTH=NTH,
                chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)


# The recomputing backward's state pass (_fwd_h again) on a second CUDA stream, beside the backward's first kernels
# (_bwd_dv_local and the state gradients' _bwd_dhu), which do not read the chunk-start states: both sequential passes
# are latency-bound with one program per (sequence, head, key block, value block). The backward joins the stream
# before the first kernel that reads the states. falcon3's _bwd_dv_local3 / _bwd_dhu3 do not read them either;
# falcon2's _bwd_dhu_delta_col does where it forms the decay gradient's end terms (chunk_col._end_in_dhu: as many
# programs as multiprocessors), so falcon2 forks only below that, where its two sequential passes fit side by side.
# 'auto' (the default) forks when a state pass has fewer than FORK_PROGRAMS programs, which leaves SMs to
# the other, or for falcon1a / falcon3a, whose passes are short, fewer than STATE_PROGRAMS. H100, CUDA graph, fwd+bwd
# ms on one stream / forked, (1, 16384, 16, 128, 128) unless said:
#   falcon1 / falcon3 (their passes cannot split the key dimension), fifty-third lease: 32 programs 2.850 / 2.426 and
#   10.824 / 9.387; at (4, 4096), 128 programs, 1.809 / 1.812 and 7.231 / 7.316;
#   falcon2, fifty-eighth lease: 9.509 / 7.783 (the gated delta rule 2.959 / 2.965 in the same runs);
#   falcon2a: 2.800 / 3.081 at 128 programs (key block 32, fifty-third lease); fifty-fourth lease 2.505 / 2.284 at
#   64, 2.586 / 2.351 at 32;
#   falcon1a / falcon3a, fifty-fourth lease: 1.402 / 1.649 and 1.799 / 2.026 at 64 programs, 1.540 / 1.397 and
#   1.950 / 1.815 at 32 (key block 128); at 128 (key block 32) the fifty-third lost 10-13% forked.
# True / False: always / never (benchmark_chunk.py --overlap).
OVERLAP_RECOMPUTE = 'auto'
FORK_PROGRAMS = 128
_SIDE_STREAMS = {}


class _Fork:
    """A launch put on the device's second stream after everything queued so far, and joined back by ``join``. The
    tensors the launch reads or writes are held until the join: one allocated here and dropped by the caller (the
    recomputation's U) would otherwise go back to the caching allocator and be handed out on the first stream while the
    second still reads it."""

    def __init__(self, device):
        if device not in _SIDE_STREAMS:
            _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        self.device, self.stream, self.held = device, _SIDE_STREAMS[device], None

    def run(self, launch, tensors):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.held = tensors
        with torch.cuda.stream(self.stream):
            launch()

    def join(self):
        if self.held is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.held = None


def _overlap_recompute(device, delta, per_col, K, V, NHV):
    """Whether the recomputing backward forks its state pass (OVERLAP_RECOMPUTE): on a CUDA device, and under 'auto'
    when the pass's programs (NHV sequence-heads, 64-wide value blocks, _state_key_block's key blocks) are fewer than
    FORK_PROGRAMS (falcon1a / falcon3a: STATE_PROGRAMS). falcon2 only where its state gradients do not read the
    states (chunk_col._end_in_dhu false: fewer programs than multiprocessors), and then under 'auto' always."""
    if device.type != 'cuda':
        return False
    if delta and per_col:
        from fla_falcon.ops.falcon.chunk_col import _end_in_dhu, _state_pass_programs
        # 'auto' forks wherever it may: below the multiprocessor count the pass has few programs anyway
        return not _end_in_dhu(_state_pass_programs(1, NHV, V), device) and bool(OVERLAP_RECOMPUTE)
    if OVERLAP_RECOMPUTE != 'auto':
        return bool(OVERLAP_RECOMPUTE)
    BK = _key_block(K)
    programs = _state_programs(NHV, V, BK // _state_key_block(BK, NHV, V, delta))
    return programs < (FORK_PROGRAMS if delta or per_col else STATE_PROGRAMS)


def _run(fork, launch, tensors):
    """launch() on fork's stream (holding tensors until the join), or here without a fork."""
    if fork is not None:
        fork.run(launch, tensors)
    else:
        launch()


def _join(fork):
    if fork is not None:
        fork.join()


def _chunk_fwd(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma, delta, per_col, win,
               lam_coupled, shift, output_final_state, cu_seqlens, chunk_size, outputs=None, gates=None,
               fork=None):
    """(o, the final state, the tensors the backward reads). The backward's recomputation (chunk_falcon's
    default) passes what the forward kept (_recompute_split): ``outputs``, what only the output kernel makes and the
    backward reads (the kernel is skipped, o is None and these take their place among the saved tensors), and
    ``gates``, the per-row gates and WY solves, which are not formed again; with ``fork`` (a _Fork) the state pass
    runs on its stream, and the states are ready after ``fork.join()``."""
    if delta and win:
        # falcon3: the window's pairs as virtual rows of falcon1's WY form (chunk_win.py)
        from fla_falcon.ops.falcon.chunk_win import chunk_fwd_falcon3
        return chunk_fwd_falcon3(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma,
                                 lam_coupled, shift, output_final_state, cu_seqlens, win, outputs, gates, fork)
    if delta and per_col:
        # falcon2: one triangular system per value column, in the sequential kernel (chunk_col.py)
        from fla_falcon.ops.falcon.chunk_col import chunk_fwd_falcon2
        return chunk_fwd_falcon2(q, k, v, beta, lam, S0, last_k, count, scale, eps, eps_gamma, lam_coupled, shift,
                                 output_final_state, cu_seqlens, chunk_size, outputs, gates, fork)
    m = _meta(q, v, chunk_size, cu_seqlens)
    B, T, H, HV, K, V, BT, BK, BV, NT, N = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BT', 'BK', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    use_init = S0 is not None
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, SHIFT=int(shift), USE_INITIAL_STATE=use_init,
                  IS_VARLEN=cu_seqlens is not None)
    A = W = U = vn = rg = wm = None
    aux = (None,) * 3
    if gates is None:
        G = torch.empty(B, T, HV, *((V,) if per_col else ()), device=dev, dtype=torch.float32)
        # (the per-column rules form eta where they read it, from beta and rg below: _col_eta)
        eta = None if per_col else torch.empty_like(G)
        # falcon3a: the per-step log-decay, window energy and 1 / B (for _win_weights and the backward)
        if win:
            aux = tuple(torch.empty(B, T, HV, device=dev, dtype=torch.float32) for _ in range(3))
        # the per-column rules: the row gates (lam', 1 / den) for the backward
        rg = torch.empty(B, T, HV, 2, device=dev, dtype=torch.float32) if per_col else None
        _prep_fwd[(NT, B * HV)](
            k, v, beta, lam, last_k, count, tail_x, None, G, eta, *aux, rg, cu_seqlens, ci, co, eps, eps_gamma, T,
            PER_COL=per_col, WIN=win, HAS_LAM=lam is not None, LAM_COUPLED=lam_coupled, E_GIVEN=False,
            WIN_AUX=bool(win), **common)
        eta_gla = eta
        if win:
            # the band's weights Mb and the delayed GLA rows' mt, which the GLA kernels read as their eta
            wm = torch.empty(B, T, HV, 8, device=dev, dtype=torch.float32)
            eta_gla = torch.empty(B, T, HV, device=dev, dtype=torch.float32)
            _win_weights[(NT, B * HV)](eta, aux[0], wm, eta_gla, cu_seqlens, ci, co, T, HV=HV, BT=BT, WIN=win,
                                       IS_VARLEN=cu_seqlens is not None)
        if delta:
            A = torch.empty(B, T, HV, BT, device=dev, dtype=torch.float32)
            common_s = {key: val for key, val in common.items() if key not in ('V', 'BV')}
            _wy_solve[(NT, B * HV)](k, last_k, count, G, eta, A, cu_seqlens, ci, co, T, **common_s)
    elif per_col:
        (G, rg), eta, eta_gla = gates, None, None
    elif win:
        G, eta, *aux, wm, eta_gla = gates
    else:
        (G, eta, A), eta_gla = gates, gates[1]
    if delta:
        W = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype)
        U = torch.empty_like(v)
        vn = torch.empty_like(v)
        _wy_wu[(NT, B * HV)](k, v, last_k, count, G, eta, A, W, U, cu_seqlens, ci, co, T, **common)
    h = torch.empty(m['NTH'] if cu_seqlens is not None else B * NT, HV, K, V, device=dev, dtype=q.dtype)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    common_h = {key: val for key, val in common.items() if key != 'BV'}
    common_h['BK'] = BKh = _state_key_block(BK, N * HV, V, delta)
    args = (k, v, last_k, count, tail_x, tail_v, G, eta_gla, W, U, h, S0, ht, vn, wm, beta, rg, cu_seqlens, co)

    _run(fork, lambda: _fwd_h[lambda meta: (triton.cdiv(V, meta['BV']), triton.cdiv(K, BKh), N * HV)](
        *args, T, DELTA=delta, PER_COL=per_col, WIN=win, STORE_FINAL_STATE=output_final_state, **common_h), args)
    if outputs is not None:
        if per_col:
            return None, ht, (G, *outputs, rg, ht, h)
        return None, ht, ((G, eta, *aux, wm, eta_gla, h) if win else (G, eta, A, W, vn, h))
    if per_col:
        o, o_lo = _col_outputs(v)
        _fwd_o_col[(triton.cdiv(V, BV), NT, B * HV)](
            q, k, v, last_k, count, G, beta, rg, h, o, o_lo, scale, cu_seqlens, ci, co, T, SAVE_LO=o_lo is not None,
            **common)
        # ht: the last chunk's next state, for the decay gradient's end term (_bwd_col_gates)
        return o, ht, (G, o, o_lo, rg, ht, h)
    o = torch.empty_like(v)
    _fwd_o[(triton.cdiv(V, BV), NT, B * HV)](
        q, k, v, last_k, count, tail_x, tail_v, G, eta_gla, vn, h, wm, o, scale, cu_seqlens, ci, co, T,
        DELTA=delta, WIN=win, **common)
    if win:
        return o, ht, (G, eta, *aux, wm, eta_gla, h)
    return o, ht, (G, eta, A, W, vn, h)


def _col_outputs(v):
    """The per-column rules' output o in v's dtype and, for 16-bit inputs, its rounding residual o_lo (the fp32 output
    less o, in v's dtype; None for fp32 inputs), both written by _fwd_o_col: the decay gradient (dG = o * do - u * du)
    reads o + o_lo back, the fp32 output to ~2^-17. o alone took falcon2's bf16 dbeta / dlam from 1.46% / 1.35% to
    2.33% / 2.34% off the fp64 reference (T = 200, K = V = 32, lam_coupled, CPU interpreter; the tests' bf16 tolerance
    is 2%); an fp32 copy beside o (before) moved two bf16 tensors' worth per element where o_lo moves one, and the
    backward reads o itself (saved, the op's output) in place of the copy."""
    o = torch.empty_like(v)
    return o, (None if v.dtype == torch.float32 else torch.empty_like(v))


def _recompute_split(saved, delta, per_col, win):
    """What the forward keeps for a recomputing backward (chunk_falcon's default), as (gates, outputs):

    - gates: the per-row gates and the WY solves (G, eta, the triangular inverses A, falcon2's key Grams, falcon3's
      window energies, falcon3a's band weights), which the recomputation does not form again: per-row scalars and
      [T, chunk]-sized solves, the kind of tensors fla's chunk ops keep too (the gated delta rule its A, GLA its
      cumulative gate); not the value-sized WY tensors (W, U, v_new, falcon2's residual) or the chunk-start states,
      which the backward recomputes;
    - outputs: what only the output kernel makes, the per-column rules' (o, o_lo) for their decay gradient (o_lo:
      o's rounding residual, None for fp32 inputs; o is the op's output, keeping it costs nothing).

    The layouts are those _chunk_fwd's three forwards return."""
    if delta and win:        # falcon3: (E, Ue, G, c, A, Wt, vn, h)
        return tuple(saved[:5]), ()
    if delta and per_col:    # falcon2: (M, G, r, h, o, o_lo, rg, ht)
        return (saved[0], saved[1], saved[6]), tuple(saved[4:6])
    if per_col:              # falcon2a: (G, o, o_lo, rg, ht, h)
        return (saved[0], saved[3]), tuple(saved[1:3])
    if win:                  # falcon3a: (G, eta, *aux, wm, eta_gla, h)
        return tuple(saved[:-1]), ()
    # falcon1: (G, eta, A, W, vn, h); falcon1a: the same with A, W, vn None
    return tuple(saved[:3]), ()


def _gate_grads(beta, lam):
    """Empty dbeta and dlam in their inputs' dtypes. The kernels form them in fp32 and round on store: the same bits as
    fp32 buffers cast after the backward, without the copies (the per-column rules' dbeta [B, T, HV, V]: 47 us at
    (4, 4096, 16, 128, 128) bf16; the scalar rules' dbeta and dlam: two launches, 4.0-4.4 us, sixtieth lease)."""
    dbeta = torch.empty(beta.shape, device=beta.device, dtype=beta.dtype)
    return dbeta, None if lam is None else torch.empty(lam.shape, device=lam.device, dtype=lam.dtype)


def _check_dht(dht, ht):
    if dht is not None and ht is None:
        raise ValueError("dht: a final-state gradient needs the forward's final state (output_final_state=True)")


def _chunk_bwd(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, saved, do, dht, scale, eps, eps_gamma, delta,
               per_col, win, lam_coupled, shift, cu_seqlens, chunk_size, fork=None):
    """fork: the _Fork whose stream still computes the states h (a recomputing backward), joined by _state_grads
    before the first kernel that reads them."""
    if delta and win:
        from fla_falcon.ops.falcon.chunk_win import chunk_bwd_falcon3
        return chunk_bwd_falcon3(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, saved, do, dht, scale, eps,
                                 eps_gamma, lam_coupled, shift, cu_seqlens, win, fork)
    if delta and per_col:
        from fla_falcon.ops.falcon.chunk_col import chunk_bwd_falcon2
        return chunk_bwd_falcon2(q, k, v, beta, lam, S0, last_k, count, saved, do, dht, scale, eps, eps_gamma,
                                 lam_coupled, shift, cu_seqlens, chunk_size, fork) + (None, None)
    m = _meta(q, v, chunk_size, cu_seqlens)
    B, T, H, HV, K, V, BT, BK, BV, NT, N = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BT', 'BK', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    dev = q.device
    use_init = S0 is not None
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, SHIFT=int(shift), USE_INITIAL_STATE=use_init,
                  IS_VARLEN=cu_seqlens is not None)
    f32 = dict(device=dev, dtype=torch.float32)
    do = do.contiguous()
    if win:
        return _chunk_bwd_win(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, saved, do, dht, scale, eps,
                              eps_gamma, lam_coupled, win, cu_seqlens, m, common, fork)
    if per_col:
        G, o, o_lo, rg, ht, h = saved
        W = None
        _check_dht(dht, ht)   # before _state_grads, which reads ht with dht
    else:
        G, eta, A, W, vn, h = saved
    # falcon2a: the decay gradient's end terms per chunk and column (from _bwd_dv_local_col; ht: the final state)
    end = torch.empty(h.shape[0], HV, V, **f32) if per_col else None
    du, dh, dh0 = _state_grads(q, k, last_k, count, None, G, W, h, do, dht, scale, cu_seqlens, m, common, delta,
                               per_col, 0, ht=ht if per_col else None, end=end, fork=fork)
    # key-side gradients are per value head; with grouped heads they are summed afterwards in fp32
    kdt = q.dtype if HV == H else torch.float32
    dq = torch.empty(B, T, HV, K, device=dev, dtype=kdt)
    # every row of dk is written by the kernels (_store_dk: the zero gradient of a sequence's last key too)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=kdt)
    dv = torch.empty_like(v)
    dlast_k = torch.zeros(N, HV, K, **f32) if use_init else None
    dbeta, dlam = _gate_grads(beta, lam)
    gates = dict(HAS_LAM=lam is not None, LAM_COUPLED=lam_coupled)
    if per_col:
        _bwd_col_grads(q, k, v, v, beta, lam, rg, last_k, count, G, h, ht, dh, dht, o, o_lo, do, du, dv, dq, dk,
                       dbeta, dlam, dlast_k, scale, eps_gamma, cu_seqlens, ci, co, m, False, gates, common, end=end)
        return _reduce_groups(dq, dk, dv, dbeta, dlam, dh0, dlast_k, H, HV) + (None,)
    # falcon1's dx and dW pass from _bwd_dqx to _bwd_gates in the inputs' dtype (fla's dw is bf16 too): half the traffic
    dx = torch.empty(B, T, HV, K, device=dev, dtype=q.dtype) if delta else None
    dG = torch.empty(B, T, HV, **f32) if delta else None
    dw = torch.empty(B, T, HV, K, device=dev, dtype=q.dtype) if delta else None
    # falcon1a: the transposed intra-chunk product through a scratch buffer, and 32-wide value blocks (its value
    # loop also forms the state path of dU): no register spills at K = V = 128 (255 regs and ~260 B of stack per
    # thread before; aot_check, sm_90). falcon1 keeps 64-wide blocks up to K = 128; at K = 256 (BK = 256) they need
    # 240 KB of shared memory with every config, over Hopper's 227 KB (OutOfResources at launch, twenty-fifth lease's
    # test_gpu_large_heads[falcon1-bf16-256]; aot_check sm_90), so 32 there
    # (in the inputs' dtype: it is only read back as a matmul operand in that dtype)
    ds_buf = None if delta else torch.empty(B, T, HV, BT, device=dev, dtype=q.dtype)
    _bwd_dqx[(NT, B * HV)](
        q, k, v, beta, lam, last_k, count, None, None, G, eta, vn, h, dh, do, du, dq, dx, dG, dw, dv, None, None, None,
        dk, dlast_k, dbeta, dlam, ds_buf, None, None, None, None, None, None, None, None, scale, eps, eps_gamma,
        cu_seqlens, ci, co, T,
        DELTA=delta, WIN=0, **gates, SPLIT_1A=not delta,
        **dict(common, BV=common['BV'] if delta and common['BK'] <= 128 else min(common['BV'], 32)))
    if delta:
        _bwd_gates[(NT, B * HV)](
            k, v, beta, lam, last_k, count, G, A, torch.empty(A.shape, device=dev, dtype=k.dtype), dx, dG, dw, du,
            dv, dk, dlast_k, dbeta, dlam, eps, eps_gamma, cu_seqlens, ci, co, T, **gates,
            **dict(common, BK=min(common['BK'], 64)))
    return _reduce_groups(dq, dk, dv, dbeta, dlam, dh0, dlast_k, H, HV) + (None,)


def _state_grads(q, k, last_k, count, tail_x, G, W, h, do, dht, scale, cu_seqlens, m, common, delta, per_col, win,
                 wm=None, dvb=None, band=0, ht=None, end=None, fork=None):
    """The backward's first two steps, shared by the rules of this file: dU from the outputs of the same chunk, then
    the state gradients over the chunks (falcon1: with the state path of dU). Returns (du, dh, dh0). falcon2a
    (per_col): the other way round, and with the final state ht the decay gradient's end terms into end. Neither
    _bwd_dv_local nor _bwd_dhu reads h: a recomputed state pass on fork's stream runs beside them, joined before
    _bwd_dv_local_col, the first kernel that does."""
    B, T, HV, K, V, BK, BV, NT, N = (m[x] for x in ('B', 'T', 'HV', 'K', 'V', 'BK', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    f32 = dict(device=q.device, dtype=torch.float32)
    # dU in the inputs' dtype, as fla's chunk_bwd_dv_local: it is read by two or three kernels, so with bf16 inputs an
    # fp32 buffer doubled its memory traffic (it is formed and summed in fp32 inside each kernel)
    du = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    dh = torch.empty_like(h)
    dh0 = torch.empty(N, HV, K, V, **f32) if common['USE_INITIAL_STATE'] else None
    common_h = {key: val for key, val in common.items() if key != 'BV'}
    common_h['BK'] = BKh = _state_key_block(BK, N * HV, V, delta)

    def state_gradients():
        _bwd_dhu[lambda meta: (triton.cdiv(V, meta['BV']), triton.cdiv(K, BKh), N * HV)](
            q, k, last_k, count, G, W, do, du, dh, dht, dh0, scale, cu_seqlens, co, T,
            DELTA=delta, PER_COL=per_col, USE_FINAL_STATE_GRADIENT=dht is not None, **common_h)

    if per_col:
        # falcon2a: the state gradients first (they do not need du), so that _bwd_dv_local_col adds du's state path
        # and the gates' kernel has no product to form (see _bwd_col_gates)
        state_gradients()
        _join(fork)
        _bwd_dv_local_col[(triton.cdiv(V, BV), NT, B * HV)](
            q, k, last_k, count, G, h, ht, dh, end, do, du, scale, cu_seqlens, ci, co, T, STATE=True,
            HAS_FINAL=dht is not None, **common)
    else:
        # falcon3a's band ('fold'): up to 128-wide value blocks, so that the scores and the band's weights are formed
        # once per chunk, not once per 64 values (eighteenth lease, K = V = 128: 0.143 ms against 0.160 at BV = 64,
        # 4 warps; no spills at K = V = 128, bf16 or fp32, aot_check sm_90). The grid from the launch's BV, so that
        # benchmarks/sweep_configs.py can try other value blocks
        bv = min(max(triton.next_power_of_2(V), MIN_BLOCK), 128) if win > 1 and band == 0 and BK <= 128 else BV
        _bwd_dv_local[lambda meta: (triton.cdiv(V, meta['BV']), NT, B * HV)](
            q, k, last_k, count, tail_x, G, wm, do, du, dvb, scale, cu_seqlens, ci, co, T, WIN=win,
            BAND=band, **dict(common, BV=bv))
        state_gradients()
        _join(fork)
    return du, dh, dh0


# falcon3a's band in the backward: 'fold' adds it to the GLA's [BT, BT] score products in _bwd_dv_local and _bwd_dqx
# (twelfth lease: those two took 921 + 226 us at (4, 4096, 16, 128, 128), against 591 + 99 before the band joined
# them); 'gather' computes it row by row (_band_keys) in its own kernel, _win_bwd_band, whose fp32 results _bwd_dqx
# reads (not yet timed or run on a GPU). The same row-by-row products inside _bwd_dqx spilled 496-664 B per thread
# there (aot_check sm_90, K = V = 128), against 32-104 B for 'fold' and none for 'gather'.
BAND_FORMS = {'fold': 0, 'gather': 1}
BAND_FORM = 'fold'


def _chunk_bwd_win(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, saved, do, dht, scale, eps, eps_gamma,
                   lam_coupled, win, cu, m, common, fork=None):
    """falcon3a's backward: falcon1a's kernels on the delayed GLA rows with the band added (_bwd_dv_local: its value
    gradient; _bwd_dqx: dq, dx', dv', dG and the window weights' gradients), the last pairs' band and the final
    state's (_win_bwd_final), then the gates (_win_bwd_gates) and the pairs (_win_bwd_pairs)."""
    G, c, gl, Ew, rBw, wm, mt, h = saved
    B, T, H, HV, K, V, BT, BK, BV, NT, N = (m[x] for x in ('B', 'T', 'H', 'HV', 'K', 'V', 'BT', 'BK', 'BV', 'NT', 'N'))
    ci, co = m['chunk_indices'], m['chunk_offsets']
    f32 = dict(device=q.device, dtype=torch.float32)
    use_init = S0 is not None
    # dv' (rows of the delayed form): _bwd_dv_local (or _win_bwd_band) writes the band's part into dvb, _bwd_dqx adds
    # the GLA's and stores the sum (fp32) as dv of the pair, W - 1 rows back, in v's dtype (through a dv' buffer it was
    # 2 x 67 MB more traffic at (4, 4096, 16, 128, 128) bf16); the sequence's first W - 1 rows are the carried tail's
    # pairs, whose gradient is state (dtail_v, fp32), and its last W - 1 pairs have no delayed row (_win_bwd_final's
    # fv, which _win_bwd_pairs stores). dvb of 'fold' in the inputs' dtype too, as fla's chunk_bwd_dv_local stores its
    # dv. dx' likewise in the inputs' dtype (summed in fp32; dk's bf16 error against the fp64 reference went from 5.1e-3
    # to 6.5e-3 at K = V = 64, T = 200, below o's 7.1e-3 and dq's 7.2e-3), but for the first W rows of each sequence,
    # whose pairs give the carried state's gradients (last_k, tail_x): fp32 (dxt)
    dv = torch.empty_like(v)
    dtail_v = torch.zeros(N, HV, win - 1, V, **f32) if use_init and win > 1 else None
    dxt = torch.empty(N, HV, 8, K, **f32) if use_init else None
    if BAND_FORM not in BAND_FORMS:
        raise ValueError(f"BAND_FORM must be one of {sorted(BAND_FORMS)}, got {BAND_FORM!r}")
    band = BAND_FORMS[BAND_FORM] if win > 1 else 0
    dvb = None if win == 1 else torch.empty(B, T, HV, V, device=q.device, dtype=torch.float32 if band else q.dtype)
    dqb = dxb = dMb = None
    if band == 1:
        dqb, dxb = torch.empty(B, T, HV, K, **f32), torch.empty(B, T, HV, K, **f32)
        dMb = torch.empty(B, T, HV, 8, **f32)
        _win_bwd_band[(NT, B * HV)](q, k, v, last_k, count, tail_x, tail_v, wm, do, dqb, dxb, dvb, dMb, scale, cu, ci,
                                    co, T, WIN=win, **dict(common, BV=min(BV, 32)))
    du, dh, dh0 = _state_grads(q, k, last_k, count, tail_x, G, None, h, do, dht, scale, cu, m, common, False, False,
                               win, wm, dvb, band=band, fork=fork)
    gates = dict(HAS_LAM=lam is not None, LAM_COUPLED=lam_coupled)
    has_final = dht is not None and win > 1
    fx = fv = fm = None
    if win > 1:
        fx, fv, fm = torch.empty(N, HV, 16, K, **f32), torch.empty(N, HV, 16, V, **f32), torch.empty(N, HV, 16, **f32)
        _win_bwd_final[(N * HV,)](q, k, v, last_k, count, tail_x, tail_v, wm, do, dht, fx, fv, fm, scale, cu, co, T,
                                  WIN=win, HAS_FINAL=has_final, **common, num_warps=8)
    kdt = q.dtype if HV == H else torch.float32
    dq = torch.empty(B, T, HV, K, device=q.device, dtype=kdt)
    dxd = torch.empty(B, T, HV, K, device=q.device, dtype=q.dtype)
    dG = torch.empty(B, T, HV, **f32)
    yz = torch.empty(B, T, HV, 16, **f32)
    ds_buf = torch.empty(B, T, HV, BT, device=q.device, dtype=q.dtype)   # read back only as a matmul operand
    # the full value block (BV = 64) at K = 128: a config sweep on the H200 timed it 0.829 ms against 0.912 for BV = 32
    # at K = V = 128 bf16 (no spills; fp32: 408 B of stack against 704 at BV = 32). At K = 256 it needs 234 KB of
    # shared memory (the H200 has 227 KB); at K = V = 64 it spilled 192 B where BV = 32 spills none (aot_check, sm_90)
    _bwd_dqx[(NT, B * HV)](
        q, k, v, beta, lam, last_k, count, tail_x, tail_v, G, mt, None, h, dh, do, du, dq, dxd, dG, None, dv, dvb,
        dtail_v, dxt, None, None, None, None, ds_buf, c, gl, wm, fm, yz, dqb, dxb, dMb, scale, eps, eps_gamma, cu, ci,
        co, T,
        DELTA=False, WIN=win, HAS_FINAL=has_final, BAND=band, **gates,
        **dict(common, BV=BV if BK == 128 else min(BV, 32)))
    dbeta, dlam = _gate_grads(beta, lam)
    wE = torch.empty(B, T, HV, **f32)
    _win_bwd_gates[(NT, B * HV)](beta, lam, Ew, rBw, dG, yz, dbeta, dlam, wE, eps, eps_gamma, cu, ci, co, T, HV=HV,
                                 BT=BT, WIN=win, IS_VARLEN=common['IS_VARLEN'], **gates)
    dk = torch.empty(B, T, HV, K, device=q.device, dtype=kdt)
    dlast_k = torch.zeros(N, HV, K, **f32) if use_init else None
    dtail_x = torch.zeros(N, HV, win - 1, K, **f32) if use_init and win > 1 else None
    _win_bwd_pairs[(NT, B * HV)](k, last_k, count, tail_x, dxd, dxt, wE, fx, fv, dk, dv, dlast_k, dtail_x,
                                 dtail_v, cu, ci, co, T, WIN=win, **common)
    return _reduce_groups(dq, dk, dv, dbeta, dlam, dh0, dlast_k, H, HV, dtail_x) + (dtail_v,)


def _bwd_col_grads(q, k, v, val, beta, lam, rg, last_k, count, G, h, ht, dh, dht, o, o_lo, do, dval, dv, dq, dk,
                   dbeta, dlam, dlast_k, scale, eps_gamma, cu_seqlens, ci, co, m, delta, gates, common, end=None):
    """The per-column rules' backward after the state gradients: _bwd_col_gates (dv, dbeta and the per-row
    shares of the gates' sums), then _bwd_col_dqk (dq, dk, dlam). ht: the final state; end: the
    decay gradient's end terms where already formed (falcon2a's _bwd_dv_local_col; falcon2's _bwd_dhu_delta_col where
    chunk_col._end_in_dhu says so), else None: _bwd_col_gates forms them from h and dh."""
    B, T, HV, V, BT, NT = (m[x] for x in ('B', 'T', 'HV', 'V', 'BT', 'NT'))
    f32 = dict(device=k.device, dtype=torch.float32)
    common_h = {key: val_ for key, val_ in common.items() if key != 'BV'}
    # per-row partial sums, one slot per program of a chunk and head: as many as the narrowest value block (16) needs
    rowp = torch.empty(triton.cdiv(V, 16), B * T, HV, 2, **f32)
    # scratch of ds (falcon2: and dM) per chunk row, read back transposed, only as matmul operands in the inputs'
    # dtype, so stored in it. (dM + dM^T is one too: dM is strictly lower triangular, so no element of the sum adds two
    # nonzeros and rounding each before the sum is rounding the sum: the same bits as an fp32 dM, at half the bytes.)
    ds_buf = torch.empty(B, T, HV, BT, device=k.device, dtype=k.dtype)
    dm_buf = torch.empty(B, T, HV, BT, device=k.device, dtype=k.dtype) if delta else None
    _bwd_col_gates[lambda meta: (triton.cdiv(triton.cdiv(V, meta['BV']), meta['NVP']), NT, B * HV)](
        v, val, beta, rg, h, ht, dh, end, o, o_lo, do, dval, dv, dbeta, rowp, B * T, eps_gamma,
        cu_seqlens, ci, co, T, DELTA=delta, HAS_FINAL=dht is not None, END=end is not None, HAS_LO=o_lo is not None,
        **common_h)
    # the slots that launch wrote (_bwd_col_dqk sums them)
    cfg = _bwd_col_gates.best_config.kwargs
    NV = triton.cdiv(triton.cdiv(V, cfg['BV']), cfg['NVP'])
    assert cfg['BV'] >= 16 and NV <= rowp.shape[0], cfg
    # fp32 inputs: 32-wide value blocks (64 spill 48-88 B per thread at K = 128 for sm_90a); falcon2 (DELTA) too, since
    # its state paths share the intra-chunk value pass: 0.853 against 0.899 ms at BV = 64 (H100, forty-seventh lease;
    # falcon2a's kernel at BV = 32 was slower, forty-first lease)
    common_d = dict(common, BV=min(common['BV'], 64 if k.element_size() <= 2 and not delta else 32))
    _bwd_col_dqk[(NT, B * HV)](
        q, k, val, lam, last_k, count, G, beta, rg, h, dh, do, dval, rowp, B * T, ds_buf, dm_buf, dq, dk, dlast_k, dlam,
        scale, cu_seqlens, ci, co, T, NV_ROW=NV, BVA=triton.next_power_of_2(V), DELTA=delta, **gates, **common_d)


def _reduce_groups(dq, dk, dv, dbeta, dlam, dh0, dlast_k, H, HV, dtail_x=None):
    """Grouped value heads: the key-side gradients were computed per value head; sum each group.
    Returns (dq, dk, dv, dbeta, dlam, dh0, dlast_k, dtail_x)."""
    G_ = HV // H
    if G_ > 1:
        dq = dq.unflatten(2, (H, G_)).sum(3)
        dk = dk.unflatten(2, (H, G_)).sum(3)
        if dlast_k is not None:
            dlast_k = dlast_k.unflatten(1, (H, G_)).sum(2)
        if dtail_x is not None:
            dtail_x = dtail_x.unflatten(1, (H, G_)).sum(2)
    return dq, dk, dv, dbeta, dlam, dh0, dlast_k, dtail_x


class ChunkFalconFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma, delta, per_col,
                win, lam_coupled, shift, output_final_state, cu_seqlens, chunk_size, disable_recompute):
        o, ht, saved = _chunk_fwd(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma,
                                  delta, per_col, win, lam_coupled, shift, output_final_state, cu_seqlens, chunk_size)
        ctx.recompute = None
        if not disable_recompute:
            # as fla's chunk ops: the backward recomputes the value-sized WY tensors and the chunk-start states from
            # the inputs and the kept gates (the forward's state pass again, no output kernel) instead of holding
            # them from here to the backward
            gates, outputs = _recompute_split(saved, delta, per_col, win)
            saved = gates + outputs
            ctx.recompute = (output_final_state, len(gates))
        ctx.save_for_backward(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, cu_seqlens, *saved)
        ctx.cfg = (scale, eps, eps_gamma, delta, per_col, win, lam_coupled, shift, chunk_size)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, cu_seqlens, *saved = ctx.saved_tensors
        scale, eps, eps_gamma, delta, per_col, win, lam_coupled, shift, chunk_size = ctx.cfg
        fork = None
        if ctx.recompute is not None:
            final, n_gates = ctx.recompute
            # the state pass beside the backward's first kernels (OVERLAP_RECOMPUTE; falcon2's only where its state
            # gradients do not read the states)
            N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
            if _overlap_recompute(q.device, delta, per_col, q.shape[-1], v.shape[-1], N * v.shape[2]):
                fork = _Fork(q.device)
            saved = _chunk_fwd(q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, scale, eps, eps_gamma, delta,
                               per_col, win, lam_coupled, shift, final, cu_seqlens, chunk_size,
                               outputs=tuple(saved[n_gates:]), gates=tuple(saved[:n_gates]), fork=fork)[2]
        # autograd's cotangent may be an expanded view (e.g. the gradient of `S.sum()`): the kernel reads it dense
        dht = dht.contiguous() if dht is not None else None
        dq, dk, dv, dbeta, dlam, dh0, dlast_k, dtail_x, dtail_v = _chunk_bwd(
            q, k, v, beta, lam, S0, last_k, tail_x, tail_v, count, saved, do, dht, scale, eps, eps_gamma, delta,
            per_col, win, lam_coupled, shift, cu_seqlens, chunk_size, fork)
        _join(fork)   # (joined already: every path reads the states)
        cast = lambda g, ref: None if g is None or ref is None else g.to(ref.dtype)  # noqa: E731
        return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dbeta, beta), cast(dlam, lam), cast(dh0, S0),
                cast(dlast_k, last_k), cast(dtail_x, tail_x), cast(dtail_v, tail_v),
                None, None, None, None, None, None, None, None, None, None, None, None, None)


def chunk_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor | None = None,
    *,
    rule: str,
    window: int = 1,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
    eps_gamma: float = DEFAULT_EPS_GAMMA,
    lam_coupled: bool = False,
    shift: bool = True,
    initial_state: FalconState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 64,
    disable_recompute: bool = False,
) -> tuple[torch.Tensor, FalconState | None]:
    r"""Chunk-parallel Falcon (Triton), same arguments, semantics and state as
    :func:`~fla_falcon.ops.falcon.naive.naive_recurrent_falcon`.

    Supports ``falcon1``, ``falcon1a``, ``falcon2`` (its solve and state kernels in ``chunk_col.py``),
    ``falcon2a``, ``falcon3`` (kernels in ``chunk_win.py``; head dims in training K <= 128, K <= 64 with fp32
    inputs; without gradients K <= 256, K <= 128 with fp32) and ``falcon3a``, the windowed rules with ``window <= 8``.
    Gates, decays and states are fp32 and matmul inputs are in the inputs' dtype (fp64 inputs are
    computed in fp32); ``o`` is returned in ``v``'s dtype and the final state in fp32 (fp64 for fp64
    inputs). ``chunk_size`` is 16, 32 or 64. Differentiable in q, k, v, beta, lam and the initial
    state's ``S``, ``last_k``, ``tail_x`` and ``tail_v``.

    ``disable_recompute`` (fla's option of the same name, e.g. in ``chunk_kda``): by default the forward keeps its
    inputs, the per-row gates and the WY solves (and, for the per-column rules, o's fp32 rounding residual), and
    the backward recomputes the value-sized WY tensors and the chunk-start states from them, as fla's chunk ops do.
    ``True`` keeps those from the forward too: a faster backward (no second state pass; for falcon2 its sequential
    solve) for several value-sized tensors and the chunk-start states (``[B, T / chunk, HV, K, V]``) per call, held
    until the backward.
    """
    if not isinstance(disable_recompute, bool):
        raise TypeError(f"disable_recompute must be a bool, got {disable_recompute!r}")
    scale, N = validate_falcon_inputs(
        q, k, v, beta, lam, rule=rule, window=window, scale=scale, eps=eps, eps_gamma=eps_gamma,
        lam_coupled=lam_coupled, shift=shift, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if rule == 'falcon3' and window == 1:   # the window of one pair is falcon1
        rule = 'falcon1'
    if rule not in SUPPORTED_RULES:
        raise NotImplementedError(f"chunk_falcon does not support rule {rule!r} yet (supported: {SUPPORTED_RULES})")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size!r}")
    regression, per_col, windowed = rule_info(rule)
    # the pairs before a chunk are one 16-row block (and the kernels unroll W terms)
    if windowed and window > 8:
        raise NotImplementedError(f"chunk_falcon supports {rule} windows up to 8, got window={window}")
    win = window if windowed else 0
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if K > 256:
        raise ValueError(f"chunk_falcon supports head dims K <= 256, got K={K}")
    if rule == 'falcon3' and window > 1:
        # its kernels work on 64 virtual rows per chunk (chunk_size does not apply). With a carried state, fp32 at
        # K = 128 puts its backward's WY kernel (_bwd_gates3) at 228 KB of shared memory, bf16 at K = 256 its
        # state-gradient kernel (_bwd_dhu3) at 236-262 KB and fp32 at K = 256 its forward's state kernel (_fwd_h3)
        # at 312-400 KB, over Hopper's 227 KB with every config (scripts/aot_check.py, Triton 3.6 sm_90)
        fp32 = q.dtype in (torch.float32, torch.float64)
        leaves = [q, k, v, beta, lam] + (list(initial_state[:4]) if initial_state is not None else [])
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
        k_max = (64 if fp32 else 128) if grad else (128 if fp32 else 256)
        if K > k_max:
            raise NotImplementedError(
                f"chunk_falcon's falcon3 supports head dims K <= {k_max} with {q.dtype} inputs "
                f"{'in training' if grad else 'without gradients'}, got K={K}: use fused_recurrent_falcon")
    if q.dtype in (torch.float32, torch.float64) and K > 64:
        # with fp32 matmul inputs and K > 64 the backward kernels' [chunk, K] tiles need more shared memory
        # at 64-row chunks than Hopper's 227 KB, for every config (OutOfResources at launch; see
        # scripts/aot_check.py); 32-row chunks fit, 16-row ones at K > 128. Same result, more chunks.
        chunk_size = min(chunk_size, 32 if K <= 128 else 16)
    out_dtype, fp64 = v.dtype, q.dtype == torch.float64
    if fp64:   # the kernels compute in fp32
        q, k, v = q.float(), k.float(), v.float()
    else:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    lam = lam.contiguous() if lam is not None else None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32 if cu_seqlens.dtype != torch.int64 else torch.int64)
    if initial_state is not None:
        S0 = initial_state.S.float().contiguous()
        last_k0 = initial_state.last_k.float().contiguous()
        count = initial_state.count.to(torch.int32).contiguous()
        tail_x0 = initial_state.tail_x.float().contiguous() if win > 1 else None
        tail_v0 = initial_state.tail_v.float().contiguous() if win > 1 else None
    else:
        S0 = last_k0 = count = tail_x0 = tail_v0 = None
    o, ht = ChunkFalconFunction.apply(
        q, k, v, beta, lam, S0, last_k0, tail_x0, tail_v0, count, scale, float(eps), float(eps_gamma),
        regression, per_col, win, lam_coupled, shift, output_final_state, cu_seqlens, chunk_size, disable_recompute)
    final_state = None
    if output_final_state:
        final_state = _final_state(k, v, ht, initial_state, cu_seqlens, N, H, HV, K, V, T, window, shift)
        if fp64:   # FalconState's contract (as naive and fused): fp64 with fp64 inputs
            final_state = FalconState(*(t.double() for t in final_state[:4]), final_state.count)
    return o.to(out_dtype), final_state


def _final_state(k, v, ht, initial_state, cu_seqlens, N, H, HV, K, V, T, window, shift):
    dev = k.device
    if cu_seqlens is None:
        lens = torch.full((N,), T, device=dev, dtype=torch.long)
        last_rows = k[:, -1] if T > 0 else k.new_zeros(N, H, K)
    else:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        # T = 0 (every sequence empty) has no row to index; empty sequences keep prev_k below anyway
        last_rows = k[0, (cu_seqlens[1:].long() - 1).clamp(min=0)] if T > 0 else k.new_zeros(N, H, K)
    if initial_state is not None:
        prev_k, prev_count = initial_state.last_k.float(), initial_state.count.to(torch.int32)
    else:
        prev_k, prev_count = k.new_zeros(N, H, K, dtype=torch.float32), torch.zeros(N, device=dev, dtype=torch.int32)
    # the last key seen (with or without the shift); counts are read clamped into [0, W]
    last_k = torch.where((lens > 0)[:, None, None], last_rows.float(), prev_k)
    prev_count = prev_count.clamp(0, window)
    count = torch.minimum(prev_count + lens.to(torch.int32), torch.full_like(prev_count, window))
    if window == 1:
        return FalconState(ht, last_k, ht.new_zeros(N, H, 0, K), ht.new_zeros(N, HV, 0, V), count)
    # falcon3a's tail: the pairs at positions len - W + 1 .. len - 1 of the sequence (p < 0: the old tail),
    # right-aligned, zeros where there is no pair; gathered here, so autograd sees the indexing
    W1 = window - 1
    bos = torch.zeros_like(lens) if cu_seqlens is None else cu_seqlens[:-1].long()
    pos = lens[:, None] - W1 + torch.arange(W1, device=dev)                     # [N, W1]
    n_tail = (prev_count - 1).clamp(min=0) if shift else prev_count.clamp(max=W1)
    valid = torch.where(pos >= 0, (pos > 0) | (not shift) | (prev_count[:, None] > 0), pos >= -n_tail[:, None].long())
    kf, vf = k.float().reshape(-1, H, K), v.float().reshape(-1, HV, V)
    seq = torch.arange(N, device=dev)[:, None] if cu_seqlens is None else torch.zeros_like(pos)
    row = (seq * T + bos[:, None] + pos).clamp(min=0)                           # the token of pair pos
    krow = (row - int(shift)).clamp(min=0)
    if T > 0:
        x_tok = kf[krow.clamp(max=kf.shape[0] - 1)].transpose(1, 2)                  # [N, H, W1, K]
        v_tok = vf[row.clamp(max=vf.shape[0] - 1)].transpose(1, 2)                   # [N, HV, W1, V]
    else:
        x_tok, v_tok = ht.new_zeros(N, H, W1, K), ht.new_zeros(N, HV, W1, V)
    if initial_state is not None:
        if shift:   # pair 0 is the carried last key
            x_tok = torch.where((pos == 0)[:, None, :, None], initial_state.last_k.float()[:, :, None], x_tok)
        old = (pos + W1).clamp(0, W1 - 1)
        x_old = initial_state.tail_x.float().gather(2, old[:, None, :, None].expand(N, H, W1, K))
        v_old = initial_state.tail_v.float().gather(2, old[:, None, :, None].expand(N, HV, W1, V))
        x_tok = torch.where((pos < 0)[:, None, :, None], x_old, x_tok)
        v_tok = torch.where((pos < 0)[:, None, :, None], v_old, v_tok)
    m = valid[:, None, :, None]
    return FalconState(ht, last_k, torch.where(m, x_tok, 0.), torch.where(m, v_tok, 0.), count)


chunk_falcon.supported_rules = SUPPORTED_RULES
# rules with a chunk forward only (no backward yet; none now): the layer would keep fused_recurrent for them
chunk_falcon.forward_only_rules = ()
