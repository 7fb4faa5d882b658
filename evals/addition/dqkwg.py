# -*- coding: utf-8 -*-
"""fla 0.6.0's `chunk_bwd_dqkwg` (the gated case) as a Triton kernel that avoids the pattern Triton 3.4-3.7.0
miscompiles on Hopper (fla #640: `tl.trans` of a `tl.dot` result fed into another `tl.dot`).

fla's kernel builds ds = do v^T per chunk and then takes dk += ds^T q with `tl.trans(ds)`. Here ds^T is its own
product, v do^T (one more [BT, BV] x [BV, BT] product per value block), gated and masked as its transpose. Same
arguments and results as fla's function; route 'fla+dqkwg' uses it on a GPU once it has matched the PyTorch
stand-in (`torch_path.chunk_bwd_dqkwg_torch`) on that GPU at the shapes in use (`torch_path._dqkwg`).

Per chunk (rows i, j; h, dh the chunk's start state and its gradient; g the chunk-local cumulative log2-decay):
  dq = scale * (exp2(g) * do h^T + ds k),   dk = exp2(g_last - g) * v dh^T + ds^T q,
  ds_ij = scale * [i >= j] exp2(g_i - g_j) do_i . v_j,   dw = -dv h^T,
  dg = rowsum(dq q) - rowsum(dk k), plus exp2(g_last) sum(h dh) + sum(dk_inter k) on the chunk's last row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# fp32 inputs: products as three TF32 products (tf32x3, ~fp32 accuracy). With plain TF32 the gradient of the
# gate's A_log, a sum of dg whose q.dq and k.dk terms cancel, was 15% off the fp32 reference on the H200 (GDN,
# (2, 100, 4, 64)); the harness trains in fp32. bf16/fp16 inputs are exact products with fp32 accumulation.
DOT_PRECISION = {torch.float32: 'tf32x3'}


def _prune_small_heads(configs, named_args, **kwargs):
    """4 warps only for 16-wide key or value blocks: with 8 warps, K = V = 16 in fp32 ended in an illegal memory access
    on the H200, inside the autotuner's benchmark of (8 warps, 2 stages) (test_gpu_small_heads_fp32, fifteenth lease:
    GatedDeltaNet and Mamba-2 with 16-wide heads), after (4 warps, 2 stages) had run."""
    if min(kwargs.get('BK', named_args.get('BK', 64)), kwargs.get('BV', named_args.get('BV', 64))) < 32:
        return [c for c in configs if c.num_warps <= 4]
    return configs


# (4 warps with 3 stages spill 8 B at K = V = 64 with fp32 inputs: scripts/aot_check.py's driver, sm_90a)
CONFIGS = [triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (8, 2), (8, 3))]


@triton.autotune(configs=CONFIGS,
                 key=['H', 'HV', 'K', 'V', 'BT', 'BK', 'BV', 'USE_DW', 'STATE_V_FIRST', 'IS_VARLEN'],
                 prune_configs_by={'early_config_prune': _prune_small_heads})
@triton.jit(do_not_specialize=['T'])
def _dqkwg_kernel(q, k, v, g, h, do, dh, dq, dk, dw, dv, dg, cu_seqlens, chunk_indices, scale, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, USE_DW: tl.constexpr, STATE_V_FIRST: tl.constexpr,
                  IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_tg = i_t
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_tg = i_b * tl.cdiv(T, BT) + i_t
        bos = (i_b * T).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    last = min(i_t * BT + BT, T) - 1
    p_state = (i_tg * HV + i_hv).to(tl.int64) * K * V
    p_tk = ((bos + o_t) * HV + i_hv)[:, None] * K + o_k[None, :]
    p_qk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_glast = tl.load(g + (bos + last) * HV + i_hv)
    # (exp2 on the masked-out side may overflow; tl.where does not propagate it)
    m_A = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    # passes over the value blocks that keep at most two [BT, 64] fp32 accumulators live (fp32 inputs spilled
    # with three): dw = -dv h^T (with w), then ds = do v^T and dq, then ds^T = v do^T and dk
    if USE_DW:
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_dv = tl.load(dv + ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :],
                           mask=m_t[:, None] & m_v[None, :], other=0)
            b_h = _state_tile(h, p_state, o_k, m_k, o_v, m_v, K, V, STATE_V_FIRST)
            b_dw += tl.dot(b_dv.to(b_h.dtype), b_h, input_precision=PREC)
        tl.store(dw + p_tk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, b_v, b_do = _vdo_block(v, do, bos, o_t, m_t, i_v, i_hv, HV, V, BV)
        b_h = _state_tile(h, p_state, o_k, m_k, o_v, m_v, K, V, STATE_V_FIRST)
        b_ds += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dq += tl.dot(b_do, b_h.to(b_do.dtype), input_precision=PREC)
    b_k = tl.load(k + p_qk, mask=m_tk, other=0)
    b_ds = tl.where(m_A, b_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0) * scale
    b_dq = b_dq * tl.exp2(b_g)[:, None] * scale + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    b_q = tl.load(q + p_qk, mask=m_tk, other=0)
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    b_dg = tl.sum(b_dq * b_q.to(tl.float32), 1)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dsT = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, b_v, b_do = _vdo_block(v, do, bos, o_t, m_t, i_v, i_hv, HV, V, BV)
        b_dh = _state_tile(dh, p_state, o_k, m_k, o_v, m_v, K, V, STATE_V_FIRST)
        # ds^T as its own product: tl.trans of b_ds fed into tl.dot is what Triton 3.4-3.7.0 miscompiles on Hopper
        b_dsT += tl.dot(b_v, tl.trans(b_do), input_precision=PREC)
        b_dk += tl.dot(b_v, b_dh.to(b_v.dtype), input_precision=PREC)
    b_dk = b_dk * tl.where(m_t, tl.exp2(b_glast - b_g), 0)[:, None]
    # <h, dh> from loads of their own: a tile that feeds both an asynchronous wgmma (do h) and register code gets one
    # shared-memory slot too few from Triton 3.6's pipeliner on Hopper, and the next block's copy lands in the slot the
    # wgmma still reads (scripts/wgmma_hazards.py; bf16 K = V = 128 had it, fifteenth lease's aot_check)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_hdh += tl.sum(_state_tile(h, p_state, o_k, m_k, o_v, m_v, K, V, STATE_V_FIRST).to(tl.float32) *
                        _state_tile(dh, p_state, o_k, m_k, o_v, m_v, K, V, STATE_V_FIRST).to(tl.float32), 0)
    b_kf = b_k.to(tl.float32)
    b_dg_last = tl.sum(b_hdh, 0) * tl.exp2(b_glast) + tl.sum(tl.sum(b_dk * b_kf, 1), 0)
    m_At = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_dsT = tl.where(m_At, b_dsT * tl.exp2(b_g[None, :] - b_g[:, None]), 0) * scale
    b_dk += tl.dot(b_dsT.to(b_q.dtype), b_q, input_precision=PREC)
    b_dg -= tl.sum(b_dk * b_kf, 1)
    b_dg = tl.where(o_t == last, b_dg + b_dg_last, b_dg)
    tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + (bos + o_t) * HV + i_hv, b_dg, mask=m_t)


@triton.jit
def _vdo_block(v, do, bos, o_t, m_t, i_v, i_hv, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """(o_v, m_v, v, do) of the chunk's rows in value block i_v ([BT, BV] tiles)."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = ((bos + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
    return o_v, m_v, tl.load(v + p_tv, mask=m_tv, other=0), tl.load(do + p_tv, mask=m_tv, other=0)


@triton.jit
def _state_tile(s, p_state, o_k, m_k, o_v, m_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """A chunk state's [BV, BK] tile, stored [V, K] (state_v_first) or [K, V]."""
    if STATE_V_FIRST:
        p = o_v[:, None] * K + o_k[None, :]
    else:
        p = o_k[None, :] * V + o_v[:, None]
    return tl.load(s + p_state + p, mask=m_v[:, None] & m_k[None, :], other=0)


def supports(K: int, V: int) -> bool:
    """Head sizes the kernel is checked for: whole 16-wide tiles (the addition models have K = V = 64)."""
    return K % 16 == 0 and V % 16 == 0


def chunk_bwd_dqkwg_triton(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                           state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """fla 0.6.0's `fla.ops.common.chunk_o.chunk_bwd_dqkwg` (same arguments and results) for the per-token gated
    case (`g`); returns (dq, dk, dw, dg)."""
    if g is None or g_gamma is not None:
        raise NotImplementedError("chunk_bwd_dqkwg_triton covers the per-token gated case (g) only")
    if w is not None and dv is None:
        raise ValueError("dw = -dv h^T needs dv when w is given")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[-1]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    if K > 256:
        raise ValueError(f"K = {K} > 256: one key block per program holds the whole key dimension")
    if not supports(K, V):
        # K = V = 8 (a Mamba-2 test layer) faulted on the H200 with an illegal memory access inside this kernel;
        # the route takes the PyTorch stand-in for such heads
        raise NotImplementedError(f"chunk_bwd_dqkwg_triton needs K and V multiples of 16, got K = {K}, V = {V}")
    BT = chunk_size
    if cu_seqlens is not None and chunk_indices is None:
        from fla.ops.utils import prepare_chunk_indices
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    if scale is None:
        scale = K ** -0.5
    BK = max(triton.next_power_of_2(K), 16)
    # (fp32 inputs: 32-wide value blocks; 64 spilled 40-72 B per thread at K = V = 64 for sm_90a)
    BV = min(max(triton.next_power_of_2(V), 16), 64 if v.element_size() <= 2 else 32)
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    dw = torch.empty_like(w) if w is not None else None
    _dqkwg_kernel[(NT, B * HV)](
        q, k, v, g, h, do, dh, dq, dk, dw, dv, dg, cu_seqlens, chunk_indices, scale, T,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_DW=w is not None, STATE_V_FIRST=state_v_first,
        IS_VARLEN=cu_seqlens is not None, PREC=DOT_PRECISION.get(q.dtype, 'tf32'))
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dw, dg
