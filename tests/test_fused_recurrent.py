# -*- coding: utf-8 -*-
"""fused_recurrent_falcon (Triton forward and backward) against naive_recurrent_falcon.

The reference runs in fp64 (on the CPU copy of the inputs); the kernel in fp32 (and bf16 on the GPU).
Every output, every final-state field and every gradient (q, k, v, beta, lam and the initial
state's S, last_k, tail_x, tail_v, with a random cotangent on the final state as well) is compared
with fla's relative RMS error. Under the Triton interpreter (CPU) the shapes stay tiny and the long
sequences run on a cheap subset; the GPU runs the full grid.
"""

import pytest
import torch
from conftest import DEVICE

from fla_falcon.ops.falcon import fused_recurrent_falcon, naive_recurrent_falcon
from fla_falcon.ops.falcon.utils import FalconState, rule_info

ON_GPU = DEVICE == 'cuda'
RULES = ['falcon1', 'falcon2', 'falcon3', 'falcon1a', 'falcon2a', 'falcon3a']
GRAD_NAMES = ['dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0', 'dlast_k0', 'dtail_x0', 'dtail_v0']


def err_ratio(ref: torch.Tensor, tri: torch.Tensor) -> float:
    """fla's relative RMS error (fla.utils.testing.get_err_ratio)."""
    ref, tri = ref.detach().double().cpu(), tri.detach().double().cpu()
    err = (ref - tri).flatten().square().mean().sqrt().item()
    base = ref.flatten().square().mean().sqrt().item()
    return err / (base + 1e-8)


def check(name, ref, tri, ratio):
    assert ref.shape == tri.shape, f"{name}: shape {tuple(tri.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(tri).all(), f"{name}: non-finite values"
    abs_err = (ref.detach().double().cpu() - tri.detach().double().cpu()).abs().max().item() if ref.numel() else 0.
    if abs_err <= 1e-6:
        return
    r = err_ratio(ref, tri)
    assert r < ratio, f"{name}: relative error {r:.3e} >= {ratio} (max abs {abs_err:.3e})"


def make_state(N, H, HV, K, V, W, counts, shift, gen):
    """A random FalconState whose tail rows before the real pairs are zero (as the op makes them)."""
    S = torch.randn(N, HV, K, V, generator=gen) * 0.2
    last_k = torch.randn(N, H, K, generator=gen)
    tail_x = torch.randn(N, H, W - 1, K, generator=gen)
    tail_v = torch.randn(N, HV, W - 1, V, generator=gen)
    count = torch.tensor(counts, dtype=torch.int32)
    for n, c in enumerate(counts):
        n_tail = max(c - 1, 0) if shift else min(c, W - 1)
        tail_x[n, :, :W - 1 - n_tail] = 0
        tail_v[n, :, :W - 1 - n_tail] = 0
        if c == 0:
            S[n] = 0
            last_k[n] = 0
    return FalconState(S, last_k, tail_x, tail_v, count)


def make_inputs(rule, B, T, H, HV, K, V, *, W=1, lam='plain', counts=None, shift=True, seed=0,
                beta_range=(0.2, 1.8), lam_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    per_column = rule_info(rule)[1]
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    bshape = (B, T, HV, V) if per_column else (B, T, HV)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(bshape, generator=gen)
    lam_t = None if lam is None else torch.rand(B, T, HV, generator=gen) * lam_scale
    h0 = None
    if counts is not None:
        h0 = make_state(len(counts), H, HV, K, V, W, counts, shift, gen)
    return (q, k, v, beta, lam_t), h0


def run(fn, tensors, h0, *, dtype, device, kwargs, seed=1, grads=True):
    """Outputs, final state and gradients of ``fn`` for a fixed random cotangent."""
    xs = [None if t is None else t.detach().to(device=device, dtype=dtype).clone().requires_grad_(grads)
          for t in tensors]
    st = None
    if h0 is not None:
        st_t = [t.detach().to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32).clone()
                .requires_grad_(grads) for t in h0[:4]]
        st = FalconState(*st_t, h0.count.to(device))
    o, ht = fn(*xs, initial_state=st, output_final_state=True, **kwargs)
    outs = [o] + list(ht)
    if not grads:
        return outs, []
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen).to(device)).sum()
    for t in ht[:4]:
        loss = loss + (t.float() * torch.randn(t.shape, generator=gen).to(device)).sum()
    loss.backward()
    gs = [None if x is None else x.grad for x in xs]
    gs += [t.grad for t in st_t] if st is not None else [None] * 4
    return outs, gs


def compare(rule, tensors, h0, *, W=1, shift=True, lam_coupled=False, cu_seqlens=None, dtype=torch.float32,
            ratio=1e-4, grads=True):
    kwargs = dict(rule=rule, window=W, shift=shift, lam_coupled=lam_coupled)
    ref_kwargs = dict(kwargs, cu_seqlens=cu_seqlens)
    tri_kwargs = dict(kwargs, cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(DEVICE))
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    if dtype != torch.float32:
        # the reference sees the same rounded inputs and computes in fp32
        tensors = [None if t is None else t.to(dtype) for t in tensors]
    ref_out, ref_g = run(naive_recurrent_falcon, tensors, h0, dtype=ref_dtype, device='cpu', kwargs=ref_kwargs,
                         grads=grads)
    tri_out, tri_g = run(fused_recurrent_falcon, tensors, h0, dtype=dtype, device=DEVICE, kwargs=tri_kwargs,
                         grads=grads)
    assert tri_out[0].dtype == dtype
    for name, a, b in zip(['o', 'S', 'last_k', 'tail_x', 'tail_v'], ref_out, tri_out):
        check(name, a, b, ratio)
    assert torch.equal(ref_out[5].cpu(), tri_out[5].cpu()), f"count {tri_out[5]} != {ref_out[5]}"
    for name, a, b in zip(GRAD_NAMES, ref_g, tri_g):
        if a is None or b is None:
            # the reference leaves unused inputs (e.g. the empty tail of window 1) without a gradient
            assert all(g is None or not g.any() for g in (a, b)), name
        else:
            check(name, a, b, ratio)


# --------------------------------------------------------------------------------------------------
# every rule, shift on/off, with lam, an initial state and the final-state cotangent
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('rule', RULES)
def test_rules(rule, shift):
    W = (4 if shift else 2) if rule_info(rule)[2] else 1
    counts = [W, 1] if shift else [W, 0]
    tensors, h0 = make_inputs(rule, 2, 6, 1, 2, 12, 10, W=W, counts=counts, shift=shift)
    compare(rule, tensors, h0, W=W, shift=shift)


@pytest.mark.parametrize('W', [1, 2, 4])
@pytest.mark.parametrize('rule', ['falcon3', 'falcon3a'])
def test_windows(rule, W):
    # count 2 < W: a partly filled tail; the fresh second sequence fills its window from scratch
    tensors, h0 = make_inputs(rule, 2, 6, 1, 1, 8, 8, W=W, counts=[min(2, W), 0], seed=W)
    compare(rule, tensors, h0, W=W)


def test_large_window():
    # windows > 4 take the tensor path of the eigen solver (3-4: scalar code, 2: closed form)
    tensors, h0 = make_inputs('falcon3', 1, 10, 1, 1, 8, 8, W=6, counts=[4], seed=6)
    compare('falcon3', tensors, h0, W=6)


@pytest.mark.parametrize('W', [2, 4, 6])
def test_tied_eigenvalues(W):
    """Orthogonal window keys of (nearly) equal norm: lambda_max of a (nearly) tied Gram is still exact."""
    (q, k, v, beta, lam), _ = make_inputs('falcon3', 1, 9, 1, 1, 8, 8, W=W, seed=37)
    basis = torch.eye(8)[torch.arange(9) % W] * (1 + 1e-4 * (torch.arange(9) % 2))[:, None]
    k = basis[None, :, None, :].contiguous()
    compare('falcon3', (q, k, v, beta, lam), None, W=W, grads=False)


@pytest.mark.parametrize('lam', [None, 'coupled'])
@pytest.mark.parametrize('rule', RULES)
def test_lam_modes(rule, lam):
    W = 3 if rule_info(rule)[2] else 1
    tensors, _ = make_inputs(rule, 1, 5, 1, 1, 8, 8, W=W, lam=lam, lam_scale=2.0, seed=3)
    compare(rule, tensors, None, W=W, lam_coupled=lam == 'coupled')


def test_window_identities():
    """falcon3 with window 1 is falcon1 and falcon3a with window 1 is falcon1a (kernel vs kernel)."""
    for r3, r1 in (('falcon3', 'falcon1'), ('falcon3a', 'falcon1a')):
        (q, k, v, beta, lam), _ = make_inputs(r3, 1, 5, 1, 1, 8, 8, seed=5)
        a, _ = fused_recurrent_falcon(*(t.to(DEVICE) for t in (q, k, v, beta, lam)), rule=r3, window=1)
        b, _ = fused_recurrent_falcon(*(t.to(DEVICE) for t in (q, k, v, beta, lam)), rule=r1)
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------------------------------
# lengths (several backward checkpoint chunks), varlen, continuation, grouped heads, head dims
# --------------------------------------------------------------------------------------------------

CPU_LENGTHS = [('falcon1', 1, 1), ('falcon1', 1, 2), ('falcon2a', 1, 63), ('falcon2', 1, 64), ('falcon1', 1, 65),
               ('falcon1a', 1, 200), ('falcon3', 2, 20), ('falcon3a', 4, 20), ('falcon3', 4, 17)]
GPU_LENGTHS = [(r, 4 if rule_info(r)[2] else 1, T) for r in RULES for T in (1, 2, 63, 64, 65, 200)]


@pytest.mark.parametrize('rule,W,T', GPU_LENGTHS if ON_GPU else CPU_LENGTHS)
def test_lengths(rule, W, T):
    tensors, h0 = make_inputs(rule, 1, T, 1, 1, 8, 8, W=W, counts=[W], seed=T)
    compare(rule, tensors, h0, W=W, ratio=2e-4)


@pytest.mark.parametrize('rule,W,shift', [('falcon3', 3, True), ('falcon2', 1, False), ('falcon3a', 4, False),
                                          ('falcon1a', 1, True)])
def test_varlen(rule, W, shift):
    # an empty sequence and one shorter than the window included; states of every fill level
    cu = torch.tensor([0, 3, 3, 9, 14], dtype=torch.long)
    counts = [W, 1, 0, min(2, W)]
    tensors, h0 = make_inputs(rule, 1, 14, 1, 2, 8, 6, W=W, counts=counts, shift=shift, seed=7)
    compare(rule, tensors, h0, W=W, shift=shift, cu_seqlens=cu)


@pytest.mark.parametrize('rule,W,shift,split', [('falcon3', 4, True, 1), ('falcon3a', 3, False, 2),
                                                ('falcon1', 1, True, 3), ('falcon2', 1, True, 4)])
def test_continuation(rule, W, shift, split):
    """A sequence processed in two segments gives the outputs, final state and gradients of the whole
    (the gradient crosses the split through the first segment's final state)."""
    (q, k, v, beta, lam), _ = make_inputs(rule, 2, 7, 1, 2, 8, 8, W=W, shift=shift, seed=11)
    kw = dict(rule=rule, window=W, shift=shift, output_final_state=True)

    def go(segments):
        args = [t.to(DEVICE).requires_grad_() for t in (q, k, v, beta, lam)]
        outs, st, a = [], None, 0
        for b in segments:
            o, st = fused_recurrent_falcon(*(t[:, a:b] for t in args), initial_state=st, **kw)
            outs.append(o)
            a = b
        o = torch.cat(outs, 1)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        ((o * w).sum() + st.S.square().sum() + st.tail_x.sum() + st.last_k.sum()).backward()
        return [o, *st] + [t.grad for t in args]

    whole, parts = go([7]), go([split, 7])
    names = ['o', *FalconState._fields, 'dq', 'dk', 'dv', 'dbeta', 'dlam']
    for name, a, b in zip(names, whole, parts):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_grouped_heads_and_head_dims():
    # HV = 2H and head dims that are no powers of two (multi-block V on the GPU)
    K, V = (48, 96) if ON_GPU else (6, 5)
    for rule in (['falcon3', 'falcon2'] if not ON_GPU else RULES):
        W = 2 if rule_info(rule)[2] else 1
        tensors, h0 = make_inputs(rule, 1, 4, 2, 4, K, V, W=W, counts=[W], seed=13)
        compare(rule, tensors, h0, W=W, ratio=2e-4)


@pytest.mark.parametrize('rule', ['falcon2', 'falcon3'])
def test_v_blocks(rule, monkeypatch):
    # several V blocks per head (the GPU's layout) also under the interpreter: the per-key-head
    # gradients are summed over the blocks and the value heads of a group
    from fla_falcon.ops.falcon import fused_recurrent as fr
    monkeypatch.setattr(fr, 'FWD_CONFIG', (4, 1))
    monkeypatch.setattr(fr, 'BWD_CONFIG', (4, 1))
    W = 3 if rule == 'falcon3' else 1
    tensors, h0 = make_inputs(rule, 1, 5, 1, 2, 6, 10, W=W, counts=[min(2, W)], seed=41)
    compare(rule, tensors, h0, W=W)


@pytest.mark.gpu
@pytest.mark.parametrize('K,V', [(96, 192), (192, 48), (256, 256)])
def test_large_head_dims_gpu(K, V):
    for rule in ('falcon1', 'falcon2', 'falcon3'):
        W = 4 if rule == 'falcon3' else 1
        tensors, h0 = make_inputs(rule, 1, 33, 1, 2, K, V, W=W, counts=[W], seed=17)
        compare(rule, tensors, h0, W=W, ratio=5e-4)


@pytest.mark.parametrize('inline', [True, False])
@pytest.mark.parametrize('W', [2, 3, 4, 5])
def test_falcon3_decode_step(W, inline, monkeypatch):
    """falcon3 decode steps (at most one token per sequence): small grids with windows 2-4 compute lambda_max
    inside the forward kernel, larger grids (forced here by the threshold) and window 5 in the energy kernel;
    full, partial and empty windows, dense and varlen (an empty sequence)."""
    from fla_falcon.ops.falcon import fused_recurrent as fr
    if not inline:
        monkeypatch.setattr(fr, 'INLINE_E_MAX_PROGRAMS', 0)
    tensors, h0 = make_inputs('falcon3', 3, 1, 1, 2, 8, 6, W=W, counts=[W, 2, 0], seed=23 + W)
    compare('falcon3', tensors, h0, W=W)
    with torch.no_grad():
        compare('falcon3', tensors, h0, W=W, grads=False)
    # varlen: the three tokens of three one-token sequences, a fourth sequence empty
    flat = [t.reshape(1, 3, *t.shape[2:]) for t in tensors]
    h0v = make_inputs('falcon3', 4, 1, 1, 2, 8, 6, W=W, counts=[W, 1, 0, W - 1], seed=31 + W)[1]
    compare('falcon3', flat, h0v, W=W, cu_seqlens=torch.tensor([0, 1, 2, 2, 3]))


def test_decode_step_no_grad():
    """T = 1 with a state under no_grad (the decoding path without autograd)."""
    for rule in ('falcon2a', 'falcon3'):
        W = 4 if rule == 'falcon3' else 1
        tensors, h0 = make_inputs(rule, 2, 1, 1, 2, 8, 8, W=W, counts=[W, 2 if W > 1 else 1], seed=19)
        with torch.no_grad():
            compare(rule, tensors, h0, W=W, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize('rule', RULES)
def test_decode_shape_gpu(rule):
    """The benchmark's decode step (T = 1, K = V = 128, a full window) in bf16 and fp32."""
    W = 4 if rule_info(rule)[2] else 1
    tensors, h0 = make_inputs(rule, 4, 1, 2, 2, 128, 128, W=W, counts=[W, W, 1, 0], seed=43)
    with torch.no_grad():
        compare(rule, tensors, h0, W=W, grads=False)
        compare(rule, tensors, h0, W=W, grads=False, dtype=torch.bfloat16, ratio=2e-2)


# --------------------------------------------------------------------------------------------------
# numerics: extreme gates, bf16, long context
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('rule', RULES)
def test_extreme_gates(rule):
    """beta near 2, a huge lam (the decay clamp active) and zero keys: finite and still exact."""
    W = 3 if rule_info(rule)[2] else 1
    (q, k, v, beta, lam), h0 = make_inputs(rule, 1, 8, 1, 1, 8, 8, W=W, beta_range=(1.98, 1.999), seed=23)
    lam = torch.where(torch.arange(8)[None, :, None] % 2 == 0, torch.full_like(lam, 1e4), lam)
    k[:, 2:5] = 0                     # x = 0 pairs (eta = 0 when eps = 0), and an all-zero window for W=3
    for eps in (1e-6, 0.0):
        for coupled in (False, True):
            kw = dict(rule=rule, window=W, shift=True, lam_coupled=coupled)
            ref_o, ref_g = run(naive_recurrent_falcon, (q, k, v, beta, lam), None, dtype=torch.float64,
                               device='cpu', kwargs=dict(kw, eps=eps))
            tri_o, tri_g = run(fused_recurrent_falcon, (q, k, v, beta, lam), None, dtype=torch.float32,
                               device=DEVICE, kwargs=dict(kw, eps=eps))
            for t in tri_o[:5] + [g for g in tri_g if g is not None]:
                assert torch.isfinite(t).all()
            check('o', ref_o[0], tri_o[0], 1e-3)
            check('S', ref_o[1], tri_o[1], 1e-3)
            for name, a, b in zip(GRAD_NAMES, ref_g, tri_g):
                if a is not None and torch.isfinite(a).all():
                    check(name, a, b, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('rule', RULES)
def test_low_precision_gpu(rule, dtype):
    W = 4 if rule_info(rule)[2] else 1
    tensors, h0 = make_inputs(rule, 2, 64, 2, 4, 64, 64, W=W, counts=[W, 0], seed=29)
    compare(rule, tensors, h0, W=W, dtype=dtype, ratio=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize('rule', RULES)
def test_long_context_gpu(rule):
    """T = 65536, K = V = 128, bf16, beta near 2 and a ridge that clamps the decay on most steps: nothing
    overflows in the forward or the backward (issue 3)."""
    from fla_falcon.ops.falcon.utils import DEFAULT_EPS, DEFAULT_EPS_GAMMA
    W = 4 if rule_info(rule)[2] else 1
    T, K = 65536, 128
    gen = torch.Generator(device='cuda').manual_seed(31)
    per_column = rule_info(rule)[1]
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, 2, K, device='cuda', generator=gen), dim=-1)
            .bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(1, T, 2, K, device='cuda', generator=gen).bfloat16().requires_grad_()
    bshape = (1, T, 2, K) if per_column else (1, T, 2)
    beta = (1.9 + 0.099 * torch.rand(bshape, device='cuda', generator=gen)).bfloat16().requires_grad_()
    lam = (0.1 + 3 * torch.rand(1, T, 2, device='cuda', generator=gen)).bfloat16().requires_grad_()
    # unit keys: every rule's energy is <= 1 (falcon3: lambda_max / B), so eta * lam >= beta * lam / (1 + lam + eps)
    b = beta.float().amin(-1) if per_column else beta.float()
    clamped = b * lam.float() / (1 + lam.float() + DEFAULT_EPS) > 1 - DEFAULT_EPS_GAMMA
    assert clamped.float().mean() > 0.5, "the test must exercise the clamp"
    o, st = fused_recurrent_falcon(q, k, v, beta, lam, rule=rule, window=W, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(st.S).all()
    (o.float().square().mean() + st.S.square().mean()).backward()
    for t in (q, k, v, beta, lam):
        assert torch.isfinite(t.grad).all()


def test_bad_inputs():
    q = torch.randn(1, 2, 1, 4, device=DEVICE)
    v = torch.randn(1, 2, 1, 4, device=DEVICE)
    beta = torch.rand(1, 2, 1, device=DEVICE)
    with pytest.raises(ValueError, match='rule'):
        fused_recurrent_falcon(q, q, v, beta, rule='falcon9')
    with pytest.raises(ValueError, match='beta'):
        fused_recurrent_falcon(q, q, v, beta, rule='falcon2')
    with pytest.raises(ValueError, match='window'):
        fused_recurrent_falcon(q, q, v, beta, rule='falcon1', window=2)


def test_key_head_dim_limit():
    q = torch.randn(1, 2, 1, 257)
    v = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match='K <= 256'):
        fused_recurrent_falcon(q, q, v, torch.rand(1, 2, 1))
