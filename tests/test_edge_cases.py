# -*- coding: utf-8 -*-
"""Edge cases of the Falcon ops (fused_recurrent_falcon, chunk_falcon) and of the FalconNet layer.

Every kernel result is compared with naive_recurrent_falcon in fp64 (outputs, final state and the
gradients of every input that requires one): non-contiguous views, fp16/bf16/fp64 inputs, empty
segments and empty packed sequences, grouped value heads and odd or maximal head sizes, explicit
scales, states in other dtypes, partial `requires_grad`, `no_grad`, double backward passes; then
the layer's mask/cache/`output_attentions` handling. Shapes are tiny (interpreter on the CPU).
"""

import warnings

import pytest
import torch
from conftest import DEVICE
from fla.models.utils import Cache

from fla_falcon.layers import FalconNet
from fla_falcon.ops.falcon import fused_recurrent_falcon, naive_recurrent_falcon
from fla_falcon.ops.falcon.chunk import SUPPORTED_RULES, chunk_falcon
from fla_falcon.ops.falcon.utils import FalconState, rule_info

ON_GPU = DEVICE == 'cuda'
# fp32 on the GPU may use TF32 dots in the chunk kernels
RATIO = {torch.float32: 5e-3 if ON_GPU else 1e-4, torch.float64: 5e-3 if ON_GPU else 1e-4,
         torch.float16: 5e-3, torch.bfloat16: 3e-2}
# the same computation along two paths (packed/unpadded, cached/full, repeated): rounding only (TF32,
# the order of fp32 atomics on the GPU)
SAME = dict(rtol=2e-3, atol=2e-3) if ON_GPU else dict(rtol=1e-5, atol=1e-6)


def chunk16(*args, **kwargs):
    return chunk_falcon(*args, chunk_size=16, **kwargs)


KERNELS = {'fused': fused_recurrent_falcon, 'chunk': chunk16}
# (kernel, rule, window): each kernel with a scalar-gain, a per-column and (fused) a windowed rule
CASES = [('fused', 'falcon1', 1), ('fused', 'falcon2', 1), ('fused', 'falcon3', 3),
         ('chunk', 'falcon1', 1), ('chunk', 'falcon2a', 1)]
FEW = [('fused', 'falcon3a', 2), ('chunk', 'falcon1a', 1)]
assert all(r in SUPPORTED_RULES for k, r, _ in CASES + FEW if k == 'chunk')


def err_ratio(ref, tri):
    ref, tri = ref.detach().double().cpu(), tri.detach().double().cpu()
    return ((ref - tri).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


def check(name, ref, tri, ratio):
    assert ref.shape == tri.shape, f"{name}: shape {tuple(tri.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(tri).all(), f"{name}: non-finite values"
    if ref.numel() == 0 or (ref.detach().double().cpu() - tri.detach().double().cpu()).abs().max() <= 1e-6:
        return
    r = err_ratio(ref, tri)
    assert r < ratio, f"{name}: relative error {r:.3e} >= {ratio}"


def make(rule, B, T, H, HV, K, V, W=1, counts=None, seed=0, lam=True):
    """Inputs (q, k, v, beta, lam) and an optional canonical FalconState (zeros before the real tail rows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, HV, V, generator=g)
    bshape = (B, T, HV, V) if rule_info(rule)[1] else (B, T, HV)
    beta = 0.2 + 1.6 * torch.rand(bshape, generator=g)
    lam = torch.rand(B, T, HV, generator=g) * 0.5 if lam else None
    state = None
    if counts is not None:
        N = len(counts)
        S, lk = torch.randn(N, HV, K, V, generator=g) * 0.2, torch.randn(N, H, K, generator=g)
        tx, tv = torch.randn(N, H, W - 1, K, generator=g), torch.randn(N, HV, W - 1, V, generator=g)
        for n, c in enumerate(counts):
            n_tail = max(c - 1, 0)   # shift=True
            tx[n, :, :W - 1 - n_tail] = 0
            tv[n, :, :W - 1 - n_tail] = 0
            if c == 0:
                S[n], lk[n] = 0, 0
        state = FalconState(S, lk, tx, tv, torch.tensor(counts, dtype=torch.int32))
    return [q, k, v, beta, lam], state


def run(fn, xs, state, *, rule, W=1, dtype=torch.float32, state_dtype=None, grad=('q', 'k', 'v', 'beta', 'lam', 'S'),
        device=DEVICE, seed=1, **kw):
    """Output, final state and the gradients (dict) of a fixed random loss over o and the final S / last_k."""
    names = ['q', 'k', 'v', 'beta', 'lam']
    xs = [None if t is None else t.detach().to(device, dtype).clone().requires_grad_(n in grad)
          for n, t in zip(names, xs)]
    st = None
    if state is not None:
        sdt = state_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        st = FalconState(*(t.detach().to(device, sdt).clone().requires_grad_(n in grad)
                           for n, t in zip(['S', 'last_k', 'tail_x', 'tail_v'], state[:4])), state.count.to(device))
    o, fs = fn(*xs, rule=rule, window=W, initial_state=st, output_final_state=True, **kw)
    leaves = {n: t for n, t in zip(names, xs) if t is not None and t.requires_grad}
    if st is not None:
        leaves.update({n: t for n, t in zip(['S', 'last_k'], st[:2]) if t.requires_grad})
    grads = {}
    if leaves:
        gen = torch.Generator().manual_seed(seed)
        loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device)).sum()
        loss = loss + (fs.S.double() * torch.randn(fs.S.shape, generator=gen, dtype=torch.float64).to(device)).sum()
        loss = loss + fs.last_k.double().sum()
        gs = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = {n: (torch.zeros_like(t) if g is None else g) for (n, t), g in zip(leaves.items(), gs)}
    return o, fs, grads


def compare(kernel, rule, xs, state, *, W=1, dtype=torch.float32, ratio=None, cu_seqlens=None, state_dtype=None,
            **kw):
    """Kernel vs the fp64 reference on the same (rounded) inputs; returns the kernel's (o, state, grads)."""
    ratio = ratio or RATIO[dtype]
    xs_r = [None if t is None else t.to(dtype) for t in xs]
    ref = run(naive_recurrent_falcon, xs_r, state, rule=rule, W=W, dtype=torch.float64, device='cpu',
              cu_seqlens=cu_seqlens, **kw)
    tri = run(KERNELS[kernel], xs_r, state, rule=rule, W=W, dtype=dtype, state_dtype=state_dtype,
              cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(DEVICE), **kw)
    check('o', ref[0], tri[0], ratio)
    for name, a, b in zip(FalconState._fields[:2], ref[1], tri[1]):
        check(name, a, b, ratio)
    assert torch.equal(ref[1].count.cpu().int(), tri[1].count.cpu().int())
    assert ref[2].keys() == tri[2].keys()
    for name in ref[2]:
        check('d' + name, ref[2][name], tri[2][name], ratio)
    return tri


# --------------------------------------------------------------------------------------------------
# layouts and dtypes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_non_contiguous_views(kernel, rule, W):
    """q, k sliced out of a fused qkv [B, T, 3, H, K], v a transposed view, strided beta and lam views;
    gradients flow back into the fused tensors."""
    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 6, 2, 8, 8
    per_col = rule_info(rule)[1]
    qkv = torch.randn(B, T, 3, H, K, generator=g, device='cpu').to(DEVICE).requires_grad_()
    v_t = torch.randn(B, H, T, V, generator=g).to(DEVICE).requires_grad_()
    b_shape = (B, T, V, H) if per_col else (B, T, 2 * H)
    b_raw = (0.2 + 1.6 * torch.rand(b_shape, generator=g)).to(DEVICE).requires_grad_()
    l_t = (0.5 * torch.rand(B, H, T, generator=g)).to(DEVICE).requires_grad_()

    def views(qkv, v_t, b_raw, l_t):
        beta = b_raw.transpose(2, 3) if per_col else b_raw[..., ::2]
        return qkv[:, :, 0], qkv[:, :, 1], v_t.transpose(1, 2), beta, l_t.transpose(1, 2)

    q, k, v, beta, lam = views(qkv, v_t, b_raw, l_t)
    assert not any(t.is_contiguous() for t in (q, k, v, beta, lam))
    o, fs = KERNELS[kernel](q, k, v, beta, lam, rule=rule, window=W, output_final_state=True)
    w = torch.randn(o.shape, generator=g).to(DEVICE)
    gs = torch.autograd.grad((o * w).sum() + fs.S.sum(), [qkv, v_t, b_raw, l_t])

    leaves = [t.detach().cpu().double().requires_grad_() for t in (qkv, v_t, b_raw, l_t)]
    o_r, fs_r = naive_recurrent_falcon(*views(*leaves), rule=rule, window=W, output_final_state=True)
    gs_r = torch.autograd.grad((o_r * w.cpu().double()).sum() + fs_r.S.sum(), leaves)
    check('o', o_r, o, RATIO[torch.float32])
    check('S', fs_r.S, fs.S, RATIO[torch.float32])
    for name, a, b in zip(['dqkv', 'dv', 'dbeta', 'dlam'], gs_r, gs):
        check(name, a, b, RATIO[torch.float32])


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_low_precision_inputs(kernel, rule, W, dtype):
    """fp16/bf16 inputs (also on the CPU): o in the input dtype, state fp32, close to the reference on the
    same rounded inputs. (bf16 chunk on the CPU needed the interpreter's bf16 tl.dot fix in _platform.)"""
    xs, st = make(rule, 2, 6, 1, 2, 8, 8, W=W, counts=[W, 0], seed=2)
    o, fs, grads = compare(kernel, rule, xs, st, W=W, dtype=dtype)
    assert o.dtype == dtype
    assert fs.S.dtype == fs.last_k.dtype == torch.float32 and fs.count.dtype == torch.int32
    assert grads['q'].dtype == dtype and grads['S'].dtype == torch.float32


@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_fp64_inputs(kernel, rule, W):
    """fp64 inputs: o, the final state (FalconState's contract, as naive and fused) and gradients in fp64."""
    xs, st = make(rule, 1, 5, 1, 1, 8, 8, W=W, counts=[W], seed=4)
    o, fs, grads = compare(kernel, rule, xs, st, W=W, dtype=torch.float64)
    assert o.dtype == torch.float64
    assert all(t.dtype == torch.float64 for t in fs[:4]), [t.dtype for t in fs]
    assert all(g.dtype == torch.float64 for g in grads.values())


# --------------------------------------------------------------------------------------------------
# empty segments and empty packed sequences
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_empty_segment(kernel, rule, W, with_state):
    """T = 0: o is empty and the final state is the initial one (a zero state with count 0 without one);
    the gradient of the initial state is the final state's cotangent."""
    xs, st = make(rule, 2, 0, 1, 2, 8, 8, W=W, counts=[W, 1] if with_state else None)
    grad = ('q', 'k', 'v', 'beta', 'lam', 'S', 'last_k')
    o, fs, grads = run(KERNELS[kernel], xs, st, rule=rule, W=W, grad=grad)
    assert o.shape == (2, 0, 2, 8)
    if with_state:
        for name, a, b in zip(FalconState._fields, st, fs):
            assert torch.equal(a, b.cpu().to(a.dtype)), name
        ref = run(naive_recurrent_falcon, xs, st, rule=rule, W=W, dtype=torch.float64, device='cpu', grad=grad)[2]
        for name in ('S', 'last_k'):
            check('d' + name, ref[name], grads[name], 1e-6)
    else:
        assert all(not t.any() for t in fs)
        assert fs.count.tolist() == [0, 0]


@pytest.mark.parametrize('cu_dtype', [torch.int64, torch.int32])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_varlen_empty_sequences(kernel, rule, W, cu_dtype):
    """Empty sequences first, in the middle and last, int32 or int64 offsets, a state for every sequence."""
    cu = torch.tensor([0, 0, 3, 3, 7, 7], dtype=cu_dtype)
    xs, st = make(rule, 1, 7, 1, 2, 8, 8, W=W, counts=[W, 1, 0, 1, W], seed=5)
    o, fs, _ = compare(kernel, rule, xs, st, W=W, cu_seqlens=cu)
    for n in (0, 2, 4):   # the empty sequences keep their state
        for name, a, b in zip(FalconState._fields, st, fs):
            assert torch.equal(a[n], b[n].cpu().to(a.dtype)), (n, name)


@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_varlen_all_empty(kernel, rule, W):
    """A packed batch whose sequences are all empty (T = 0 with cu_seqlens): nothing changes."""
    xs, st = make(rule, 1, 0, 1, 1, 8, 8, W=W, counts=[W, 0])
    o, fs, _ = run(KERNELS[kernel], xs, st, rule=rule, W=W, cu_seqlens=torch.tensor([0, 0, 0], device=DEVICE))
    assert o.shape == (1, 0, 1, 8)
    for name, a, b in zip(FalconState._fields, st, fs):
        assert torch.equal(a, b.cpu().to(a.dtype)), name
    _, fs, _ = run(KERNELS[kernel], xs, None, rule=rule, W=W, cu_seqlens=torch.tensor([0, 0, 0], device=DEVICE))
    assert all(not t.any() for t in fs) and fs.S.shape[0] == 2


# --------------------------------------------------------------------------------------------------
# head layouts and sizes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('H,HV,K,V', [(1, 4, 8, 8), (1, 1, 8, 16), (2, 2, 24, 40)])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_head_layouts(kernel, rule, W, H, HV, K, V):
    """Grouped value heads (HV = 4H), a single head, K != V and head dims that are no powers of two."""
    xs, st = make(rule, 1, 5, H, HV, K, V, W=W, counts=[W], seed=HV + K)
    compare(kernel, rule, xs, st, W=W, ratio=2e-4 if not ON_GPU else None,
            grad=('q', 'k', 'v', 'beta', 'lam', 'S', 'last_k'))


@pytest.mark.parametrize('K,V', [(256, 256), (128, 256)])
@pytest.mark.parametrize('kernel,rule,W', [('fused', 'falcon1', 1), ('fused', 'falcon3', 2), ('chunk', 'falcon2a', 1)])
def test_largest_head_dims(kernel, rule, W, K, V):
    """The largest head dims both kernels promise (256), a few tokens, forward and (fused) backward."""
    xs, st = make(rule, 1, 3, 1, 1, K, V, W=W, counts=[W], seed=7)
    grad = ('v', 'beta') if kernel == 'fused' else ()   # the chunk backward at K=256 is GPU-only below
    compare(kernel, rule, xs, st, W=W, grad=grad, ratio=None if ON_GPU else 5e-4)


def test_chunk_head_dim_limit():
    xs, _ = make('falcon1', 1, 3, 1, 1, 264, 8)
    with pytest.raises(ValueError, match='K <= 256'):
        chunk_falcon(*[t.to(DEVICE) for t in xs], rule='falcon1')


@pytest.mark.gpu
@pytest.mark.parametrize('K,V', [(256, 256), (128, 256)])
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_chunk_largest_head_dims_gpu(rule, K, V):
    xs, st = make(rule, 1, 70, 1, 2, K, V, counts=[1], seed=8)
    compare('chunk', rule, xs, st, ratio=5e-3)
    compare('chunk', rule, xs, st, dtype=torch.bfloat16, ratio=3e-2)


# --------------------------------------------------------------------------------------------------
# scale, eps, lam
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('scale', [0.3, 0.0, 2])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_explicit_scale(kernel, rule, W, scale):
    xs, st = make(rule, 1, 5, 1, 1, 8, 8, W=W, counts=[W], seed=9)
    o, _, grads = compare(kernel, rule, xs, st, W=W, scale=scale)
    if scale == 0:
        assert not o.any() and not grads['q'].any()


@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_eps_zero_with_zero_keys(kernel, rule, W):
    """eps = 0, no ridge and zero keys: a zero denominator gives eta = 0 (no write, no decay), finite gradients."""
    xs, st = make(rule, 1, 6, 1, 1, 8, 8, W=W, counts=[W], seed=10, lam=False)
    xs[1][:, 1:3] = 0
    st.last_k.zero_()
    compare(kernel, rule, xs, st, W=W, eps=0.0)


@pytest.mark.parametrize('kernel,rule,W', CASES + FEW)
def test_zero_lam_is_no_lam(kernel, rule, W):
    xs, st = make(rule, 1, 5, 1, 2, 8, 8, W=W, counts=[W], seed=11)
    q, k, v, beta, lam = (t.to(DEVICE) for t in xs)
    st = FalconState(*(t.to(DEVICE) for t in st))
    kw = dict(rule=rule, window=W, initial_state=st, output_final_state=True)
    o1, s1 = KERNELS[kernel](q, k, v, beta, torch.zeros_like(lam), **kw)
    o2, s2 = KERNELS[kernel](q, k, v, beta, None, **kw)
    for name, a, b in zip(('o',) + FalconState._fields, (o1,) + tuple(s1), (o2,) + tuple(s2)):
        if ON_GPU:
            # lam=None and lam=0 compile different kernels (HAS_LAM) whose autotuned configs may differ and
            # sum in another order: equal up to fp32 round-off there, bitwise on the CPU
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------------
# states in other dtypes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_state_dtypes(kernel, rule, W):
    """A bf16 or fp64 state (and an int64 count) is read as fp32; its gradient keeps its dtype.
    A floating-point count is refused."""
    xs, st = make(rule, 1, 5, 1, 1, 8, 8, W=W, counts=[W], seed=12)
    st = FalconState(*(t.bfloat16().float() for t in st[:4]), st.count)   # representable in bf16
    for sdt in (torch.bfloat16, torch.float64):
        # the bf16 state's gradient is rounded to bf16
        ratio = 1e-2 if sdt == torch.bfloat16 else None
        _, fs, grads = compare(kernel, rule, xs, st, W=W, state_dtype=sdt, ratio=ratio)
        assert fs.S.dtype == torch.float32 and grads['S'].dtype == sdt
    compare(kernel, rule, xs, st._replace(count=st.count.long()), W=W)
    bad = FalconState(*(t.to(DEVICE) for t in st[:4]), st.count.float().to(DEVICE))
    with pytest.raises(ValueError, match='count'):
        KERNELS[kernel](*[t.to(DEVICE) for t in xs], rule=rule, window=W, initial_state=bad)


# --------------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('grad', [('v',), ('beta', 'lam'), ('S', 'last_k'), ('q', 'k')])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_partial_requires_grad(kernel, rule, W, grad):
    """Only some inputs need a gradient (e.g. only v, or only the initial state)."""
    xs, st = make(rule, 1, 5, 1, 2, 8, 8, W=W, counts=[W], seed=13)
    compare(kernel, rule, xs, st, W=W, grad=grad)


@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_expanded_cotangents(kernel, rule, W, with_state):
    """`o.sum() + S.sum()`: autograd hands the backward expanded (stride-0) cotangents for o and the final
    state; the kernels must not read them as dense tensors."""
    xs, st = make(rule, 1, 5, 1, 2, 8, 8, W=W, counts=[W] if with_state else None, seed=15)
    grads = []
    for fn, dt, dev in ((naive_recurrent_falcon, torch.float64, 'cpu'), (KERNELS[kernel], torch.float32, DEVICE)):
        leaves = [t.to(dev, dt).requires_grad_() for t in xs]
        s0 = None if st is None else FalconState(*(t.to(dev, dt) for t in st[:4]), st.count.to(dev))
        o, fs = fn(*leaves, rule=rule, window=W, initial_state=s0, output_final_state=True)
        grads.append(torch.autograd.grad(o.sum() + fs.S.sum() + fs.last_k.sum(), leaves))
    for name, a, b in zip(['dq', 'dk', 'dv', 'dbeta', 'dlam'], *grads):
        check(name, a, b, RATIO[torch.float32])


@pytest.mark.parametrize('kernel,rule,W', CASES)
def test_no_grad_and_retain_graph(kernel, rule, W):
    xs, st = make(rule, 1, 5, 1, 1, 8, 8, W=W, counts=[W], seed=14)
    xs = [t.to(DEVICE).requires_grad_() for t in xs]
    st = FalconState(*(t.to(DEVICE) for t in st))
    fn = KERNELS[kernel]
    with torch.no_grad():
        o0, s0 = fn(*xs, rule=rule, window=W, initial_state=st, output_final_state=True)
    assert not o0.requires_grad and not s0.S.requires_grad
    o1, s1 = fn(*xs, rule=rule, window=W, initial_state=st, output_final_state=True)
    assert o1.requires_grad
    torch.testing.assert_close(o0, o1.detach(), **SAME)
    torch.testing.assert_close(s0.S, s1.S.detach(), **SAME)
    o2, _ = fn(*(t.detach() for t in xs), rule=rule, window=W, initial_state=st)
    assert not o2.requires_grad
    loss = (o1 * torch.arange(o1.numel(), device=DEVICE).view_as(o1).sin()).sum() + s1.S.square().sum()
    first = torch.autograd.grad(loss, xs, retain_graph=True)
    second = torch.autograd.grad(loss, xs)
    for a, b in zip(first, second):   # the GPU's fp32 atomics may add in another order
        torch.testing.assert_close(a, b, **SAME)


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------

HIDDEN = 32


def make_layer(rule='falcon1', train=False):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        layer = FalconNet(hidden_size=HIDDEN, head_dim=8, num_heads=2, expand_v=1.0, attn_mode=rule, layer_idx=0)
    return layer.to(DEVICE).train(train)


def call(layer, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return layer(x, **kw)


@pytest.mark.parametrize('train', [False, True])
@pytest.mark.parametrize('rule', ['falcon1', 'falcon3'])
def test_layer_mask_all_ones_is_none(rule, train):
    layer = make_layer(rule, train)
    x = torch.randn(2, 6, HIDDEN, device=DEVICE)
    a = call(layer, x)[0]
    b = call(layer, x, attention_mask=torch.ones(2, 6, dtype=torch.long, device=DEVICE))[0]
    torch.testing.assert_close(a, b, **SAME)


@pytest.mark.parametrize('train', [False, True])
@pytest.mark.parametrize('rule', ['falcon1', 'falcon2a'])
def test_layer_one_real_token(rule, train):
    """Row 1 is padding except its last token, row 2 is all padding: each row equals its unpadded self."""
    layer = make_layer(rule, train)
    x = torch.randn(3, 6, HIDDEN, device=DEVICE, requires_grad=True)
    mask = torch.ones(3, 6, dtype=torch.long, device=DEVICE)
    mask[1, :5] = 0
    mask[2] = 0
    o = call(layer, x, attention_mask=mask)[0]
    torch.testing.assert_close(o[0], call(layer, x[:1])[0][0], **SAME)
    torch.testing.assert_close(o[1, 5:], call(layer, x[1:2, 5:])[0][0], **SAME)
    assert not o[1, :5].any() and not o[2].any()
    o.sum().backward()
    assert torch.isfinite(x.grad).all() and not x.grad[1, :5].any()


@pytest.mark.parametrize('rule', ['falcon1', 'falcon3a'])
def test_layer_use_cache_in_training(rule):
    """use_cache=True while training (chunk kernel with autograd): same output, a backward pass, and a
    FalconState in the cache that continues the sequence. (The continuation runs without autograd: fla's
    causal_conv1d backward through a cached conv state fails under the CPU interpreter.)"""
    layer = make_layer(rule, train=True)
    x = torch.randn(2, 7, HIDDEN, device=DEVICE, requires_grad=True)
    cache = Cache()
    o, _, cache = call(layer, x[:, :5], past_key_values=cache, use_cache=True)
    state = cache[0]['recurrent_state']
    assert isinstance(state, FalconState) and state.count.tolist() == [min(5, layer.window)] * 2
    (o.sum() + state.S.sum()).backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    with torch.no_grad():
        o2, _, _ = call(layer, x[:, 5:], past_key_values=cache, use_cache=True)
        full = call(layer, x)[0]
    torch.testing.assert_close(torch.cat([o.detach(), o2], 1), full, **(SAME if ON_GPU else dict(rtol=1e-4, atol=1e-5)))


@pytest.mark.parametrize('train', [False, True])
def test_layer_all_padding_with_cache(train):
    """A batch that is padding only, with use_cache: zero output and fresh (zero, count 0) states."""
    layer = make_layer('falcon1', train)
    x = torch.randn(2, 4, HIDDEN, device=DEVICE)
    o, _, cache = call(layer, x, attention_mask=torch.zeros(2, 4, dtype=torch.long, device=DEVICE),
                       past_key_values=Cache(), use_cache=True)
    assert o.shape == x.shape and not o.any()
    state = cache[0]['recurrent_state']
    assert state.count.tolist() == [0, 0] and not state.S.any()


def test_layer_output_attentions():
    layer = make_layer('falcon1')
    x = torch.randn(1, 4, HIDDEN, device=DEVICE)
    o, attn, cache = call(layer, x, output_attentions=True)
    assert attn is None and cache is None
    torch.testing.assert_close(o, call(layer, x)[0], **SAME)


@pytest.mark.parametrize('rule', ['falcon2', 'falcon2a'])
def test_final_state_gradient_without_final_state(rule):
    """The per-column backward reads the forward's final state with a final-state gradient; called without one
    (autograd never does: no final state, no cotangent) it refuses before any launch."""
    from fla_falcon.ops.falcon.chunk import _chunk_bwd, _chunk_fwd
    xs, _ = make(rule, 1, 5, 1, 1, 16, 16, seed=16)
    q, k, v, beta, lam = (t.to(DEVICE, torch.float32) for t in xs)
    cfg = dict(eps=1e-6, eps_gamma=1e-3, delta=rule == 'falcon2', per_col=True, win=0, lam_coupled=False,
               shift=True, cu_seqlens=None, chunk_size=64)
    nones = (None,) * 5   # S0, last_k, tail_x, tail_v, count
    o, ht, saved = _chunk_fwd(q, k, v, beta, lam, *nones, 16 ** -0.5, output_final_state=False, **cfg)
    assert ht is None
    with pytest.raises(ValueError, match='dht'):
        _chunk_bwd(q, k, v, beta, lam, *nones, saved, torch.ones_like(o), torch.zeros(1, 1, 16, 16, device=DEVICE),
                   16 ** -0.5, **cfg)
