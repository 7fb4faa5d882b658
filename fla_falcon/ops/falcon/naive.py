# -*- coding: utf-8 -*-
"""Token-by-token PyTorch reference of the six Falcon update rules: the definition of each rule.

Per head, with state ``S in R^{K x V}`` and read-after-write ``o_t = scale * S_t^T q_t``, the pair
written at step t is ``(x_t, y_t) = (k_{t-1}, v_t)`` (``shift=True``; a fresh sequence has no pair
at t = 1, so no write and no decay there) or ``(k_t, v_t)`` (``shift=False``). With gain ``beta``,
ridge ``lam >= 0`` and residual ``r = y - S^T x`` at the pre-update state:

============  =====================================  ===============================================
rule          energy E                               update (eta = beta / (E + lam + eps))
============  =====================================  ===============================================
falcon1       ||x||^2                                S <- g S + eta x r^T
falcon2       ||x||^2                                column j: s_j <- g_j s_j + eta_j x r_j
falcon3       lambda_max(X^T X) / B_t                S <- g S + eta/B_t sum_{j in window} x_j r_j^T
falcon1a      ||x||^2                                S <- g S + eta x y^T
falcon2a      ||x||^2                                column j: s_j <- g_j s_j + eta_j y_j x
falcon3a      mean_{j in window} ||x_j||^2           S <- g S + eta/B_t sum_{j in window} x_j y_j^T
============  =====================================  ===============================================

with decay ``g = 1 - min(eta * lam, 1 - eps_gamma)`` (per column for rules 2/2a). The window of
rules 3/3a holds the last ``min(window, pairs so far)`` pairs; every residual uses the same
pre-update S. ``lam_coupled=True`` reads ``lam`` as dimensionless and uses ``lam * E`` with E
treated as a statistic (no gradient through that factor).

:func:`naive_chunk_falcon` writes every rule chunk by chunk: the exact transition of C steps as
triangular solves over the chunk's window pairs (falcon3's rank-B update and falcon2's per-column
systems included), the form a chunk kernel computes.
"""

from __future__ import annotations

import functools

import torch

from fla_falcon.ops.falcon.utils import (
    DEFAULT_EPS,
    DEFAULT_EPS_GAMMA,
    FalconState,
    rule_info,
    validate_falcon_inputs,
)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (the paper's eta := 0 convention), with finite gradients."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def falcon_step(
    S: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor | None,
    *, rule: str, eps: float, eps_gamma: float, lam_coupled: bool,
) -> torch.Tensor:
    """One write of a Falcon rule for a batch of heads.

    S: ``[..., K, V]``; X: ``[..., B_t, K]`` and Y: ``[..., B_t, V]`` the pairs of this step (one pair,
    ``B_t = 1``, for the non-windowed rules); beta: ``[...]`` or ``[..., V]`` (rules 2/2a);
    lam: ``[...]`` or None. Returns the updated S.
    """
    regression, per_column, windowed = rule_info(rule)
    Bt = X.shape[-2]
    if rule == 'falcon3':
        # mu = lambda_max of the window covariance X^T X / B_t, from the small B_t x B_t Gram matrix
        E = torch.linalg.eigvalsh(X @ X.transpose(-1, -2))[..., -1] / Bt
    else:
        # ||x||^2 for rules 1/2/1a/2a (B_t = 1), the mean energy of the window for 3a
        E = (X * X).sum(-1).mean(-1)
    lam_t = torch.zeros_like(E) if lam is None else (lam * E.detach() if lam_coupled else lam)
    den = E + lam_t + eps
    if per_column:
        eta = _safe_div(beta, den[..., None])                      # [..., V]
        alpha = (eta * lam_t[..., None]).clamp(max=1 - eps_gamma)
        gamma = (1 - alpha)[..., None, :]                          # decays the columns
    else:
        eta = _safe_div(beta, den)                                  # [...]
        alpha = (eta * lam_t).clamp(max=1 - eps_gamma)
        gamma = (1 - alpha)[..., None, None]
    # what is written: the residual at the pre-update state (regression) or the value (inner product)
    R = Y - X @ S if regression else Y                              # [..., B_t, V]
    if per_column:
        R = R * eta[..., None, :]
    else:
        R = R * (eta / Bt)[..., None, None]
    return gamma * S + X.transpose(-1, -2) @ R


def _falcon_sequence(q, k, v, beta, lam, state: FalconState, *, rule, window, scale, eps, eps_gamma,
                     lam_coupled, shift):
    """One sequence: q, k ``[T, H, K]``, v ``[T, HV, V]``, beta ``[T, HV(, V)]``, lam ``[T, HV]``;
    state fields without the leading N. Returns o ``[T, HV, V]`` and the final state."""
    T, H, K = k.shape
    HV = v.shape[1]
    G = HV // H
    S, last_k, tail_x, tail_v, count = state
    count = min(max(int(count), 0), window)   # counts outside [0, W] are read clamped, as the kernels do
    # the pairs of the window, oldest first, as python lists of [H, K] / [HV, V]
    n_tail = max(count - 1, 0) if shift else min(count, window - 1)
    pairs_x = [tail_x[:, window - 1 - n_tail + i] for i in range(n_tail)]
    pairs_v = [tail_v[:, window - 1 - n_tail + i] for i in range(n_tail)]
    has_key = count > 0
    outs = []
    for t in range(T):
        if shift:
            x = last_k if has_key else None   # x_1 = 0 on a fresh sequence: no pair, no decay
        else:
            x = k[t]
        last_k, has_key = k[t], True
        if x is not None:
            pairs_x = (pairs_x + [x])[-window:]
            pairs_v = (pairs_v + [v[t]])[-window:]
            X = torch.stack(pairs_x, 1).repeat_interleave(G, 0)   # [HV, B_t, K]: value head h uses key head h // G
            Y = torch.stack(pairs_v, 1)                           # [HV, B_t, V]
            S = falcon_step(S, X, Y, beta[t], None if lam is None else lam[t], rule=rule, eps=eps,
                            eps_gamma=eps_gamma, lam_coupled=lam_coupled)
        qh = q[t].repeat_interleave(G, 0)                         # [HV, K]
        outs.append(scale * torch.einsum('hk,hkv->hv', qh, S))
    count = min(count + T, window)
    # the new tail: the last min(pairs, window - 1) pairs, right-aligned, zeros before them
    keep = min(len(pairs_x), window - 1)
    pad_x, pad_v = tail_x.new_zeros(H, window - 1 - keep, K), tail_v.new_zeros(HV, window - 1 - keep, v.shape[-1])
    new_tail_x = torch.cat([pad_x] + ([torch.stack(pairs_x[-keep:], 1)] if keep else []), 1)
    new_tail_v = torch.cat([pad_v] + ([torch.stack(pairs_v[-keep:], 1)] if keep else []), 1)
    o = torch.stack(outs, 0) if outs else v.new_zeros(0, HV, v.shape[-1])
    return o, (S, last_k, new_tail_x, new_tail_v, count)


def naive_recurrent_falcon(
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
    r"""Reference Falcon recurrence, one token at a time (slow; for tests and as the definition).

    Args:
        q, k: ``[B, T, H, K]`` query and key features (after the feature map; ``k`` before the
            shift: the op pairs ``k_{t-1}`` with ``v_t`` itself).
        v: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H`` (grouped value heads share a key head).
        beta: gains, ``[B, T, HV]`` (falcon1/3/1a/3a) or ``[B, T, HV, V]`` (falcon2/2a).
        lam: ridge ``[B, T, HV]`` (>= 0; dimensionless when ``lam_coupled``) or None for no ridge.
        rule: one of falcon1, falcon2, falcon3, falcon1a, falcon2a, falcon3a.
        window: window size B of falcon3/falcon3a (1 for the other rules).
        scale: read scale, ``K ** -0.5`` if None.
        eps, eps_gamma: step-size stabilizer and positive-decay clamp.
        lam_coupled: use ``lam * E`` as the ridge (scale-coupled), E a statistic.
        shift: False writes the same-step pair ``(k_t, v_t)`` (the DeltaNet-style ablation).
        initial_state: a :class:`FalconState` for the ``N`` sequences, or None (fresh).
        output_final_state: return the state after the last token.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B = 1``); each restarts fresh unless
            ``initial_state`` gives its state.

    Returns:
        ``o`` of shape ``[B, T, HV, V]`` in ``v``'s dtype and the final :class:`FalconState` or None.
        Computation runs in fp64 for fp64 inputs and in fp32 otherwise.
    """
    return _per_sequence(
        _falcon_sequence, q, k, v, beta, lam, rule=rule, window=window, scale=scale, eps=eps, eps_gamma=eps_gamma,
        lam_coupled=lam_coupled, shift=shift, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)


def _per_sequence(seq_fn, q, k, v, beta, lam, *, rule, window, scale, eps, eps_gamma, lam_coupled, shift,
                  initial_state, output_final_state, cu_seqlens):
    """Validates, casts, runs ``seq_fn`` on every sequence (batch row or packed span) and stacks the results."""
    scale, N = validate_falcon_inputs(
        q, k, v, beta, lam, rule=rule, window=window, scale=scale, eps=eps, eps_gamma=eps_gamma,
        lam_coupled=lam_coupled, shift=shift, initial_state=initial_state, cu_seqlens=cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    out_dtype = v.dtype
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, beta = (t.to(dt) for t in (q, k, v, beta))
    lam = lam.to(dt) if lam is not None else None
    if initial_state is None:
        initial_state = FalconState.zeros(N, H, HV, K, V, window, device=q.device, dtype=dt)
    else:
        initial_state = FalconState(*(t.to(dt) for t in initial_state[:4]), initial_state.count)
    if cu_seqlens is None:
        spans = [(n, slice(None)) for n in range(N)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, slice(bounds[n], bounds[n + 1])) for n in range(N)]
    outs, finals = [], []
    for n, (b, span) in enumerate(spans):
        seq = [None if t is None else t[b, span] for t in (q, k, v, beta, lam)]
        state_n = FalconState(*(t[n] for t in initial_state))
        o_n, final_n = seq_fn(
            *seq, state_n, rule=rule, window=window, scale=scale, eps=eps, eps_gamma=eps_gamma,
            lam_coupled=lam_coupled, shift=shift)
        outs.append(o_n)
        finals.append(final_n)
    o = torch.stack(outs, 0) if cu_seqlens is None else torch.cat(outs, 0)[None]
    final_state = None
    if output_final_state:
        S, last_k, tail_x, tail_v, count = zip(*finals)
        final_state = FalconState(
            torch.stack(S), torch.stack(last_k), torch.stack(tail_x), torch.stack(tail_v),
            torch.tensor(count, dtype=torch.int32, device=q.device))
    return o.to(out_dtype), final_state


def naive_chunk_falcon(
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
    chunk_size: int = 16,
    unknowns: str = 'pairs',
) -> tuple[torch.Tensor, FalconState | None]:
    r"""The chunk form of every Falcon rule in PyTorch.

    Same arguments, results and state as :func:`naive_recurrent_falcon`; ``chunk_size`` steps at once.
    The exact transition over a chunk (what a chunk kernel computes), written for reading and for
    testing kernels against, not for speed.

    Step t of a chunk writes its window's ``B_t`` pairs ``(x_{t,i}, y_{t,i})`` ("virtual tokens", at most
    ``C * W`` per chunk) with the common coefficient ``c_t = eta_t / B_t`` and decay ``gamma_t``. With ``G``
    the in-chunk cumulative ``log gamma`` and ``S0`` the state at the chunk start, the written vectors
    ``U_{t,i} = c_t (y_{t,i} - S_{t-1}^T x_{t,i})`` (regression; ``c_t y_{t,i}`` for inner product) solve
    the unit lower-triangular system

        U_{t,i} + c_t sum_{s < t, j} exp(G_{t-1} - G_s) (x_{t,i} . x_{s,j}) U_{s,j}
            = c_t (y_{t,i} - exp(G_{t-1}) S0^T x_{t,i})

    (the pairs of one step all see the same pre-update state: ``s < t`` by step, not by pair), and

        o_t = scale (exp(G_t) S0^T q_t + sum_{s <= t, j} exp(G_t - G_s) (q_t . x_{s,j}) U_{s,j}),
        S_C = exp(G_C) S0 + sum_{s, j} exp(G_C - G_s) x_{s,j} U_{s,j}^T.

    With window 1 this is falcon1's WY form (a gated delta rule on the shifted keys) and falcon1a's
    gated linear attention. falcon2/2a have one coefficient and one decay per value column
    (``c``, ``G`` carry a column index): falcon2 solves one such system per column, with one
    right-hand side each, all sharing the key Gram matrix (the paper's merged single solve).

    ``unknowns='steps'`` (falcon1 and falcon3) solves the same transition with one unknown per step
    instead of one per window pair: see :func:`_step_row_writes`. ``unknowns='coefficients'`` (falcon1 and
    falcon3) never forms a value-sized tensor per window slot: the chunk's coefficients come from keys, queries
    and gates alone (:func:`chunk_coefficients`), then o and the state from products on the chunk's steps and
    its C + W - 1 pairs (docs/falcon3_step_form.md).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if unknowns not in ('pairs', 'steps', 'coefficients'):
        raise ValueError(f"unknowns must be 'pairs', 'steps' or 'coefficients', got {unknowns!r}")
    if unknowns != 'pairs' and rule not in ('falcon1', 'falcon3'):
        raise ValueError(f"unknowns={unknowns!r} is a chunk form of falcon1 and falcon3, not of rule {rule!r}")
    seq_fn = functools.partial(_falcon_chunk_sequence, chunk_size=chunk_size, unknowns=unknowns)
    return _per_sequence(
        seq_fn, q, k, v, beta, lam, rule=rule, window=window, scale=scale, eps=eps, eps_gamma=eps_gamma,
        lam_coupled=lam_coupled, shift=shift, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)


def _falcon_chunk_sequence(q, k, v, beta, lam, state: FalconState, *, rule, window, scale, eps, eps_gamma,
                           lam_coupled, shift, chunk_size, unknowns='pairs'):
    """One sequence in chunks (see :func:`naive_chunk_falcon`); the arguments of :func:`_falcon_sequence`."""
    regression, per_column, _ = rule_info(rule)
    T, H, K = k.shape
    HV, V = v.shape[1:]
    G_ = HV // H
    W = window
    S, last_k, tail_x, tail_v, count = state
    count = min(max(int(count), 0), W)
    # every pair of the sequence in order: the carried tail, then one per step that has one
    n_tail = max(count - 1, 0) if shift else min(count, W - 1)
    if shift:
        has_prev = count > 0
        step_x = torch.cat([last_k[None], k[:-1]], 0) if T else k      # x_t = k_{t-1}, x_1 = the carried key
        has_pair = torch.ones(T, dtype=torch.bool, device=k.device)
        has_pair[:1] = has_prev
    else:
        step_x = k
        has_pair = torch.ones(T, dtype=torch.bool, device=k.device)
    px = torch.cat([tail_x[:, W - 1 - n_tail:], step_x.transpose(0, 1)[:, has_pair]], 1)   # [H, P, K]
    py = torch.cat([tail_v[:, W - 1 - n_tail:], v.transpose(0, 1)[:, has_pair]], 1)         # [HV, P, V]
    P = px.shape[1]
    # the window of step t: pairs p_t, p_t - 1, ..., p_t - W + 1 (those that exist)
    p_t = n_tail + torch.cumsum(has_pair.long(), 0) - 1                                    # [T]
    idx = p_t[:, None] - torch.arange(W, device=k.device)[None, :]                          # [T, W]
    m = (idx >= 0) & has_pair[:, None]                                                      # [T, W]
    idx = idx.clamp(min=0)
    mf = m.to(k.dtype)
    Xw = px[:, idx] * mf[None, :, :, None] if P else k.new_zeros(H, T, W, K)               # [H, T, W, K]
    Yw = py[:, idx] * mf[None, :, :, None] if P else v.new_zeros(HV, T, W, V)              # [HV, T, W, V]
    Xw = Xw.repeat_interleave(G_, 0)                                                        # [HV, T, W, K]
    # the step's statistics and gates, as falcon_step computes them
    Bt = m.sum(-1).to(k.dtype)                                                              # [T]
    Bs = Bt.clamp(min=1)
    if rule == 'falcon3':
        E = torch.linalg.eigvalsh(Xw @ Xw.transpose(-1, -2))[..., -1] / Bs                 # zero rows add 0s
    else:
        E = (Xw * Xw).sum((-1, -2)) / Bs
    # gates with a trailing column axis: V columns (falcon2/2a: per-column gains and decays) or 1
    bt = beta.transpose(0, 1) if per_column else beta.transpose(0, 1)[..., None]            # [HV, T, Vg]
    lam_t = torch.zeros_like(E) if lam is None else (lam.transpose(0, 1) * E.detach() if lam_coupled
                                                      else lam.transpose(0, 1))
    eta = _safe_div(bt, (E + lam_t + eps)[..., None])
    alpha = (eta * lam_t[..., None]).clamp(max=1 - eps_gamma)
    write = has_pair[None, :, None]
    g = torch.where(write, torch.log1p(-alpha), torch.zeros_like(alpha))   # a step without a pair: no decay
    c = torch.where(write, eta / Bs[None, :, None], torch.zeros_like(eta))
    qh = q.repeat_interleave(G_, 1).transpose(0, 1) * scale                                 # [HV, T, K]
    if unknowns == 'coefficients' and T:
        # the pairs step-aligned: row t + W - 1 is step t's newest pair (zero where the step has none), the
        # first W - 1 rows the pairs before the sequence (step 0's older window slots)
        Xs = torch.cat([Xw[:, 0, 1:].flip(1), Xw[:, :, 0]], 1)                              # [HV, W - 1 + T, K]
        Ys = torch.cat([Yw[:, 0, 1:].flip(1), Yw[:, :, 0]], 1)
    outs = []
    for t0 in range(0, T, chunk_size):
        n = min(chunk_size, T - t0)
        sl = slice(t0, t0 + n)
        G = torch.cumsum(g[:, sl], 1)                                                        # [HV, n, Vg]
        if unknowns == 'coefficients':
            # values only per step and per pair: the chunk's coefficients, then products on n and J rows
            J = n + W - 1
            Xc, Yc = Xs[:, t0:t0 + J], Ys[:, t0:t0 + J]                                      # [HV, J, .]
            o_c, S_c = [], []
            for h in range(HV):
                Oy, Opi, Zy, Zpi = chunk_coefficients(Xc[h], qh[h, sl], g[h, sl, 0], c[h, sl, 0], W,
                                                      m=max(1, 16 // W))
                Pi = Xc[h] @ S[h]
                o_c.append(G[h, :, 0].exp()[:, None] * (qh[h, sl] @ S[h]) + Oy @ Yc[h] + Opi @ Pi)
                S_c.append(G[h, -1, 0].exp() * S[h] + Xc[h].T @ (Zy @ Yc[h] + Zpi @ Pi))
            outs.append(torch.stack(o_c))
            S = torch.stack(S_c)
            continue
        st = torch.arange(n, device=k.device).repeat_interleave(W)                          # step of each pair
        X = Xw[:, sl].reshape(HV, n * W, K)
        Y = Yw[:, sl].reshape(HV, n * W, V)
        Gp = G - g[:, sl]                                                                    # G_{t-1}
        cv = c[:, sl][:, st]                                                                 # [HV, nW, Vg]
        if unknowns == 'steps':
            U = _step_row_writes(Xw[:, sl], Yw[:, sl], mf[sl], S, g[:, sl, 0], c[:, sl, 0]).reshape(HV, n * W, V)
        elif regression:
            before = (st[:, None] > st[None, :])[..., None]                                  # s < t by step
            D = (Gp[:, st][:, :, None] - G[:, st][:, None, :]).masked_fill(~before, float('-inf')).exp()
            L = (cv[:, :, None] * D * (X @ X.transpose(-1, -2))[..., None]).movedim(-1, 1)  # [HV, Vg, nW, nW]
            rhs = cv * (Y - Gp[:, st].exp() * (X @ S))                                       # [HV, nW, V]
            # one system per column (falcon2: a right-hand side each) or one for all columns
            rhs = rhs.transpose(1, 2)[..., None] if per_column else rhs[:, None]
            eye = torch.eye(n * W, dtype=L.dtype, device=L.device)
            U = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
            U = U[..., 0].transpose(1, 2) if per_column else U[:, 0]                         # [HV, nW, V]
        else:
            U = cv * Y
        Q = qh[:, sl]                                                                        # [HV, n, K]
        seen = (torch.arange(n, device=k.device)[:, None] >= st[None, :])[..., None]         # s <= t
        Do = (G[:, :, None] - G[:, st][:, None, :]).masked_fill(~seen, float('-inf')).exp()  # [HV, n, nW, Vg]
        A = Q @ X.transpose(-1, -2)
        intra = torch.einsum('hts,htsc,hsc->htc', A, Do, U) if per_column else (A * Do[..., 0]) @ U
        outs.append(G.exp() * (Q @ S) + intra)
        S = G[:, -1][:, None, :].exp() * S + X.transpose(-1, -2) @ ((G[:, -1:] - G[:, st]).exp() * U)
    o = torch.cat(outs, 1).transpose(0, 1) if outs else v.new_zeros(0, HV, V)
    # the continuation state, as _falcon_sequence leaves it
    keep = min(P, W - 1)
    new_tail_x = torch.cat([tail_x.new_zeros(H, W - 1 - keep, K), px[:, P - keep:]], 1)
    new_tail_v = torch.cat([tail_v.new_zeros(HV, W - 1 - keep, V), py[:, P - keep:]], 1)
    last = k[-1] if T else last_k
    return o, (S, last, new_tail_x, new_tail_v, min(count + T, W))


def _step_row_writes(X, Y, mask, S0, g, c):
    r"""The writes ``U_{t,a} = c_t (y_{t,a} - S_{t-1}^T x_{t,a})`` of one chunk of a windowed regression rule
    (falcon3; falcon1 is window 1) with one unknown per step instead of one per window pair.

    X ``[HV, n, W, K]``, Y ``[HV, n, W, V]``: the pairs of each step's window (slot 0 the newest, zero rows
    where ``mask`` ``[n, W]`` has no pair); S0 ``[HV, K, V]`` the chunk-start state; g ``[HV, n]`` the
    log-decays, c ``[HV, n]`` the coefficients. Returns U ``[HV, n, W, V]``.

    Only the newest pair's prediction ``f_t = S_{t-1}^T x_{t,0}`` reads the state. A pair in slot a >= 1 at step t
    was in slot a - 1 at step t - 1, and its prediction follows from that one:

        P_t(a) = gamma_{t-1} P_{t-1}(a-1) + sum_a' (x_{t,a} . x_{t-1,a'}) U_{t-1,a'},

    so every prediction, and every write, is ``P = alpha f + rho`` with coefficients ``alpha`` over the chunk's
    n unknowns that do not depend on the value column (a W x W recursion over the steps), and ``rho`` from
    the values and S0. The unknowns then solve one unit lower-triangular n x n system, shared by the columns:

        f_t = exp(G_{t-1}) x_{t,0}^T S0 + sum_{s < t, a} exp(G_{t-1} - G_s) (x_{t,0} . x_{s,a}) U_{s,a}

    (``unknowns='pairs'`` solves for the n W writes directly: ``C W`` rows instead of ``C``.)
    """
    HV, n, W, K = X.shape
    V = Y.shape[-1]
    G = torch.cumsum(g, 1)
    Gp = G - g                                                                               # G_{t-1}
    m = mask.to(X.dtype)[:, :, None]                                                         # [n, W, 1]
    eye = torch.eye(n, dtype=X.dtype, device=X.device)
    Ua, Ur = [], []                   # per step: U = Ua f + Ur, [HV, W, n] and [HV, W, V]
    for t in range(n):
        if t == 0:
            # the window's older pairs read S0 itself; the newest is the unknown f_0
            alpha = eye[0].expand(HV, W, n) * (torch.arange(W, device=X.device) == 0).to(X.dtype)[None, :, None]
            rho = torch.cat([X.new_zeros(HV, 1, V), X[:, 0, 1:] @ S0], 1)
        else:
            Mw = X[:, t] @ X[:, t - 1].transpose(-1, -2)                                      # [HV, W, W]
            gam = g[:, t - 1].exp()[:, None, None]
            alpha = torch.cat([eye[t].expand(HV, 1, n), gam * alpha[:, :-1] + (Mw @ Ua[-1])[:, 1:]], 1)
            rho = torch.cat([X.new_zeros(HV, 1, V), gam * rho[:, :-1] + (Mw @ Ur[-1])[:, 1:]], 1)
        Ua.append(-c[:, t, None, None] * alpha * m[t])
        Ur.append(c[:, t, None, None] * (Y[:, t] - rho) * m[t])
    Ua, Ur = torch.stack(Ua, 1), torch.stack(Ur, 1)                                          # [HV, n, W, .]
    before = torch.ones(n, n, dtype=torch.bool, device=X.device).tril(-1)                    # s < t
    D = (Gp[:, :, None] - G[:, None, :]).masked_fill(~before, float('-inf')).exp()            # [HV, t, s]
    Kts = D[..., None] * torch.einsum('htk,hsak->htsa', X[:, :, 0], X)                        # [HV, t, s, W]
    A = eye - torch.einsum('htsa,hsai->hti', Kts, Ua)
    rhs = Gp.exp()[..., None] * (X[:, :, 0] @ S0) + torch.einsum('htsa,hsav->htv', Kts, Ur)
    f = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)               # [HV, n, V]
    return torch.einsum('htai,hiv->htav', Ua, f) + Ur


def _coef_subchunk(X, Q, G, Gp, c, M, Zacc, tau, n, W, m):
    """One sub-chunk of :func:`chunk_coefficients` (steps tau .. tau + m - 1): its rows' steps and pairs, the
    solve A = (I + P)^-1, the rows' state predictions Pi_i, right-hand sides R, writes CU = A R, and the
    sub-chunk's output rows. Returns a dict of them (the backward reuses every one)."""
    J = n + W - 1
    dt = X.dtype
    zero = torch.zeros((), dtype=dt, device=X.device)
    ts = torch.arange(tau, min(tau + m, n), device=X.device)
    st = ts.repeat_interleave(W)                                                    # the rows' steps
    pr = st - torch.arange(W, device=X.device).repeat(len(ts)) + W - 1             # the rows' pairs (X rows)
    Gs = G[tau - 1] if tau else zero                                                # G_{tau-1}
    # A_i: P[r, s] = c_t(r) exp(G_{t(r)-1} - G_t(s)) x_r . x_s for t(s) < t(r) (chunk_win's _wy_p3)
    Dm = torch.where(st[:, None] > st[None, :], (Gp[st][:, None] - G[st][None, :]).clamp(max=0).exp(), zero)
    Mpp = M[pr][:, pr]
    eye = torch.eye(len(st), dtype=dt, device=X.device)
    A = torch.linalg.solve_triangular(eye + c[st][:, None] * Dm * Mpp, eye, upper=False, unitriangular=True)
    src = torch.eye(2 * J, dtype=dt, device=X.device)
    Sy, Sp = src[pr], src[J + pr]                                                   # y_p(r), pi_p(r) as sources
    Pi = Gs.exp() * Sp + M[pr] @ Zacc                                               # rows' X S_(i) coefficients
    ef = (Gp[st] - Gs).exp()
    f = c[st] * ef
    R = c[st][:, None] * Sy - f[:, None] * Pi
    CU = A @ R
    # outputs of the sub-chunk's steps: the state before it, then its rows up to the step
    e1 = (G[ts] - Gs).exp()
    QX = Q[ts] @ X.T
    QXp = Q[ts] @ X[pr].T
    Do = torch.where(ts[:, None] >= st[None, :], (G[ts][:, None] - G[st][None, :]).clamp(max=0).exp(), zero)
    T1 = QX @ Zacc
    out = e1[:, None] * T1 + (Do * QXp) @ CU
    return dict(ts=ts, st=st, pr=pr, Gs=Gs, Dm=Dm, Mpp=Mpp, A=A, Sy=Sy, Sp=Sp, Pi=Pi, ef=ef, f=f, R=R, CU=CU, e1=e1,
                QX=QX, QXp=QXp, Do=Do, T1=T1, O=out, Zin=Zacc, Gn=G[ts[-1]])


def chunk_coefficients(X, Q, g, c, W, m=16):
    r"""The coefficients of one chunk of a windowed regression rule (falcon3; falcon1 at W = 1) in the form whose
    value-sized tensors are per step or per pair (``unknowns='coefficients'``, docs/falcon3_step_form.md).

    X ``[J, K]``: the pairs of the chunk's windows, step-aligned (row t + W - 1 the newest pair of step t, the
    first W - 1 rows the pairs before the chunk; zero rows where there is none), Q ``[n, K]`` the scaled queries,
    g, c ``[n]`` the log-decays and coefficients. Returns (Oy, Opi, Zy, Zpi) with, for Pi = X S0,

        o = exp(G) * (Q S0) + Oy Y + Opi Pi,      S_n = exp(G_n) S0 + X^T (Zy Y + Zpi Pi).

    Sub-chunks of m steps are each solved in virtual rows (``A = (I + P)^-1`` over m W rows, the chunk kernels'
    system) and coupled through the pairs; any m gives the same result. No value column and no state enters.

    A virtual row r = (t, a) writes U_r = CU[r] . [Y; Pi] (pair p(r) = t - a, row t - a + W - 1). Sub-chunk i
    (steps tau .. tau + m - 1) reads the state S_(i) before it only through its pairs' predictions
    X S_(i) = exp(G_{tau-1}) Pi + M Zacc, with M = X X^T and Zacc the earlier rows' writes per pair, decayed to
    tau - 1; its rows solve U = A_i (diag(c) E Y - diag(c exp(G_{t-1} - G_{tau-1})) E X S_(i))."""
    n = Q.shape[0]
    J = n + W - 1
    G = torch.cumsum(g, 0)
    Gp = G - g
    M = X @ X.T                                                                     # J x J pair Gram
    # per pair, the earlier rows' writes decayed to the sub-chunk's start: sum exp(G_{tau-1} - G_t(r)) e_p(r) CU[r]
    Zacc = torch.zeros(J, 2 * J, dtype=X.dtype, device=X.device)
    Orow = torch.zeros(n, 2 * J, dtype=X.dtype, device=X.device)
    for tau in range(0, n, m):
        sc = _coef_subchunk(X, Q, G, Gp, c, M, Zacc, tau, n, W, m)
        Orow[sc['ts']] = sc['O']
        # carry the writes to the next sub-chunk's start (or the chunk's end)
        Zacc = (sc['Gn'] - sc['Gs']).exp() * Zacc
        Zacc = Zacc.index_add(0, sc['pr'], (sc['Gn'] - G[sc['st']]).exp()[:, None] * sc['CU'])
    return Orow[:, :J], Orow[:, J:], Zacc[:, :J], Zacc[:, J:]
