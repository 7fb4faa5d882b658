# -*- coding: utf-8 -*-
"""The PyTorch reference: identities of SPEC section 1, descent, continuation, varlen, the same-step
ablation, gradcheck and input validation."""

import pytest
import torch

from fla_falcon.ops import FalconState, naive_recurrent_falcon
from fla_falcon.ops.falcon.naive import falcon_step, naive_chunk_falcon
from fla_falcon.ops.falcon.utils import RULES, rule_info

WINDOWED = [(r, w) for r in RULES for w in ((1, 2, 4) if rule_info(r)[2] else (1,))]


def make_inputs(rule, B=2, T=9, H=2, G=2, K=5, V=3, lam=True, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    HV = H * G
    per_column = rule_info(rule)[1]
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype) / K ** 0.5
    v = torch.randn(B, T, HV, V, generator=g, dtype=dtype)
    beta = 0.1 + 1.8 * torch.rand(B, T, HV, *([V] if per_column else []), generator=g, dtype=dtype)
    lam_t = 0.5 * torch.rand(B, T, HV, generator=g, dtype=dtype) if lam else None
    ts = [q, k, v, beta] + ([lam_t] if lam else [None])
    if requires_grad:
        for t in ts:
            if t is not None:
                t.requires_grad_(True)
    return ts


def random_state(N, H, HV, K, V, window, count, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    s = FalconState.zeros(N, H, HV, K, V, window, dtype=dtype)
    count = torch.as_tensor(count, dtype=torch.int32).expand(N).clamp(max=window).clone()
    tail_x = torch.randn(s.tail_x.shape, generator=g, dtype=dtype) / K ** 0.5
    tail_v = torch.randn(s.tail_v.shape, generator=g, dtype=dtype)
    # zero the rows before the real pairs (shift=True: count - 1 real pairs)
    for n in range(N):
        real = max(int(count[n]) - 1, 0)
        tail_x[n, :, :window - 1 - real] = 0
        tail_v[n, :, :window - 1 - real] = 0
    return FalconState(
        S=0.3 * torch.randn(s.S.shape, generator=g, dtype=dtype),
        last_k=torch.randn(s.last_k.shape, generator=g, dtype=dtype) / K ** 0.5 * (count > 0)[:, None, None],
        tail_x=tail_x, tail_v=tail_v, count=count)


def assert_state_close(a, b, atol=1e-10):
    for name, x, y in zip(FalconState._fields, a, b):
        assert x.shape == y.shape, name
        torch.testing.assert_close(x.to(y.dtype), y, atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize('lam', [True, False])
@pytest.mark.parametrize('pair', [('falcon3', 'falcon1'), ('falcon3a', 'falcon1a')])
def test_window_one_reduces_to_rule_one(pair, lam):
    win_rule, base_rule = pair
    q, k, v, beta, lam_t = make_inputs(base_rule, lam=lam)
    o3, s3 = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=win_rule, window=1, output_final_state=True)
    o1, s1 = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=base_rule, output_final_state=True)
    torch.testing.assert_close(o3, o1, atol=1e-12, rtol=1e-12)
    assert_state_close(s3, s1, atol=1e-12)


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('pair', [('falcon2', 'falcon1'), ('falcon2a', 'falcon1a')])
def test_equal_column_gains_reduce_rule_two_to_rule_one(pair, shift):
    col_rule, base_rule = pair
    q, k, v, beta, lam_t = make_inputs(base_rule)
    beta_cols = beta[..., None].expand(*beta.shape, v.shape[-1])
    o2 = naive_recurrent_falcon(q, k, v, beta_cols, lam_t, rule=col_rule, shift=shift)[0]
    o1 = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=base_rule, shift=shift)[0]
    torch.testing.assert_close(o2, o1, atol=1e-12, rtol=1e-12)


def test_distinct_column_gains_differ():
    # the identity above must not hold trivially
    q, k, v, beta, lam_t = make_inputs('falcon2')
    o2 = naive_recurrent_falcon(q, k, v, beta, lam_t, rule='falcon2')[0]
    o1 = naive_recurrent_falcon(q, k, v, beta.mean(-1), lam_t, rule='falcon1')[0]
    assert (o2 - o1).abs().max() > 1e-3


def objective(rule, S, X, Y, lam):
    """The instantaneous objective that a step of `rule` descends, averaged over the window."""
    reg = 0.5 * lam * (S * S).sum((-1, -2))
    if rule_info(rule)[0]:
        return 0.5 * ((Y - X @ S) ** 2).sum(-1).mean(-1) + reg
    return -((X @ S) * Y).sum(-1).mean(-1) + reg


@pytest.mark.parametrize('rule', list(RULES))
def test_unclamped_step_descends(rule):
    g = torch.Generator().manual_seed(3)
    regression, per_column, windowed = rule_info(rule)
    n, K, V = 4000, 6, 4
    Bt = 3 if windowed else 1
    S = torch.randn(n, K, V, generator=g, dtype=torch.float64)
    X = (torch.randn(n, Bt, K, generator=g, dtype=torch.float64)
         * torch.rand(n, 1, 1, generator=g, dtype=torch.float64) * 3)
    Y = torch.randn(n, Bt, V, generator=g, dtype=torch.float64)
    beta = 1.999 * torch.rand(n, *([V] if per_column else []), generator=g, dtype=torch.float64)
    # the a-rules need lam > 0 (a linear objective is unbounded below)
    lam = torch.rand(n, generator=g, dtype=torch.float64) * 2 + (0 if regression else 1e-3)
    S_new = falcon_step(S, X, Y, beta, lam, rule=rule, eps=1e-6, eps_gamma=1e-4, lam_coupled=False)
    E = torch.linalg.eigvalsh(X @ X.transpose(-1, -2))[..., -1] / Bt if rule == 'falcon3' else (X * X).sum(-1).mean(-1)
    eta_max = (beta if not per_column else beta.amax(-1)) / (E + lam + 1e-6)
    unclamped = eta_max * lam < 1 - 1e-4
    assert unclamped.float().mean() > 0.5
    if per_column:
        # the objective is separable over columns: each column descends with its own gain
        before = objective(rule, S, X, Y, lam)
        after = objective(rule, S_new, X, Y, lam)
    else:
        before, after = objective(rule, S, X, Y, lam), objective(rule, S_new, X, Y, lam)
    assert (after[unclamped] <= before[unclamped] + 1e-9 * before[unclamped].abs().clamp(min=1)).all()
    # and the descent is strict for a real step (not a no-op)
    assert (after[unclamped] < before[unclamped] - 1e-9).float().mean() > 0.9


@pytest.mark.parametrize('rule', ['falcon1', 'falcon3', 'falcon1a', 'falcon3a'])
def test_sequence_steps_descend(rule):
    """Through the op: S_t has no larger objective at pair t than S_{t-1} (unclamped steps)."""
    window = 2 if rule_info(rule)[2] else 1
    q, k, v, beta, lam_t = make_inputs(rule, B=1, T=8, H=1, G=1, seed=5)
    lam_t = lam_t * 0.2 + (0 if rule_info(rule)[0] else 1e-3)
    states = [FalconState.zeros(1, 1, 1, 5, 3, window, dtype=torch.float64)]
    for t in range(1, 9):
        states.append(naive_recurrent_falcon(q[:, :t], k[:, :t], v[:, :t], beta[:, :t], lam_t[:, :t], rule=rule,
                                             window=window, output_final_state=True)[1])
    for t in range(2, 9):  # 1-based step t writes the pairs (k_{j-1}, v_j) of its window
        js = range(max(2, t - window + 1), t + 1)
        X = torch.stack([k[0, j - 2, 0] for j in js])
        Y = torch.stack([v[0, j - 1, 0] for j in js])
        lam = lam_t[0, t - 1, 0]
        before = objective(rule, states[t - 1].S[0, 0], X, Y, lam)
        after = objective(rule, states[t].S[0, 0], X, Y, lam)
        assert after <= before + 1e-12, (t, float(before), float(after))


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('rule,window', WINDOWED)
def test_segment_continuation(rule, window, shift):
    q, k, v, beta, lam_t = make_inputs(rule, T=10)
    kw = dict(rule=rule, window=window, shift=shift, lam_coupled=True)
    o, s = naive_recurrent_falcon(q, k, v, beta, lam_t, output_final_state=True, **kw)
    for split in (0, 1, 2, 3, 7, 10):
        o1, s1 = naive_recurrent_falcon(*(t[:, :split] for t in (q, k, v, beta, lam_t)), output_final_state=True, **kw)
        o2, s2 = naive_recurrent_falcon(*(t[:, split:] for t in (q, k, v, beta, lam_t)), initial_state=s1,
                                        output_final_state=True, **kw)
        torch.testing.assert_close(torch.cat([o1, o2], 1), o, atol=1e-12, rtol=1e-12)
        assert_state_close(s2, s)
    # three segments
    a, b = 4, 5
    o1, s1 = naive_recurrent_falcon(*(t[:, :a] for t in (q, k, v, beta, lam_t)), output_final_state=True, **kw)
    o2, s2 = naive_recurrent_falcon(*(t[:, a:b] for t in (q, k, v, beta, lam_t)), initial_state=s1,
                                    output_final_state=True, **kw)
    o3, s3 = naive_recurrent_falcon(*(t[:, b:] for t in (q, k, v, beta, lam_t)), initial_state=s2,
                                    output_final_state=True, **kw)
    torch.testing.assert_close(torch.cat([o1, o2, o3], 1), o, atol=1e-12, rtol=1e-12)
    assert_state_close(s3, s)


@pytest.mark.parametrize('rule,window', WINDOWED)
def test_state_count_and_tail(rule, window):
    q, k, v, beta, lam_t = make_inputs(rule, B=1, T=3, H=1, G=1)
    s = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=rule, window=window, output_final_state=True)[1]
    assert int(s.count) == min(3, window)
    torch.testing.assert_close(s.last_k[0], k[0, -1])
    pairs = min(2, window - 1)  # 2 real pairs after 3 tokens with the shift
    if pairs:
        torch.testing.assert_close(s.tail_x[0, 0, window - 1 - pairs:], k[0, 3 - 1 - pairs:2, 0])
        torch.testing.assert_close(s.tail_v[0, 0, window - 1 - pairs:], v[0, 3 - pairs:, 0])
        assert (s.tail_x[0, 0, :window - 1 - pairs] == 0).all()


@pytest.mark.parametrize('rule,window', [('falcon1', 1), ('falcon2', 1), ('falcon3', 4), ('falcon3a', 2),
                                         ('falcon2a', 1)])
def test_varlen_equals_separate_sequences(rule, window):
    lens = [3, 1, 6, 0, 5]
    T = sum(lens)
    q, k, v, beta, lam_t = make_inputs(rule, B=1, T=T, seed=7)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    N = len(lens)
    # some sequences continue from a state, others start fresh
    h0 = random_state(N, 2, 4, 5, 3, window, count=[0, 2, window, 1, 3])
    kw = dict(rule=rule, window=window)
    o, s = naive_recurrent_falcon(q, k, v, beta, lam_t, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    for n in range(N):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        on, sn = naive_recurrent_falcon(*(t[:, sl] for t in (q, k, v, beta, lam_t)), initial_state=h0.index([n]),
                                        output_final_state=True, **kw)
        torch.testing.assert_close(o[:, sl], on, atol=1e-12, rtol=1e-12)
        assert_state_close(s.index([n]), sn)
    # and without initial states every sequence restarts fresh
    o_fresh = naive_recurrent_falcon(q, k, v, beta, lam_t, cu_seqlens=cu, **kw)[0]
    for n in range(N):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        on = naive_recurrent_falcon(*(t[:, sl] for t in (q, k, v, beta, lam_t)), **kw)[0]
        torch.testing.assert_close(o_fresh[:, sl], on, atol=1e-12, rtol=1e-12)


def same_step_recurrence(rule, window, q, k, v, beta, lam, scale, eps=1e-6, eps_gamma=1e-4):
    """An independent, loop-by-loop same-step recurrence (DeltaNet-style pairs (k_t, v_t)),
    one head at a time, written without the reference's helpers."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    G = HV // H
    o = torch.zeros(B, T, HV, V, dtype=q.dtype)
    for b in range(B):
        for hv in range(HV):
            h = hv // G
            S = torch.zeros(K, V, dtype=q.dtype)
            for t in range(T):
                lo = max(0, t - window + 1) if rule in ('falcon3', 'falcon3a') else t
                X, Y = k[b, lo:t + 1, h], v[b, lo:t + 1, hv]
                n = t + 1 - lo
                lam_t = lam[b, t, hv]
                if rule == 'falcon3':
                    E = max(torch.linalg.eigvalsh(X @ X.T).tolist()) / n
                elif rule == 'falcon3a':
                    E = float((X * X).sum()) / n
                else:
                    E = float(X[0] @ X[0])
                eta = beta[b, t, hv] / (E + lam_t + eps)
                gamma = 1 - torch.clamp(eta * lam_t, max=1 - eps_gamma)
                if rule in ('falcon1', 'falcon2'):
                    S = gamma * S + torch.outer(X[0], eta * (Y[0] - S.T @ X[0]))
                elif rule in ('falcon1a', 'falcon2a'):
                    S = gamma * S + torch.outer(X[0], eta * Y[0])
                elif rule == 'falcon3':
                    S = gamma * S + eta / n * sum(torch.outer(X[i], Y[i] - S.T @ X[i]) for i in range(n))
                else:
                    S = gamma * S + eta / n * sum(torch.outer(X[i], Y[i]) for i in range(n))
                o[b, t, hv] = scale * S.T @ q[b, t, h]
    return o


@pytest.mark.parametrize('rule,window', WINDOWED)
def test_shift_false_is_the_same_step_recurrence(rule, window):
    q, k, v, beta, lam_t = make_inputs(rule, B=1, T=7, H=2, G=2, K=4, V=3)
    o = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=rule, window=window, shift=False, scale=0.7)[0]
    ref = same_step_recurrence(rule, window, q, k, v, beta, lam_t, 0.7)
    torch.testing.assert_close(o, ref, atol=1e-12, rtol=1e-12)
    # the shift changes the result
    o_shift = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=rule, window=window, scale=0.7)[0]
    assert (o_shift - o).abs().max() > 1e-3


def test_shift_is_same_step_on_shifted_keys_without_ridge():
    # with lam = 0 a zero key writes nothing and does not decay, so the shifted op equals the
    # same-step op on keys delayed by one with a zero first key
    q, k, v, beta, _ = make_inputs('falcon1')
    k_delayed = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], 1)
    o_shift = naive_recurrent_falcon(q, k, v, beta, rule='falcon1')[0]
    o_same = naive_recurrent_falcon(q, k_delayed, v, beta, rule='falcon1', shift=False)[0]
    torch.testing.assert_close(o_shift, o_same, atol=1e-12, rtol=1e-12)


def test_first_step_has_no_write_and_no_decay():
    q, k, v, beta, lam_t = make_inputs('falcon1', T=1)
    h0 = random_state(2, 2, 4, 5, 3, 1, count=0)
    o, s = naive_recurrent_falcon(q, k, v, beta, lam_t * 100, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(s.S, h0.S)   # count = 0: no pair at t = 1
    h0c = h0._replace(count=torch.ones(2, dtype=torch.int32))
    s_c = naive_recurrent_falcon(q, k, v, beta, lam_t * 100, initial_state=h0c, output_final_state=True)[1]
    assert (s_c.S - h0.S).abs().max() > 1e-3  # count = 1: last_k pairs with v_1


@pytest.mark.parametrize('rule,window', [('falcon1', 1), ('falcon2', 1), ('falcon3', 2), ('falcon3', 4),
                                         ('falcon1a', 1), ('falcon2a', 1), ('falcon3a', 2)])
@pytest.mark.parametrize('lam_coupled', [False, True])
def test_gradcheck(rule, window, lam_coupled):
    q, k, v, beta, lam_t = make_inputs(rule, B=1, T=5, H=1, G=2, K=3, V=2, requires_grad=True, seed=11)
    h0 = random_state(1, 1, 2, 3, 2, window, count=window)
    h0_leaves = [t.clone().requires_grad_(True) for t in h0[:4]]

    S0, last_k, tail_x, tail_v = h0_leaves

    def f(q, v, beta, lam_t, S0, k=k, last_k=last_k, tail_x=tail_x, tail_v=tail_v):
        state = FalconState(S0, last_k, tail_x, tail_v, h0.count)
        o, s = naive_recurrent_falcon(q, k, v, beta, lam_t, rule=rule, window=window, lam_coupled=lam_coupled,
                                      initial_state=state, output_final_state=True)
        return o, s.S, s.last_k, s.tail_x, s.tail_v

    assert torch.autograd.gradcheck(f, (q, v, beta, lam_t, S0, k, last_k, tail_x, tail_v) if not lam_coupled else
                                    (q, v, beta, lam_t, S0), eps=1e-6, atol=1e-6)
    if lam_coupled:
        # the ridge's E factor is a statistic (no gradient): the key gradient is the one of the
        # uncoupled op with lam * E fed in as a constant
        g_coupled = torch.autograd.grad(f(q, v, beta, lam_t, S0)[0].sum(), k)[0]
        state = FalconState(S0, last_k, tail_x, tail_v, h0.count)
        with torch.no_grad():
            E = _energies(rule, window, k, state)
        o = naive_recurrent_falcon(q, k, v, beta, lam_t * E, rule=rule, window=window, initial_state=state)[0]
        torch.testing.assert_close(g_coupled, torch.autograd.grad(o.sum(), k)[0])


def _energies(rule, window, k, state):
    """E_t of every step (B = 1, H = 1) for a continued sequence, from the keys and the carried tail."""
    T = k.shape[1]
    xs = (list(state.tail_x[0, 0, window - 1 - max(int(state.count[0]) - 1, 0):]) + [state.last_k[0, 0]]
          + list(k[0, :-1, 0]))
    n_before = len(xs) - T
    E = []
    for t in range(T):
        X = torch.stack(xs[max(0, n_before + t - window + 1):n_before + t + 1])
        E.append(torch.linalg.eigvalsh(X @ X.T)[-1] / len(X) if rule == 'falcon3' else (X * X).sum(-1).mean())
    return torch.stack(E)[None, :, None].expand(1, T, 2)


def test_clamp_and_extremes_are_finite():
    q, k, v, beta, lam_t = make_inputs('falcon2', T=12)
    k = k.clone()
    k[:, 3:6] = 0  # zero keys: E = 0
    beta = torch.full_like(beta, 1.999)
    for rule, b in (('falcon2', beta), ('falcon1', beta[..., 0]), ('falcon3', beta[..., 0]),
                    ('falcon3a', beta[..., 0])):
        window = 4 if rule in ('falcon3', 'falcon3a') else 1
        o, s = naive_recurrent_falcon(q, k, v, b, lam_t * 1e6 + 1e3, rule=rule, window=window, eps=0.0,
                                      output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(s.S).all()
    # eps = 0, lam = 0 and x = 0: eta := 0, no update
    o, s = naive_recurrent_falcon(q, torch.zeros_like(k), v, beta[..., 0], None, rule='falcon1', eps=0.0,
                                  output_final_state=True)
    assert (s.S == 0).all() and (o == 0).all()


def test_clamp_keeps_decay_positive():
    q, k, v, beta, lam_t = make_inputs('falcon1a', B=1, T=3, H=1, G=1)
    h0 = random_state(1, 1, 1, 5, 3, 1, count=1)
    s = naive_recurrent_falcon(q[:, :1], k[:, :1], v[:, :1], torch.full_like(beta[:, :1], 1.9),
                               torch.full_like(lam_t[:, :1], 1e8), rule='falcon1a', initial_state=h0,
                               output_final_state=True, eps_gamma=0.01)[1]
    x, y = h0.last_k[0, 0], v[0, 0, 0]
    eta = 1.9 / (x @ x + 1e8 + 1e-6)
    torch.testing.assert_close(s.S[0, 0], 0.01 * h0.S[0, 0] + eta * torch.outer(x, y))


def test_fp32_inputs_and_bf16_output_dtype():
    q, k, v, beta, lam_t = make_inputs('falcon1', dtype=torch.float32)
    o64 = naive_recurrent_falcon(*(t.double() for t in (q, k, v, beta, lam_t)))[0]
    o32, s = naive_recurrent_falcon(q, k, v, beta, lam_t, output_final_state=True)
    assert o32.dtype == torch.float32 and s.S.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, atol=1e-5, rtol=1e-5)
    ob, sb = naive_recurrent_falcon(*(t.bfloat16() for t in (q, k, v, beta, lam_t)), output_final_state=True)
    assert ob.dtype == torch.bfloat16 and sb.S.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# input validation: every bad argument gets a ValueError/TypeError that names it

def _call(rule='falcon1', **over):
    q, k, v, beta, lam_t = make_inputs(rule if rule in RULES else 'falcon1', B=1, T=4)
    args = dict(q=q, k=k, v=v, beta=beta, lam=lam_t)
    kw = {key: over.pop(key) for key in list(over) if key not in args}
    args.update(over)
    return naive_recurrent_falcon(args['q'], args['k'], args['v'], args['beta'], args['lam'], rule=rule, **kw)


@pytest.mark.parametrize('over,err,word', [
    (dict(q=torch.randn(4, 2, 5, dtype=torch.float64)), ValueError, 'q'),
    (dict(k=torch.randn(1, 4, 2, 6, dtype=torch.float64)), ValueError, 'k'),
    (dict(v=torch.randn(1, 5, 4, 3, dtype=torch.float64)), ValueError, 'v'),
    (dict(v=torch.randn(1, 4, 3, 3, dtype=torch.float64)), ValueError, 'heads'),
    (dict(beta=torch.rand(1, 4, 4, 3, dtype=torch.float64)), ValueError, 'beta'),
    (dict(beta=torch.rand(1, 4, 2, dtype=torch.float64)), ValueError, 'beta'),
    (dict(lam=torch.rand(1, 4, 2, dtype=torch.float64)), ValueError, 'lam'),
    (dict(q=[[1.0]]), TypeError, 'q'),
    (dict(beta=torch.ones(1, 4, 4, dtype=torch.long)), TypeError, 'beta'),
    (dict(window=0, rule='falcon3'), ValueError, 'window'),
    (dict(window=2), ValueError, 'window'),
    (dict(window=2.0, rule='falcon3'), TypeError, 'window'),
    (dict(rule='falcon4'), ValueError, 'rule'),
    (dict(eps=-1.0), ValueError, 'eps'),
    (dict(eps_gamma=1.0), ValueError, 'eps_gamma'),
    (dict(scale='big'), TypeError, 'scale'),
    (dict(lam=None, lam_coupled=True), ValueError, 'lam'),
    (dict(shift=1), TypeError, 'shift'),
    (dict(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, 'cu_seqlens'),
    (dict(cu_seqlens=torch.tensor([1, 4])), ValueError, 'cu_seqlens'),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), ValueError, 'cu_seqlens'),
    (dict(cu_seqlens=torch.tensor([[0, 4]])), ValueError, 'cu_seqlens'),
    (dict(cu_seqlens=[0, 4]), TypeError, 'cu_seqlens'),
    (dict(initial_state=torch.zeros(1, 4, 5, 3)), TypeError, 'initial_state'),
    (dict(initial_state=FalconState.zeros(2, 2, 4, 5, 3, dtype=torch.float64)), ValueError, 'initial_state.S'),
    (dict(initial_state=FalconState.zeros(1, 2, 4, 5, 3, window=3, dtype=torch.float64)), ValueError,
     'initial_state.tail_x'),
])
def test_bad_input_names_the_argument(over, err, word):
    rule = over.pop('rule', 'falcon1')
    with pytest.raises(err, match=word):
        _call(rule, **over)


def test_varlen_needs_batch_one():
    q, k, v, beta, lam_t = make_inputs('falcon1', B=2, T=4)
    with pytest.raises(ValueError, match='cu_seqlens'):
        naive_recurrent_falcon(q, k, v, beta, lam_t, cu_seqlens=torch.tensor([0, 4]))


def test_last_k_is_the_last_key_seen_without_shift_too():
    q, k, v, beta, lam_t = make_inputs('falcon1', T=4)
    s = naive_recurrent_falcon(q, k, v, beta, lam_t, shift=False, output_final_state=True)[1]
    torch.testing.assert_close(s.last_k, k[:, -1])
    assert s.count.tolist() == [1, 1]


def test_count_outside_the_window_is_read_clamped():
    q, k, v, beta, lam_t = make_inputs('falcon3', T=4)
    h0 = random_state(2, 2, 4, 5, 3, 2, count=2)
    o = naive_recurrent_falcon(q, k, v, beta, lam_t, rule='falcon3', window=2, initial_state=h0)[0]
    o_big = naive_recurrent_falcon(q, k, v, beta, lam_t, rule='falcon3', window=2,
                                   initial_state=h0._replace(count=torch.full((2,), 7, dtype=torch.int32)))[0]
    torch.testing.assert_close(o, o_big)


# ------------------------------------------------------------------- the chunk form (naive_chunk_falcon)

# the step-row form (one unknown per step) and the coefficient form (values per step and per pair only) exist for
# falcon1 and falcon3, with windows up to 8
STEP_ROWS = [('falcon1', 1, u) for u in ('steps', 'coefficients')] + [
    ('falcon3', w, u) for w in (2, 3, 4, 8) for u in ('steps', 'coefficients')]


@pytest.mark.parametrize('chunk_size', [1, 4, 16])
@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('rule, window, unknowns', [(r, w, 'pairs') for r, w in WINDOWED] + STEP_ROWS)
def test_chunk_form_equals_recurrence(rule, window, unknowns, shift, chunk_size):
    # the exact C-step transition (a triangular solve over the chunk's window pairs, or over its steps) against
    # the token loop: outputs, the whole continuation state and every gradient, with a carried state (count < W
    # and = W) and the coupled ridge, for lengths that do not fill the last chunk
    T = 11
    q, k, v, beta, lam = make_inputs(rule, T=T, seed=3)
    state = random_state(2, 2, 4, 5, 3, window, [1, window], seed=4)
    leaves = [q, k, v, beta, lam, state.S, state.last_k, state.tail_x, state.tail_v]
    results = []
    for chunked in (False, True):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        st = FalconState(*xs[5:], state.count)
        kw = dict(rule=rule, window=window, shift=shift, initial_state=st, output_final_state=True, lam_coupled=True)
        if chunked:
            o, fs = naive_chunk_falcon(*xs[:5], chunk_size=chunk_size, unknowns=unknowns, **kw)
        else:
            o, fs = naive_recurrent_falcon(*xs[:5], **kw)
        g = torch.Generator().manual_seed(5)
        loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in (o, *fs[:4]))
        grads = torch.autograd.grad(loss, xs, allow_unused=True)   # shift=False never reads last_k
        results.append([o, *fs[:4]] + [torch.zeros_like(x) if d is None else d for x, d in zip(xs, grads)])
        results[-1].append(fs.count)
    for a, b in zip(*results):
        assert torch.allclose(a.double(), b.double(), rtol=1e-10, atol=1e-12)


def test_chunk_form_varlen_and_bad_chunk_size():
    q, k, v, beta, lam = make_inputs('falcon3', B=1, T=13, seed=6)
    cu = torch.tensor([0, 4, 4, 13])
    state = random_state(3, 2, 4, 5, 3, 4, [0, 2, 4], seed=7)
    kw = dict(rule='falcon3', window=4, initial_state=state, output_final_state=True, cu_seqlens=cu)
    o1, f1 = naive_recurrent_falcon(q, k, v, beta, lam, **kw)
    o2, f2 = naive_chunk_falcon(q, k, v, beta, lam, chunk_size=3, **kw)
    for a, b in zip((o1, *f1), (o2, *f2)):
        assert torch.allclose(a.double(), b.double(), rtol=1e-10, atol=1e-12)
    for unknowns in ('steps', 'coefficients'):
        o3, f3 = naive_chunk_falcon(q, k, v, beta, lam, chunk_size=3, unknowns=unknowns, **kw)
        for a, b in zip((o1, *f1), (o3, *f3)):
            assert torch.allclose(a.double(), b.double(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match='chunk_size'):
        naive_chunk_falcon(*make_inputs('falcon1'), rule='falcon1', chunk_size=0)
    with pytest.raises(ValueError, match='unknowns'):
        naive_chunk_falcon(*make_inputs('falcon1'), rule='falcon1', unknowns='rows')
    for unknowns in ('steps', 'coefficients'):
        with pytest.raises(ValueError, match='falcon2'):
            naive_chunk_falcon(*make_inputs('falcon2'), rule='falcon2', unknowns=unknowns)
