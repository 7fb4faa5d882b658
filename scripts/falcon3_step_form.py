# -*- coding: utf-8 -*-
r"""Design check for falcon3's next chunk form: every value-sized tensor per step or per pair, none per window slot.

The chunk kernels on main (``fla_falcon/ops/falcon/chunk_win.py``) write a chunk of ``C`` steps as ``C * W``
virtual rows (falcon1's WY form, one row per window slot). At window 4 that makes A, W, U, V', dU, dW, dx and the
per-row gradients four times falcon1's, and the chunk-start states of 16-step chunks four times as many: about
11 GB of memory traffic at (4, 4096, 16, 128, 128) bf16, against ~4 GB for fla's gated delta rule by the same count
(``docs/falcon3_step_form.md``): at fla's bytes per second that is 2.7x its time, so issue #5's 2.0x needs a form
that moves fewer bytes.

This script checks the form proposed there, on CPU in fp64, against the definition (a step loop). Per chunk of
``n`` steps with window ``W``, pairs ``j = -(W-1) .. n-1`` (``J = n + W - 1``; pair j is the newest pair of step j,
the first W - 1 are carried from before the chunk; a pair that does not exist is a zero row), decays ``g_t``,
coefficients ``c_t = eta_t / B_t`` and start state ``S0``:

* the unknowns are the newest pair's predictions ``f_t = S_{t-1}^T x_t`` (n of them). An older slot's prediction
  follows from the step before (``x_{t-a} = x_{(t-1)-(a-1)}``)::

      P_t(a) = gamma_{t-1} P_{t-1}(a-1) + sum_a' (x_{t-a} . x_{t-1-a'}) U_{t-1,a'},   U_{t,a} = c_t (y_{t-a} - P_t(a)),

  so every prediction and write is a linear combination of the sources ``sigma = [f; y; pi]`` with
  ``pi_j = S0^T x_j`` (the pairs' predictions at the chunk start). The coefficients (``W x (n + 2J)`` per step)
  come from a scan over the steps that touches no value column and no state: ``coefficients()`` below;
* ``f`` solves one unit lower-triangular ``n x n`` system (shared by all value columns, as falcon1's);
* then, with ``Pi = X S0`` (``J x V``)::

      o   = exp(G) * (Q S0) + Oy Y + Opi Pi          (n x V)
      S_n = exp(G_n) S0 + X^T (Zy Y + Zpi Pi)          (K x V)

  i.e. the chunk transition is ``exp(G_n) I + X^T Zpi X`` with a small ``J x J`` matrix (SPEC section 3's hint),
  and the state kernel is ``Pi = X S0; Z = z + Zpi Pi; S = exp(G_n) S0 + X^T Z`` on J = C + W - 1 rows, where the
  virtual-row kernels use C * W.

The backward (``chunk_bwd``: the value-sized contractions, then ``coefficients_blocked_bwd``, the coefficients'
adjoint written out as a kernel would run it) gives every input's gradient (keys, values, queries, start state,
decays, coefficients).

Run: ``python scripts/falcon3_step_form.py`` (a few seconds): prints the largest relative error of the form and of
its backward against the step loop and autograd through it (fp64; and the fp32 forward beside the virtual-row form's
fp32 error) and the size of the coefficients over a grid of windows, chunk lengths and gate strengths, and exits 1
if anything in fp64 is off by more than 1e-9.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from fla_falcon.ops.falcon.naive import _coef_subchunk as _subchunk
from fla_falcon.ops.falcon.naive import chunk_coefficients as coefficients_blocked


def make_chunk(n, W, K=16, V=8, beta_max=1.99, lam_scale=1.0, missing=0, seed=0, dtype=torch.float64):
    """A random chunk: pairs X [J, K], Y [J, V] (the first ``missing`` pairs absent, i.e. zero), scaled queries
    Q [n, K], start state S0 [K, V], and falcon3's gates for each step from its window: mu = lambda_max / B_t,
    eta = beta / (mu + lam + eps), c = eta / B_t, g = log(1 - min(eta lam, 1 - eps_gamma))."""
    gen = torch.Generator().manual_seed(seed)
    J = n + W - 1
    X = torch.randn(J, K, generator=gen, dtype=dtype) / K ** 0.5
    X *= torch.exp(torch.randn(J, 1, generator=gen, dtype=dtype))          # keys of varied norms
    Y = torch.randn(J, V, generator=gen, dtype=dtype)
    X[:missing] = 0
    Y[:missing] = 0
    Q = torch.randn(n, K, generator=gen, dtype=dtype) / K ** 0.5
    S0 = torch.randn(K, V, generator=gen, dtype=dtype)
    beta = beta_max * torch.rand(n, generator=gen, dtype=dtype)
    lam = lam_scale * torch.rand(n, generator=gen, dtype=dtype) * torch.exp(3 * torch.randn(n, generator=gen,
                                                                                          dtype=dtype))
    c = torch.zeros(n, dtype=dtype)
    g = torch.zeros(n, dtype=dtype)
    for t in range(n):
        Xw = X[t:t + W]                                   # pairs t - W + 1 .. t, i.e. rows t .. t + W - 1
        Bt = int((Xw.abs().sum(1) > 0).sum())
        if Bt == 0:
            continue
        mu = torch.linalg.eigvalsh(Xw @ Xw.T)[-1] / Bt
        eta = beta[t] / (mu + lam[t] + 1e-6)
        c[t] = eta / Bt
        g[t] = torch.log1p(-torch.clamp(eta * lam[t], max=1 - 1e-4))
    return X, Y, Q, S0, g, c


def step_loop(X, Y, Q, S0, g, c, W):
    """The definition: S_t = gamma_t S_{t-1} + c_t sum_a x_{t-a} (y_{t-a} - S_{t-1}^T x_{t-a})^T, o_t = S_t^T q_t."""
    n = Q.shape[0]
    S = S0.clone()
    o = []
    for t in range(n):
        Xw, Yw = X[t:t + W], Y[t:t + W]                   # row t + W - 1 - a is pair t - a
        S = g[t].exp() * S + c[t] * Xw.T @ (Yw - Xw @ S)
        o.append(Q[t] @ S)
    return torch.stack(o), S


def coefficients(X, Q, g, c, W):
    """The chunk's coefficients, from keys, queries and gates only (no values, no state).

    Returns (Fy, Fpi, Oy, Opi, Zy, Zpi): f = Fy Y + Fpi Pi, o = exp(G) Q S0 + Oy Y + Opi Pi,
    Z = Zy Y + Zpi Pi (S_n = exp(G_n) S0 + X^T Z), with Pi = X S0. Row index conventions: pair j is row
    jj = j + W - 1 of X / Y / Pi."""
    n = Q.shape[0]
    J = n + W - 1
    NS = n + 2 * J                                         # sources: f (n), y (J), pi (J)
    ef = lambda t: n * 0 + t                               # noqa: E731  (source index of f_t)
    ey = lambda jj: n + jj                                 # noqa: E731
    ep = lambda jj: n + J + jj                             # noqa: E731
    G = torch.cumsum(g, 0)
    Gp = G - g                                             # G_{t-1}, 0 at the chunk's first step
    eye = torch.eye(NS, dtype=X.dtype)
    Psi = torch.zeros(n, W, NS, dtype=X.dtype)             # U_{t,a} = Psi[t, a] . sigma
    Phi = torch.zeros(W, NS, dtype=X.dtype)                # P_t(a) = Phi[a] . sigma
    for t in range(n):
        new = torch.zeros(W, NS, dtype=X.dtype)
        new[0] = eye[ef(t)]
        for a in range(1, W):
            if t == 0:
                new[a] = eye[ep(W - 1 - a)]               # pair -a, predicted by S0
            else:
                # Mw[a, a'] = x_{t-a} . x_{t-1-a'}: rows t+W-1-a and t+W-2-a' of X
                mw = X[t + W - 1 - a] @ X[t + W - 2 - torch.arange(W)].T          # [W]
                new[a] = g[t - 1].exp() * Phi[a - 1] + mw @ Psi[t - 1]
        Phi = new
        for a in range(W):
            Psi[t, a] = c[t] * (eye[ey(t + W - 1 - a)] - Phi[a])
    # f_t = exp(G_{t-1}) pi_t + sum_{s < t, a} exp(G_{t-1} - G_s) (x_t . x_{s-a}) U_{s,a}
    rows = torch.arange(n)
    Ka = torch.stack([X[rows + W - 1] @ X[rows + W - 1 - a].T for a in range(W)], 0)             # [W, t, s]
    before = rows[:, None] > rows[None, :]
    D = torch.where(before, (Gp[:, None] - G[None, :]).clamp(max=0).exp(), torch.zeros(()))
    Cf = torch.einsum('ats,sak->tk', Ka * D, Psi)
    Cf[rows, ep(rows + W - 1)] += Gp.exp()
    Cff, Cfy, Cfp = Cf[:, :n], Cf[:, n:n + J], Cf[:, n + J:]
    inv = torch.linalg.solve_triangular(torch.eye(n, dtype=X.dtype) - Cff, torch.eye(n, dtype=X.dtype),
                                        upper=False, unitriangular=True)
    Fy, Fpi = inv @ Cfy, inv @ Cfp

    def fold(R):                                           # rows over sigma -> (over y, over pi), f substituted
        return R[:, n:n + J] + R[:, :n] @ Fy, R[:, n + J:] + R[:, :n] @ Fpi

    # o_t - exp(G_t) q_t S0 = sum_{s <= t, a} exp(G_t - G_s) (q_t . x_{s-a}) U_{s,a}
    Oa = torch.stack([Q @ X[rows + W - 1 - a].T for a in range(W)], 0)                           # [W, t, s]
    Do = torch.where(rows[:, None] >= rows[None, :], (G[:, None] - G[None, :]).clamp(max=0).exp(), torch.zeros(()))
    Oy, Opi = fold(torch.einsum('ats,sak->tk', Oa * Do, Psi))
    # S_n - exp(G_n) S0 = sum_{s, a} exp(G_n - G_s) x_{s-a} U_{s,a}^T: row jj = s - a + W - 1 of Z
    Z = torch.zeros(J, NS, dtype=X.dtype)
    for a in range(W):
        Z.index_add_(0, rows + W - 1 - a, (G[-1] - G).exp()[:, None] * Psi[:, a])
    Zy, Zpi = fold(Z)
    return Fy, Fpi, Oy, Opi, Zy, Zpi


def coefficients_blocked_bwd(X, Q, g, c, W, dOy, dOpi, dZy, dZpi, m=16):
    """The adjoint of ``coefficients_blocked``: (dX, dQ, dg, dc) from the gradients of (Oy, Opi, Zy, Zpi), written
    out as a kernel would do it (sub-chunks in reverse, each recomputed; the key gradients through the pair Gram
    gathered in dM, J x J, and applied once: dX += (dM + dM^T) X). No value column appears here either: the
    value-sized work of the backward is dOy = do Y^T, dOpi = do Pi^T, dZy = dZ Y^T, dZpi = dZ Pi^T (``chunk_bwd``)."""
    n, K = Q.shape
    J = n + W - 1
    G = torch.cumsum(g, 0)
    Gp = G - g
    M = X @ X.T
    subs, Zacc = [], torch.zeros(J, 2 * J, dtype=X.dtype)
    for tau in range(0, n, m):                     # the forward again (a kernel keeps Zacc per sub-chunk instead)
        sc = _subchunk(X, Q, G, Gp, c, M, Zacc, tau, n, W, m)
        subs.append(sc)
        Zacc = (sc['Gn'] - sc['Gs']).exp() * Zacc
        Zacc = Zacc.index_add(0, sc['pr'], (sc['Gn'] - G[sc['st']]).exp()[:, None] * sc['CU'])
    dZ = torch.cat([dZy, dZpi], 1)
    dO = torch.cat([dOy, dOpi], 1)
    dM = torch.zeros(J, J, dtype=X.dtype)
    dX = torch.zeros_like(X)
    dQ = torch.zeros_like(Q)
    dG = torch.zeros(n, dtype=X.dtype)             # w.r.t. G_t (cumulative), and G_{t-1} through dGp
    dGp = torch.zeros(n, dtype=X.dtype)
    dc = torch.zeros(n, dtype=X.dtype)
    for sc in reversed(subs):
        ts, st, pr, Zin, CU = sc['ts'], sc['st'], sc['pr'], sc['Zin'], sc['CU']
        dGs = torch.zeros((), dtype=X.dtype)
        # Zacc_out = exp(Gn - Gs) Zin + sum_r e_p(r) exp(Gn - G_t(r)) CU_r
        eZ = (sc['Gn'] - sc['Gs']).exp()
        wr = (sc['Gn'] - G[st]).exp()
        dCU = wr[:, None] * dZ[pr]
        carried = eZ * (dZ * Zin).sum()
        written = wr * (dZ[pr] * CU).sum(1)
        dG[ts[-1]] += carried + written.sum()
        dGs -= carried
        dG.index_add_(0, st, -written)
        dZin = eZ * dZ
        # O = e1 * (QX Zin) + (Do * QXp) CU
        dOt = dO[ts]
        part = sc['e1'] * (dOt * sc['T1']).sum(1)
        dG[ts] += part
        dGs -= part.sum()
        dT1 = sc['e1'][:, None] * dOt
        dZin += sc['QX'].T @ dT1
        dQX = dT1 @ Zin.T
        dQ[ts] += dQX @ X
        dX += dQX.T @ Q[ts]
        dCU += (sc['Do'] * sc['QXp']).T @ dOt
        dB = dOt @ CU.T
        dQXp = dB * sc['Do']
        dQ[ts] += dQXp @ X[pr]
        dX.index_add_(0, pr, dQXp.T @ Q[ts])
        dDo = dB * sc['QXp'] * sc['Do']            # Do = exp(G_t - G_t(r)) where t >= t(r)
        dG[ts] += dDo.sum(1)
        dG.index_add_(0, st, -dDo.sum(0))
        # CU = A R, A = (I + P)^-1
        A = sc['A']
        dR = A.T @ dCU
        dP = -A.T @ (dCU @ sc['R'].T) @ A.T
        # R = c Sy - f Pi, f = c exp(G_{t-1} - Gs)
        dfPi = -(dR * sc['Pi']).sum(1)
        dc.index_add_(0, st, (dR * sc['Sy']).sum(1) + dfPi * sc['ef'])
        dGp.index_add_(0, st, dfPi * sc['f'])
        dGs -= (dfPi * sc['f']).sum()
        dPi = -sc['f'][:, None] * dR
        # Pi = exp(Gs) Sp + M[pr] Zin
        dGs += sc['Gs'].exp() * (dPi * sc['Sp']).sum()
        dM.index_add_(0, pr, dPi @ Zin.T)
        dZin += M[pr].T @ dPi
        # P = c_r Dm * M[pr, pr], Dm = exp(G_{t(r)-1} - G_t(s)) where t(s) < t(r)
        dc.index_add_(0, st, (dP * sc['Dm'] * sc['Mpp']).sum(1))
        dM.index_put_((pr[:, None], pr[None, :]), c[st][:, None] * sc['Dm'] * dP, accumulate=True)
        dDm = c[st][:, None] * dP * sc['Mpp'] * sc['Dm']
        dGp.index_add_(0, st, dDm.sum(1))
        dG.index_add_(0, st, -dDm.sum(0))
        if ts[0] > 0:
            dG[ts[0] - 1] += dGs
        dZ = dZin
    dX += (dM + dM.T) @ X
    dG[:-1] += dGp[1:]                               # G_{t-1} = G[t - 1] (0 at the chunk's first step)
    dg = dG.flip(0).cumsum(0).flip(0)                # G = cumsum(g)
    return dX, dQ, dg, dc


def chunk_bwd(X, Y, Q, S0, g, c, W, do, dS, m=16):
    """The whole chunk's backward through the step form: the value-sized part (what the kernels would do on n and
    J rows), then the coefficients' adjoint. Returns (dX, dY, dQ, dS0, dg, dc)."""
    Oy, Opi, Zy, Zpi = coefficients_blocked(X, Q, g, c, W, m)
    G = torch.cumsum(g, 0)
    Pi = X @ S0
    Z = Zy @ Y + Zpi @ Pi
    dZ = X @ dS                                     # S_n = exp(G_n) S0 + X^T Z
    dPi = Opi.T @ do + Zpi.T @ dZ
    dY = Oy.T @ do + Zy.T @ dZ
    dS0 = Q.T @ (G.exp()[:, None] * do) + G[-1].exp() * dS + X.T @ dPi
    dX = Z @ dS.T + dPi @ S0.T
    dQ = (G.exp()[:, None] * do) @ S0.T
    dG = G.exp() * ((Q @ S0) * do).sum(1)
    dG[-1] += G[-1].exp() * (S0 * dS).sum()
    cX, cQ, cg, cc = coefficients_blocked_bwd(X, Q, g, c, W, do @ Y.T, do @ Pi.T, dZ @ Y.T, dZ @ Pi.T, m)
    return dX + cX, dY, dQ + cQ, dS0, dG.flip(0).cumsum(0).flip(0) + cg, cc


def step_form(X, Y, Q, S0, g, c, W):
    """The chunk through its coefficients: the value-sized work a kernel would do, on n and J rows only."""
    cf = coefficients(X, Q, g, c, W)
    return apply_coefficients(cf[2:], X, Y, Q, S0, g, c) + (cf,)


def apply_coefficients(coefs, X, Y, Q, S0, g, c):
    """o and S_n from (Oy, Opi, Zy, Zpi): the value-sized products, on n and J rows."""
    Oy, Opi, Zy, Zpi = coefs
    G = torch.cumsum(g, 0)
    Pi = X @ S0
    return G.exp()[:, None] * (Q @ S0) + Oy @ Y + Opi @ Pi, G[-1].exp() * S0 + X.T @ (Zy @ Y + Zpi @ Pi)


def virtual_rows(X, Y, Q, S0, g, c, W):
    """main's form (naive_chunk_falcon's 'pairs' unknowns): one unknown per window slot, C W rows."""
    n = Q.shape[0]
    st = torch.arange(n).repeat_interleave(W)
    slot = torch.arange(W).repeat(n)
    Xv, Yv = X[st + W - 1 - slot], Y[st + W - 1 - slot]
    G = torch.cumsum(g, 0)
    Gp = G - g
    cv = c[st]
    before = st[:, None] > st[None, :]
    D = torch.where(before, (Gp[st][:, None] - G[st][None, :]).clamp(max=0).exp(), torch.zeros(()))
    L = cv[:, None] * D * (Xv @ Xv.T)
    U = torch.linalg.solve_triangular(torch.eye(n * W, dtype=X.dtype) + L,
                                      cv[:, None] * (Yv - Gp[st].exp()[:, None] * (Xv @ S0)), upper=False,
                                      unitriangular=True)
    seen = torch.arange(n)[:, None] >= st[None, :]
    Do = torch.where(seen, (G[:, None] - G[st][None, :]).clamp(max=0).exp(), torch.zeros(()))
    o = G.exp()[:, None] * (Q @ S0) + ((Q @ Xv.T) * Do) @ U
    S = G[-1].exp() * S0 + Xv.T @ ((G[-1] - G[st]).exp()[:, None] * U)
    return o, S


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--windows', type=int, nargs='+', default=[1, 2, 3, 4, 8])
    ap.add_argument('--lengths', type=int, nargs='+', default=[1, 5, 16, 64])
    ap.add_argument('--seeds', type=int, default=3)
    ap.add_argument('--dims', type=int, nargs=2, default=[16, 8], metavar=('K', 'V'))
    args = ap.parse_args(argv)
    worst = 0.0
    print(f"{'W':>2} {'n':>3} {'beta':>5} {'lam':>6} {'miss':>4} | {'fp64 err':>9} | {'fp32 step':>9} "
          f"{'fp32 rows':>9} {'fp32 blk':>9} | {'max|coef|':>9}")
    for W, n, (beta_max, lam_scale), missing in itertools.product(
            args.windows, args.lengths, [(1.0, 1.0), (1.99, 1.0), (1.99, 1e3)], [0, 2]):
        if missing >= n + W - 1:
            continue
        e64 = e32 = r32 = b32 = coef = 0.0
        for seed in range(args.seeds):
            ch = make_chunk(n, W, *args.dims, beta_max=beta_max, lam_scale=lam_scale, missing=missing, seed=seed)
            o_ref, S_ref = step_loop(*ch, W)
            o, S, cf = step_form(*ch, W)
            e64 = max(e64, rel(o, o_ref), rel(S, S_ref))
            X, _, Q, _, g, c = ch
            for mine, blk in zip(cf[2:], coefficients_blocked(X, Q, g, c, W)):
                e64 = max(e64, rel(blk, mine))
            coef = max(coef, max(float(m.abs().max()) for m in cf))
            ch32 = [t.float() for t in ch]
            o32, S32, _ = step_form(*ch32, W)
            e32 = max(e32, rel(o32.double(), o_ref), rel(S32.double(), S_ref))
            ov, Sv = virtual_rows(*ch32, W)
            r32 = max(r32, rel(ov.double(), o_ref), rel(Sv.double(), S_ref))
            ob, Sb = apply_coefficients(coefficients_blocked(*(ch32[i] for i in (0, 2, 4, 5)), W), *ch32)
            b32 = max(b32, rel(ob.double(), o_ref), rel(Sb.double(), S_ref))
            # the backward: chunk_bwd against autograd through the step loop, every input
            leaves = [t.clone().requires_grad_(True) for t in ch]
            o_a, S_a = step_loop(*leaves, W)
            gen = torch.Generator().manual_seed(seed)
            do = torch.randn(o_a.shape, generator=gen, dtype=o_a.dtype)
            dS = torch.randn(S_a.shape, generator=gen, dtype=S_a.dtype)
            ref = torch.autograd.grad((o_a * do).sum() + (S_a * dS).sum(), leaves)
            e64 = max(e64, *(rel(a, b) for a, b in zip(chunk_bwd(*ch, W, do, dS), ref)))
        worst = max(worst, e64)
        print(f"{W:>2} {n:>3} {beta_max:>5} {lam_scale:>6g} {missing:>4} | {e64:9.1e} | "
              f"{e32:9.1e} {r32:9.1e} {b32:9.1e} | {coef:9.2e}")
    print(f"largest fp64 error of the step form and its backward: {worst:.1e}")
    return 0 if worst < 1e-9 else 1


if __name__ == '__main__':
    sys.exit(main())
