# -*- coding: utf-8 -*-
"""Pure-PyTorch stand-ins for the Triton pieces the compared models use.

Why: on a CPU, Triton runs only through its interpreter, which takes ~25 s for one training step of a
32-wide 2-layer model (mostly fla's ShortConvolution); and two fla recurrences have no usable training
path on some machines (fla's GatedDeltaNet: NaN under the interpreter, chunk backward refused on Hopper
with Triton < 3.7.1 (#640), no fused_recurrent backward at all). Each stand-in below computes the same
function as the module/op it replaces (same formula, fp32 math, autograd gradients), so the models
and their parameters are unchanged; tests/test_addition.py checks them against fla where fla runs.

`enable(parts)` patches process-wide and is idempotent; call it before building models. `disable()`
undoes it (tests).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PARTS = ('conv', 'norm', 'falcon', 'deltanet', 'gdn')
# not among the CPU route's PARTS: fla's chunk kernels with their one refused kernel in PyTorch (GPU only)
EXTRA_PARTS = ('dqkwg',)
_enabled: set = set()
_saved: list = []   # (object, attribute, original value), in patching order


def _set(obj, attr: str, value) -> None:
    _saved.append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, value)


def disable() -> None:
    """Undoes every patch of `enable` (models built meanwhile keep e.g. Mamba2's torch activation)."""
    while _saved:
        obj, attr, value = _saved.pop()
        setattr(obj, attr, value)
    _enabled.clear()


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # fla's l2norm: x / sqrt(sum x^2 + eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rmsnorm_ref(x, weight, bias, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def short_conv_ref(conv, x: torch.Tensor, mask=None) -> torch.Tensor:
    """fla ShortConvolution without cache: depthwise causal conv over time, then the activation."""
    if mask is not None:
        x = x * mask.unsqueeze(-1)
    T = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=conv.kernel_size[0] - 1,
                 groups=conv.hidden_size)[..., :T].transpose(1, 2)
    return F.silu(y) if conv.activation is not None else y


def causal_conv1d_ref(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, cu_seqlens=None, _orig=None, **kwargs):
    """fla's functional causal_conv1d ([B, T, D] input, [D, W] weight) without states / varlen."""
    if residual is not None or initial_state is not None or output_final_state or cu_seqlens is not None:
        return _orig(x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                     output_final_state=output_final_state, activation=activation, cu_seqlens=cu_seqlens, **kwargs)
    T = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                 groups=weight.shape[0])[..., :T].transpose(1, 2)
    return (F.silu(y) if activation in ('silu', 'swish') else y), None


def delta_rule_ref(q, k, v, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                   use_qk_l2norm_in_kernel=False, scale=None, **kwargs):
    """fla's (fused_recurrent|chunk)_delta_rule on [B, T, H, D] inputs through fla's own naive recurrence."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    if cu_seqlens is not None:
        raise NotImplementedError("torch reference delta rule: cu_seqlens (padding masks) not supported")
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise NotImplementedError("torch reference delta rule: only the default scale")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    o, s = delta_rule_recurrence(*(t.transpose(1, 2) for t in (q, k, v, beta)), initial_state=initial_state,
                                 output_final_state=output_final_state)
    return o.transpose(1, 2).to(v.dtype), s


class _UnitLowerInverse(torch.autograd.Function):
    """(I + L)^-1 for strictly lower-triangular L ([..., C, C], C a power of two), by batched matmuls only:
    block forward substitution, bottom up: with the inverses X11, X22 of two neighbouring diagonal blocks of
    size b, the inverse of their 2b block is [[X11, 0], [-X22 A21 X11, X22]]; log2(C) levels, each one batch of
    small products. This is the scheme of fla's `solve_tril` kernel, kept in PyTorch here: that kernel has no
    backward, and this route stays PyTorch end to end (checked in fp64 on the CPU). Every intermediate is a
    block of the true inverse, so it is as stable as a triangular solve; the Neumann product
    (I - L)(I + L^2)(I + L^4)... is not (with 32 nearly identical keys its powers of L reach ~1e8 and cancel:
    420% error in fp32, tests/test_addition.py). Backward: dL = -(A^T dA A^T) on the strictly lower part
    (A = the inverse). Batched cuBLAS triangular solves of many small systems are the suspected cost of this
    route on the GPU (16 a step); these are plain batched matmuls, in full fp32 (TF32 off inside, whatever the
    caller enabled)."""

    @staticmethod
    def forward(ctx, IL):
        C = IL.shape[-1]
        batch = IL.shape[:-2]
        with _full_precision():
            X = torch.eye(C, device=IL.device, dtype=IL.dtype).expand(*batch, C, C).contiguous()
            b = 1
            while b < C:
                n = C // (2 * b)
                # the n diagonal blocks of size 2b, as [..., n, 2b, 2b]
                Xd = X.view(*batch, n, 2 * b, n, 2 * b).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
                Ad = IL.reshape(*batch, n, 2 * b, n, 2 * b).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
                N21 = -(Xd[..., b:, b:] @ Ad[..., b:, :b] @ Xd[..., :b, :b])
                Xd[..., b:, :b] = N21   # Xd is a view into X: writes the new off-diagonal blocks in place
                b *= 2
        ctx.save_for_backward(X)
        return X

    @staticmethod
    def backward(ctx, dA):
        A, = ctx.saved_tensors
        with _full_precision():
            At = A.transpose(-1, -2)
            dIL = -(At @ dA @ At)
        return dIL.tril(-1)


class _full_precision:
    """Matmuls in full fp32 inside (TF32 off), restored on exit."""

    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def unit_lower_inverse(IL: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 of unit lower-triangular matrices IL [..., C, C] (C a power of two) by matmuls only
    (block forward substitution, `_UnitLowerInverse`)."""
    C = IL.shape[-1]
    if C & (C - 1):
        raise ValueError(f"unit_lower_inverse: the size must be a power of two, got {C}")
    return _UnitLowerInverse.apply(IL)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                                 chunk_size: int = 32, solve: str | None = None):
    """fla's gated delta rule in PyTorch, chunk by chunk (exact; autograd gradients).

    The recurrence of fla's ``naive_recurrent_gated_delta_rule``: S <- exp(g_t) S, then
    u_t = beta_t (v_t - S^T k_t), S <- S + k_t u_t^T, o_t = scale S^T q_t. Inside a chunk starting at S0,
    with G the in-chunk cumulative log-decay, the u solve the unit lower-triangular system
    (I + L) U = diag(beta) V - diag(beta exp(G)) K S0 with L_ts = beta_t exp(G_t - G_s) k_t.k_s (s < t).
    One inverse of (I + L) (``solve='inverse'``, the default on a GPU: `unit_lower_inverse`, matmuls only;
    ``'triangular'``, the default on a CPU: two batched triangular solves) and a few batched matmuls per
    chunk replace C token steps: a GPU training step launches ~C times fewer kernels than the token loop
    (fla's ``naive_chunk_gated_delta_rule`` inverts each chunk with a Python loop over its rows, which gives
    back most of that). q, k, v, g, beta: [B, T, H, ...]; fp64 stays fp64, anything else runs in fp32.
    Every exponent is G_t - G_s with s <= t (masked to -inf elsewhere).
    """
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    q, k, v, g, beta = (t.transpose(1, 2).to(dt) for t in (q, k, v, g, beta))   # [B, H, T, ...]
    pad = (-T) % C
    if pad:   # zero tokens at the end: no decay (g = 0) and no write (beta = 0)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // C
    q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))
    q = q * scale
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
    G = g.cumsum(-1)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float('-inf')).exp()   # exp(G_t - G_s), s <= t
    # strictly lower part (D is already 0 above the diagonal)
    L = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * D).masked_fill(idx[:, None] == idx[None, :], 0.)
    IL = L + torch.eye(C, device=q.device, dtype=dt)
    if solve is None:   # on a CPU, LAPACK's triangular solves are the faster (2x for the paper preset's shape)
        solve = 'inverse' if q.is_cuda else 'triangular'
    if solve == 'inverse':   # one explicit inverse by matmuls (unit_lower_inverse), then two products
        Ainv = unit_lower_inverse(IL)
        W = Ainv @ ((beta * G.exp())[..., None] * k)
        U0 = Ainv @ (beta[..., None] * v)
    elif solve == 'triangular':
        W = torch.linalg.solve_triangular(IL, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
        U0 = torch.linalg.solve_triangular(IL, beta[..., None] * v, upper=False, unitriangular=True)
    else:
        raise ValueError(f"solve must be 'inverse' or 'triangular', got {solve!r}")
    QK = (q @ k.transpose(-1, -2)) * D
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(n):
        U = U0[:, :, i] - W[:, :, i] @ S
        outs.append((q[:, :, i] * G[:, :, i, :, None].exp()) @ S + QK[:, :, i] @ U)
        Gi = G[:, :, i]
        S = (Gi[..., -1, None, None].exp() * S
             + (k[:, :, i] * (Gi[..., -1:] - Gi).exp()[..., None]).transpose(-1, -2) @ U)
    o = torch.stack(outs, 2).reshape(B, H, n * C, V)[:, :, :T].transpose(1, 2)
    return o, (S if output_final_state else None)


def gated_delta_rule_ref(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                         cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, scale=None, **kwargs):
    """fla 0.6.0's chunk/fused_recurrent_gated_delta_rule (the options fla's GatedDeltaNet layer passes):
    in-kernel l2norm of q/k, beta = sigmoid(b) (x2 with allow_neg_eigval), log-decay
    g = -exp(A_log) * softplus(a + dt_bias) (fla's `naive_gdn_gate`), then fla's recurrence computed chunk by
    chunk in PyTorch (`chunk_gated_delta_rule_torch`, checked against fla's naive recurrence; autograd
    gives the gradients)."""
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    if cu_seqlens is not None:
        raise NotImplementedError("torch reference gated delta rule: cu_seqlens (padding masks) not supported")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
    if allow_neg_eigval:
        beta = beta * 2
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    HV, H = v.shape[2], q.shape[2]
    if HV != H:   # grouped value heads: value head hv reads key head hv // (HV // H)
        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, s = chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                        initial_state=initial_state, output_final_state=output_final_state)
    if s is not None and state_v_first:
        s = s.transpose(-1, -2)
    return o.to(v.dtype), s


def naive_falcon_batched(q, k, v, beta, lam=None, *, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **kwargs):
    """`naive_recurrent_falcon` with the batch folded into the heads when every sequence starts fresh.

    The reference loops over sequences, then tokens; heads and sequences are independent, and with H*B
    key heads and HV*B value heads value head b*HV + h*G + g still reads key head b*H + h (= its index // G),
    so one B=1 call over B*H heads is the same computation, B times fewer python steps.
    """
    from fla_falcon.ops.falcon.naive import naive_recurrent_falcon
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        return naive_recurrent_falcon(q, k, v, beta, lam, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
    B, T, H, K = q.shape
    HV = v.shape[2]

    def fold(t):   # [B, T, h, ...] -> [1, T, B*h, ...]
        return None if t is None else t.transpose(0, 1).reshape(1, T, B * t.shape[2], *t.shape[3:])
    o, _ = naive_recurrent_falcon(fold(q), fold(k), fold(v), fold(beta), fold(lam), **kwargs)
    return o.reshape(T, B, HV, -1).transpose(0, 1), None


def chunk_bwd_dqkwg_torch(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                          state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """fla 0.6.0's `fla.ops.common.chunk_o.chunk_bwd_dqkwg` (same arguments and results) in PyTorch, for the
    gated case (`g`, cumulative log2-decay per chunk) that fla refuses on Hopper with Triton < 3.7.1 (#640: that
    Triton miscompiles the kernel there). Every other kernel of fla's chunk backward is fla's own; this one is a
    few batched matmuls over all chunks at once, in fp32 (the kernel multiplies ds in the input dtype).

    Per chunk (rows i, j of the chunk; h, dh the chunk's start state and its gradient, [K, V]):
      dq = scale * (exp2(g) * do h^T + ds k),   dk = exp2(g_last - g) * v dh^T + ds^T q,
      ds_ij = scale * [i >= j] exp2(g_i - g_j) do_i . v_j,   dw = -dv h^T,
      dg = rowsum(dq q) - rowsum(dk k), plus exp2(g_last) sum(h dh) + sum(dk k) on the chunk's last row.
    No data-dependent shapes or host syncs, so it can be captured in a CUDA graph."""
    if g is None or g_gamma is not None:
        raise NotImplementedError("chunk_bwd_dqkwg_torch covers the per-token gated case (g) only")
    B, T, H, K = k.shape
    HV = v.shape[2]
    BT, dev, f32 = chunk_size, k.device, torch.float32
    # every chunk's first token and end (flat token index), in the order of h / dh (fla's chunk order)
    if cu_seqlens is None:
        NT = -(-T // BT)
        c = torch.arange(B * NT, device=dev)
        start, end = (c // NT) * T + (c % NT) * BT, (c // NT + 1) * T
    else:
        if chunk_indices is None:
            from fla.ops.utils import prepare_chunk_indices
            chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
        ci = chunk_indices.long()
        start, end = cu_seqlens[ci[:, 0]].long() + ci[:, 1] * BT, cu_seqlens[ci[:, 0] + 1].long()
    NC = start.shape[0]
    idx = start[:, None] + torch.arange(BT, device=dev)                    # [NC, BT]
    valid = idx < end[:, None]
    safe = torch.where(valid, idx, 0)
    head = torch.arange(HV, device=dev) // (HV // H)                        # value head -> query/key head

    def rows(x, heads=None):   # [B, T, h, D] -> [NC, HV, BT, D] fp32, zero outside the sequence
        x = x.reshape(B * T, x.shape[2], -1)
        if heads is not None:
            x = x[:, heads]
        return (x[safe] * valid[..., None, None]).to(f32).transpose(1, 2)
    qq, kk = rows(q, head), rows(k, head)
    vv, dov = rows(v), rows(do)
    hh, dhh = (t.reshape(NC, HV, *t.shape[-2:]).to(f32) for t in (h, dh))
    if state_v_first:
        hh, dhh = hh.transpose(-1, -2), dhh.transpose(-1, -2)              # -> [NC, HV, K, V]
    gf = g.reshape(B * T, HV).to(f32)
    gg = (gf[safe] * valid[..., None]).transpose(1, 2)                      # [NC, HV, BT]
    last = torch.minimum(start + BT, end) - 1
    g_last = gf[last][..., None]                                            # [NC, HV, 1]
    vrow = valid[:, None, :]
    dg_last = (hh * dhh).sum((-2, -1)) * torch.exp2(g_last[..., 0])
    dq = (dov @ hh.transpose(-1, -2)) * torch.exp2(gg)[..., None] * scale
    dk = (vv @ dhh.transpose(-1, -2)) * torch.where(vrow, torch.exp2(g_last - gg), 0)[..., None]
    dg_last = dg_last + (dk * kk).sum((-2, -1))
    causal = torch.ones(BT, BT, dtype=torch.bool, device=dev).tril()
    m = causal & vrow[..., :, None] & vrow[..., None, :]
    ds = (dov @ vv.transpose(-1, -2)) * torch.exp2(torch.where(m, gg[..., :, None] - gg[..., None, :], float('-inf')))
    ds = ds * scale
    dq = dq + ds @ kk
    dk = dk + ds.transpose(-1, -2) @ qq
    dg = (dq * qq).sum(-1) - (dk * kk).sum(-1)
    is_last = torch.arange(BT, device=dev) == (last - start)[:, None]      # [NC, BT]
    dg = dg + is_last[:, None, :] * dg_last[..., None]

    def scatter(x, like, width):   # [NC, HV, BT, D] -> [B, T, HV, D]; padding rows go to a spare row
        out = x.new_zeros(B * T + 1, HV, width)
        out.index_copy_(0, torch.where(valid, idx, B * T).flatten(), x.transpose(1, 2).reshape(NC * BT, HV, width))
        return out[:-1].reshape(B, T, HV, width).to(like.dtype)
    dq, dk = scatter(dq, q, K), scatter(dk, k, K)
    dw = scatter(-(rows(dv) @ hh.transpose(-1, -2)), w, K) if w is not None else None
    dg = scatter(dg[..., None], gf, 1)[..., 0]
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dw, dg


# Route 'fla+dqkwg' on a GPU runs our Triton kernel (evals/addition/dqkwg.py: no tl.trans of a dot result) for a
# kind of call (shapes, dtypes, options, device) once it has matched chunk_bwd_dqkwg_torch on that call's own inputs
# there; the PyTorch stand-in otherwise, and while a CUDA graph is being captured before any check (a check syncs).
# The training steps before capture are eager, so every kind of call is checked before the graph records it.
DQKWG_TRITON = True
DQKWG_TOL = 2e-2    # tf32 / bf16 rounding is ~1e-3; a miscompiled kernel is off by O(1)
DQKWG_CHECKS: dict = {}   # key -> dict(impl='triton' | 'torch', err=relative error of the check)


def _dqkwg_key(kw) -> str:
    q, v = kw['q'], kw['v']
    return (f"q{tuple(q.shape[2:])} v{tuple(v.shape[2:])} {str(q.dtype)[6:]}/{str(v.dtype)[6:]} "
            f"BT={kw.get('chunk_size', 64)} dw={kw.get('w') is not None} v_first={bool(kw.get('state_v_first'))} "
            f"varlen={kw.get('cu_seqlens') is not None} {q.device}")


def _dqkwg_check(key: str, kwargs) -> str:
    from fla.utils import get_err_ratio

    from evals.addition.dqkwg import chunk_bwd_dqkwg_triton
    ref = chunk_bwd_dqkwg_torch(**kwargs)
    got = chunk_bwd_dqkwg_triton(**kwargs)
    err = max(get_err_ratio(a.float(), b.float()) for a, b in zip(ref, got) if a is not None)
    impl = 'triton' if err < DQKWG_TOL else 'torch'
    DQKWG_CHECKS[key] = dict(impl=impl, err=err)
    if impl == 'torch':
        import warnings
        warnings.warn(f"chunk_bwd_dqkwg: the Triton kernel is off by {err:.2e} at {key}; using the PyTorch one")
    return impl


def _dqkwg(*args, _orig, **kwargs):
    if args or kwargs.get('g') is None or kwargs.get('g_gamma') is not None:
        return _orig(*args, **kwargs)
    from evals.addition.dqkwg import supports
    if DQKWG_TRITON and kwargs['q'].is_cuda and supports(kwargs['k'].shape[-1], kwargs['v'].shape[-1]):
        key = _dqkwg_key(kwargs)
        check = DQKWG_CHECKS.get(key)
        impl = check['impl'] if check else None
        if impl is None and not torch.cuda.is_current_stream_capturing():
            impl = _dqkwg_check(key, kwargs)
        if impl == 'triton':
            from evals.addition.dqkwg import chunk_bwd_dqkwg_triton
            return chunk_bwd_dqkwg_triton(**kwargs)
    return chunk_bwd_dqkwg_torch(**kwargs)


def mamba2_ssd_forward(self, input_states, last_state=None, use_cache=False, attention_mask=None, *, _orig,
                       kernel='torch'):
    """fla's `Mamba2.torch_forward` for training (no cache, no mask, no decoding step) with the SSD done
    by fla's chunked PyTorch simple GLA (`naive_chunk_simple_gla`, matmuls per chunk): Mamba-2's SSD is
    simple GLA with q = C, k = B, v = dt x, g = A dt and scale 1. fla's own version (transformers' "naive
    implementation without einsums") materializes [batch, chunks, L, L, heads, 64]-sized broadcast
    products: ~2 GB per layer at the paper preset's shape (B = 128, L = 64), 1.5-2.3 s a step on an H200.
    Same function, same parameters (tests/test_addition.py checks outputs and gradients against fla's);
    anything else goes to fla's. ``kernel='fla'``: fla's Triton `chunk_simple_gla` instead (GPU; where fla
    refuses its gated backward, enable the 'dqkwg' part)."""
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla
    if last_state is not None or use_cache or attention_mask is not None:
        return _orig(input_states, last_state=last_state, use_cache=use_cache, attention_mask=attention_mask)
    bsz, T, _ = input_states.shape
    dtype = input_states.dtype
    H, P, N, G = self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups
    proj = self.in_proj(input_states)
    d_mlp = (proj.shape[-1] - 2 * self.intermediate_size - 2 * G * N - H) // 2
    _, _, gate, xBC, dt = proj.split([d_mlp, d_mlp, self.intermediate_size, self.conv_dim, H], dim=-1)
    xBC = self.act(self.conv1d(xBC.transpose(1, 2))[..., :T].transpose(1, 2))
    x, B, C = torch.split(xBC, [self.intermediate_size, G * N, G * N], dim=-1)
    A = -torch.exp(self.A_log.float())                                       # [H]
    dt = torch.clamp(F.softplus(dt + self.dt_bias), self.dt_limit[0], self.dt_limit[1])   # [b, T, H]
    x = x.reshape(bsz, T, H, P).float()
    # head h reads group h % G (fla's `repeat`)
    B = B.reshape(bsz, T, G, N).float().repeat(1, 1, H // G, 1)
    C = C.reshape(bsz, T, G, N).float().repeat(1, 1, H // G, 1)
    if kernel == 'fla':   # fla's kernel picks its own chunk size (64)
        y, state = chunk_simple_gla(C, B, x * dt[..., None], A * dt, scale=1.0, output_final_state=True)
    else:
        y, state = naive_chunk_simple_gla(C, B, x * dt[..., None], A * dt, output_final_state=True,
                                          chunk_size=self.chunk_size, scale=1.0)
    y = (y + x * self._get_D(expand_to_head_dim=True)).reshape(bsz, T, -1)
    out = self.norm(y, gate) if self.rmsnorm else y * self.act(gate)
    # fla's SSM state is [b, H, head_dim, state]; simple GLA's [b, H, K = state, V = head_dim]
    return self.out_proj(out.to(dtype)), None, state.transpose(-1, -2)


def use_chunked_ssd(model, kernel: str = 'torch') -> int:
    """Routes every fla Mamba2 mixer of `model` through `mamba2_ssd_forward` (its SSD by `kernel`: 'torch', fla's
    chunked PyTorch simple GLA, or 'fla', fla's Triton one); returns how many."""
    if kernel not in ('torch', 'fla'):
        raise ValueError(f"kernel must be 'torch' or 'fla', got {kernel!r}")
    from fla.layers.mamba2 import Mamba2
    n = 0
    for m in model.modules():
        if isinstance(m, Mamba2):
            m.torch_forward = functools.partial(mamba2_ssd_forward, m, _orig=m.torch_forward, kernel=kernel)
            n += 1
    return n


def enable(parts=PARTS) -> set:
    """Patches the given parts (see PARTS) process-wide; returns the set now enabled."""
    import fla.layers.delta_net as fla_delta_net
    import fla.layers.gated_deltanet as fla_gdn
    import fla.layers.mamba2 as fla_mamba2
    import fla.modules.mlp as fla_mlp
    from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
    from fla.modules.norm.layernorm_gated import RMSNormGated, rms_norm_ref

    import fla_falcon.layers.falcon_net as falcon_layer

    for part in parts:
        if part not in PARTS + EXTRA_PARTS:
            raise ValueError(f"parts: unknown part {part!r}, expected some of {PARTS + EXTRA_PARTS}")
        if part in _enabled:
            continue
        if part == 'conv':
            orig_conv = ShortConvolution.forward

            def conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                             cu_seqlens=None, _orig=orig_conv, **kwargs):
                if residual is None and cache is None and not output_final_state and cu_seqlens is None:
                    return short_conv_ref(self, x, mask), None
                return _orig(self, x, residual=residual, mask=mask, cache=cache,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
            _set(ShortConvolution, 'forward', conv_forward)
            # GatedDeltaNet fuses its q/k/v convs into one call of the functional conv
            _set(fla_gdn, 'causal_conv1d', functools.partial(causal_conv1d_ref, _orig=fla_gdn.causal_conv1d))
        elif part == 'norm':
            orig_gated = FusedRMSNormGated.forward

            def rms_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
                # fla's rms_norm: the residual stream is x + residual (fp32 if residual_in_fp32), normed
                res = x if residual is None else x + residual
                if residual_in_fp32:
                    res = res.float()
                y = rmsnorm_ref(res, self.weight, self.bias, self.eps).to(x.dtype)
                return (y, res) if prenorm else y

            def gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False, _orig=orig_gated):
                if residual is None and not prenorm:
                    y = rmsnorm_ref(x, self.weight, self.bias, self.eps)
                    gf = g.float()
                    y = y * (torch.sigmoid(gf) if self.activation == 'sigmoid' else F.silu(gf))
                    return y.to(x.dtype)
                return _orig(self, x, g, residual, prenorm, residual_in_fp32)

            def mamba_gated_forward(self, x, z=None):
                return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                                    norm_before_gate=self.norm_before_gate)
            _set(RMSNorm, 'forward', rms_forward)
            _set(FusedRMSNormGated, 'forward', gated_forward)
            _set(RMSNormGated, 'forward', mamba_gated_forward)
            # Mamba2 takes fla's Triton swish from ACT2FN when built
            _set(fla_mamba2, 'ACT2FN', {**fla_mamba2.ACT2FN, 'silu': F.silu, 'swish': F.silu})
            # GatedMLP's unfused path still calls fla's Triton swiglu
            _set(fla_mlp, 'swiglu', lambda x, y: (F.silu(x.float()) * y.float()).to(x.dtype))
        elif part == 'falcon':
            # the layer picks chunk (training) / fused_recurrent (decoding): route every call to the
            # PyTorch definition of the rule, naive_recurrent_falcon (autograd gradients)
            def run_naive(mode, rule, *args, **kwargs):
                return naive_falcon_batched(*args, rule=rule, **kwargs)
            _set(falcon_layer, 'run_falcon_kernel', run_naive)
        elif part == 'deltanet':
            _set(fla_delta_net, 'fused_recurrent_delta_rule', delta_rule_ref)
            _set(fla_delta_net, 'chunk_delta_rule', delta_rule_ref)
        elif part == 'gdn':
            _set(fla_gdn, 'chunk_gated_delta_rule', gated_delta_rule_ref)
            _set(fla_gdn, 'fused_recurrent_gated_delta_rule', gated_delta_rule_ref)
        elif part == 'dqkwg':
            # fla's gated chunk backward (GatedDeltaNet, simple GLA) with chunk_bwd_dqkwg in PyTorch, where fla
            # refuses the Triton kernel (#640); the modules look the function up at call time
            import fla.ops.gated_delta_rule.chunk as fla_gdn_chunk
            import fla.ops.simple_gla.chunk as fla_sgla_chunk
            for mod in (fla_gdn_chunk, fla_sgla_chunk):
                _set(mod, 'chunk_bwd_dqkwg', functools.partial(_dqkwg, _orig=mod.chunk_bwd_dqkwg))
        _enabled.add(part)
    return set(_enabled)
