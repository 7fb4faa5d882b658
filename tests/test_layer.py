# -*- coding: utf-8 -*-
"""FalconNet layer: forward/backward for every rule, cache continuation, padding, varlen, validation."""

import warnings

import pytest
import torch
from conftest import DEVICE
from fla.models.utils import Cache
from fla.utils import assert_close

import fla_falcon.layers.falcon_net as falcon_net_module
import fla_falcon.ops as falcon_ops
from fla_falcon import FalconState
from fla_falcon.layers import FalconNet
from fla_falcon.layers.falcon_net import resolve_falcon_kernel

RULES = ['falcon1', 'falcon2', 'falcon3', 'falcon1a', 'falcon2a', 'falcon3a']
HIDDEN = 32
# fp32 everywhere; GPU kernels may use TF32 dots
TOL = 1e-4 if DEVICE == 'cpu' else 2e-3


def make_layer(rule='falcon1', device=DEVICE, seed=0, **kwargs):
    torch.manual_seed(seed)
    opts = dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, expand_v=1.0, attn_mode=rule, layer_idx=0)
    opts.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        layer = FalconNet(**opts).to(device)
    return layer.eval()


def run(layer, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # kernel fallback / CPU warnings
        return layer(x, **kwargs)


@pytest.mark.parametrize('gate_param', ['gain', 'step'])
@pytest.mark.parametrize('rule', RULES)
def test_forward_backward(rule, gate_param, device):
    layer = make_layer(rule, device, gate_param=gate_param, num_v_heads=4 if rule == 'falcon2' else None).train()
    x = torch.randn(2, 6, HIDDEN, device=device, requires_grad=True)
    o, attn, cache = run(layer, x)
    assert o.shape == x.shape and attn is None and cache is None
    (o * torch.randn_like(o)).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} gets no gradient"


@pytest.mark.parametrize('rule,gate_param,window,shift,lam_coupled', [
    ('falcon1', 'gain', None, True, False),
    ('falcon2', 'step', None, True, True),
    ('falcon3', 'gain', 3, True, False),
    ('falcon3', 'step', 16, True, True),     # window longer than the whole sequence
    ('falcon1a', 'step', None, False, False),
    ('falcon2a', 'gain', None, True, True),
    ('falcon3a', 'gain', 16, False, False),
    ('falcon3a', 'step', 2, True, False),
])
def test_cache_decoding_equals_full(rule, gate_param, window, shift, lam_coupled, device):
    """Prefill + one token at a time through fla's Cache == one full pass (conv state + FalconState)."""
    layer = make_layer(rule, device, gate_param=gate_param, window=window, shift=shift, lam_coupled=lam_coupled)
    x = torch.randn(2, 10, HIDDEN, device=device)
    with torch.no_grad():
        ref, _, _ = run(layer, x)
        cache = Cache()
        outs = [run(layer, x[:, :3], past_key_values=cache, use_cache=True)[0]]
        state = cache[0]['recurrent_state']
        assert isinstance(state, FalconState) and state.window == layer.window
        assert state.count.tolist() == [min(3, layer.window)] * 2
        for t in range(3, 10):
            outs.append(run(layer, x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    assert_close('decode', ref, torch.cat(outs, 1), TOL)


def test_options_without_conv_and_gate(device):
    """use_short_conv=False, use_gate=False, l2 features and grouped value heads, through the cache."""
    layer = make_layer('falcon2', device, use_short_conv=False, use_gate=False, qk_norm='l2', num_v_heads=4,
                       gate_param='step')
    x = torch.randn(1, 6, HIDDEN, device=device)
    with torch.no_grad():
        ref, _, _ = run(layer, x)
        cache = Cache()
        outs = [run(layer, x[:, :2], past_key_values=cache, use_cache=True)[0]]
        outs += [run(layer, x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(2, 6)]
    assert cache[0]['conv_state'] is None
    assert_close('decode', ref, torch.cat(outs, 1), TOL)


def test_cache_reorder_beams(device):
    """fla's Cache.reorder_cache maps the FalconState (as a tuple) and decoding continues correctly."""
    layer = make_layer('falcon3', device, window=3)
    x = torch.randn(3, 7, HIDDEN, device=device)
    perm = torch.tensor([2, 0, 0], device=device)
    with torch.no_grad():
        ref, _, _ = run(layer, x[perm])
        cache = Cache()
        run(layer, x[:, :5], past_key_values=cache, use_cache=True)
        cache.reorder_cache(perm)
        out = [run(layer, x[perm, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in (5, 6)]
    assert_close('beam', ref[:, 5:], torch.cat(out, 1), TOL)


@pytest.mark.parametrize('rule', ['falcon2', 'falcon3a'])
def test_left_padding_equals_unpadded(rule, device):
    layer = make_layer(rule, device, gate_param='step')
    lens = [7, 4, 1]
    T = max(lens)
    xs = [torch.randn(1, n, HIDDEN, device=device) for n in lens]
    x = torch.cat([torch.cat([torch.zeros(1, T - n, HIDDEN, device=device), xi], 1) for n, xi in zip(lens, xs)])
    mask = torch.tensor([[0] * (T - n) + [1] * n for n in lens], device=device)
    with torch.no_grad():
        o, _, _ = run(layer, x, attention_mask=mask)
        for i, (n, xi) in enumerate(zip(lens, xs)):
            ref, _, _ = run(layer, xi)
            assert_close(f'seq{i}', ref[0], o[i, T - n:], TOL)
            assert (o[i, :T - n] == 0).all()


@pytest.mark.parametrize('rule', ['falcon1', 'falcon3'])
def test_varlen_equals_separate(rule, device):
    layer = make_layer(rule, device, gate_param='step', window=2 if rule == 'falcon3' else None).train()
    lens = [5, 1, 6]
    xs = [torch.randn(1, n, HIDDEN, device=device) for n in lens]
    packed = torch.cat(xs, 1).requires_grad_()
    cu = torch.tensor([0, 5, 6, 12], device=device)
    o, _, _ = run(layer, packed, cu_seqlens=cu)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    refs = []
    for xi in xs:
        refs.append(run(layer, xi)[0])
    torch.cat(refs, 1).mul(do).sum().backward()
    assert_close('o', torch.cat(refs, 1), o, TOL)
    for n, p in layer.named_parameters():
        assert_close(n, p.grad, grads[n], TOL)


def test_falcon3_window1_is_falcon1(device):
    """Rule identity through the whole layer: falcon3 with B = 1 is falcon1 (same parameters)."""
    l1 = make_layer('falcon1', device)
    l3 = make_layer('falcon3', device, window=1)
    l3.load_state_dict(l1.state_dict())
    x = torch.randn(2, 8, HIDDEN, device=device)
    with torch.no_grad():
        assert_close('o', run(l1, x)[0], run(l3, x)[0], TOL)


def test_step_param_realizes_eta(device):
    """gate_param='step': beta / (||x_t||^2 + lam + eps) is the emitted step eta when it is small."""
    layer = make_layer('falcon1', device, gate_param='step')
    with torch.no_grad():
        layer.eta_bias.fill_(-8.0)    # tiny steps: the saturation is inactive
        x = torch.randn(1, 6, HIDDEN, device=device)
        k = layer.k_norm(layer.k_conv1d(layer.k_proj(x))[0].view(1, 6, 2, 8))
        beta, lam = layer._gates(x, k, None, None)
        energy = torch.cat([torch.zeros(1, 1, 2, device=device), k[:, :-1].pow(2).sum(-1)], 1)
        eta = torch.nn.functional.softplus(layer.b_proj(x) + layer.eta_bias) / layer.energy_ref
    assert ((beta > 0) & (beta < 2)).all()
    assert_close('eta', eta[:, 1:], (beta / (energy + lam + layer.eps))[:, 1:], 1e-3)


def test_gain_range_and_init(device):
    layer = make_layer('falcon2a', device)
    x = torch.randn(2, 5, HIDDEN, device=device)
    with torch.no_grad():
        beta, lam = layer._gates(x, None, None, None)
    assert beta.shape == (2, 5, 2, 8) and lam.shape == (2, 5, 2)
    assert ((beta > 0) & (beta < 2)).all() and (lam >= 0).all()


def test_resolver_falls_back(monkeypatch):
    calls = []

    def fake_fused(*args, **kwargs):
        calls.append(kwargs['rule'])
        return falcon_ops.naive_recurrent_falcon(*args, **kwargs)
    fake_fused.supported_rules = ('falcon1',)
    monkeypatch.setattr(falcon_ops, 'fused_recurrent_falcon', fake_fused, raising=False)
    monkeypatch.delattr(falcon_ops, 'chunk_falcon', raising=False)
    monkeypatch.setattr(falcon_net_module, '_warned', set())
    with pytest.warns(UserWarning, match="falling back to 'fused_recurrent'"):
        assert resolve_falcon_kernel('chunk', 'falcon1') == ('fused_recurrent', fake_fused)
    with pytest.warns(UserWarning, match="falling back to 'naive'"):
        assert resolve_falcon_kernel('fused_recurrent', 'falcon2')[0] == 'naive'
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # warned once only
        resolve_falcon_kernel('fused_recurrent', 'falcon2')
    # on DEVICE: fla's own Triton modules in the layer (short convolution, norms) cannot take CPU tensors on
    # a machine with a GPU, where Triton compiles for the GPU instead of interpreting
    layer = make_layer('falcon1')
    with torch.no_grad():
        run(layer, torch.randn(1, 3, HIDDEN, device=DEVICE))
    assert calls == ['falcon1']
    with pytest.raises(ValueError, match='mode'):
        resolve_falcon_kernel('parallel', 'falcon1')


def test_kernel_not_implemented_falls_back(monkeypatch):
    """A kernel raising NotImplementedError for some option hands over to the next one."""
    def refusing(*args, **kwargs):
        raise NotImplementedError('shift=False')
    monkeypatch.setattr(falcon_ops, 'chunk_falcon', refusing, raising=False)
    monkeypatch.delattr(falcon_ops, 'fused_recurrent_falcon', raising=False)
    monkeypatch.setattr(falcon_net_module, '_warned', set())
    layer = make_layer('falcon1').train()
    x = torch.randn(1, 4, HIDDEN, device=DEVICE)
    with pytest.warns(UserWarning, match="falling back to 'naive'"):
        o, _, _ = layer(x)
    assert o.shape == x.shape


@pytest.mark.parametrize('kwargs,match', [
    (dict(attn_mode='falcon4'), 'attn_mode'),
    (dict(attn_mode='chunk'), 'attn_mode'),
    (dict(attn_mode='falcon3', window=0), 'window'),
    (dict(attn_mode='falcon1', window=4), 'window'),
    (dict(attn_mode='falcon2a', window=2), 'window'),
    (dict(num_heads=2, num_v_heads=3), 'num_v_heads'),
    (dict(expand_v=0.3), 'expand_v'),
    (dict(qk_norm='layer'), 'qk_norm'),
    (dict(gate_param='beta'), 'gate_param'),
    (dict(mode='parallel'), 'mode'),
    (dict(allow_neg_eigval=True), 'allow_neg_eigval'),
])
def test_bad_arguments(kwargs, match):
    opts = dict(hidden_size=HIDDEN, head_dim=8, num_heads=2)
    opts.update(kwargs)
    with pytest.raises(ValueError, match=match):
        FalconNet(**opts)


def test_defaults_match_gated_deltanet():
    """Every GatedDeltaNet constructor argument is accepted with the same default."""
    import inspect

    from fla.layers import GatedDeltaNet
    ours = inspect.signature(FalconNet.__init__).parameters
    for name, p in inspect.signature(GatedDeltaNet.__init__).parameters.items():
        assert name in ours, name
        assert ours[name].default == p.default, name
    layer = FalconNet(hidden_size=HIDDEN, head_dim=8, num_heads=2, attn_mode='falcon3a')
    assert layer.window == 4 and layer.head_v_dim == 16 and layer.num_v_heads == 2


@pytest.mark.gpu
@pytest.mark.parametrize('rule', RULES)
def test_bf16_forward_backward(rule):
    layer = make_layer(rule, 'cuda').train().to(torch.bfloat16)
    x = torch.randn(2, 40, HIDDEN, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    o, _, _ = run(layer, x)
    o.float().sum().backward()
    assert torch.isfinite(o).all() and torch.isfinite(x.grad).all()
