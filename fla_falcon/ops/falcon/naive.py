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
"""

from __future__ import annotations

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
        o_n, final_n = _falcon_sequence(
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
