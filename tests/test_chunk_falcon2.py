# -*- coding: utf-8 -*-
"""chunk_falcon(rule='falcon2') (Triton, per-column delta rule) vs naive_recurrent_falcon(rule='falcon2')
(fp64 autograd): outputs, final state and every gradient."""

import pytest
import test_chunk as base
import torch
from fla.utils import assert_close
from test_chunk import RATIO, SAME_OP_RATIO, check

from fla_falcon import FalconState
from fla_falcon.ops.falcon import chunk_col
from fla_falcon.ops.falcon.chunk import chunk_falcon
from fla_falcon.ops.falcon.naive import naive_recurrent_falcon


def chunk_falcon2(*args, **kwargs):
    return chunk_falcon(*args, rule='falcon2', **kwargs)


def make_inputs(*args, **kwargs):
    """test_chunk's inputs for falcon2 (per-column gains [B, T, HV, V])."""
    return base.make_inputs('falcon2', *args, **kwargs)


def run_both(*args, **kwargs):
    """test_chunk's comparison (outputs, final state, every gradient) for falcon2."""
    return base.run_both('falcon2', *args, **kwargs)


@pytest.mark.parametrize('chunk_size', [16, 64])
@pytest.mark.parametrize('T', [1, 48, 63, 65, 130])
def test_lengths(T, chunk_size, device):
    # grouped value heads (HV = 2H), one fresh and one continued sequence; T = 48 ends on a substitution block's
    # edge inside a chunk of 64 (the chunk's last block has no rows)
    inputs = make_inputs(2, T, 1, 2, 16, 16, 'on', True, device)
    check(run_both(*inputs, torch.float32, chunk_size=chunk_size), torch.float32)


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('lam_mode', ['off', 'on', 'coupled'])
def test_options(lam_mode, shift, device):
    inputs = make_inputs(1, 40, 2, 1, 16, 16, lam_mode, True, device, seed=2)
    check(run_both(*inputs, torch.float32, lam_mode=lam_mode, shift=shift, chunk_size=16), torch.float32)


def test_no_initial_state(device):
    inputs = make_inputs(1, 50, 1, 1, 16, 16, 'on', False, device, seed=4)
    check(run_both(*inputs, torch.float32, chunk_size=32), torch.float32)


@pytest.mark.parametrize('chunk_size', [16, 64])
def test_clamp_active(chunk_size, device):
    # lam >> ||x||^2 and beta near 2: eta*lam hits 1 - eps_gamma for many (token, column) pairs
    inputs = make_inputs(1, 40, 1, 1, 16, 16, 'on', True, device, lam_scale=1e4, beta_range=(1.5, 1.99999))
    eta_lam = inputs[3] * inputs[4][..., None] / (inputs[1].square().sum(-1)[..., None] + inputs[4][..., None])
    assert (eta_lam > 1 - 1e-4).any()
    check(run_both(*inputs, torch.float32, chunk_size=chunk_size), torch.float32)


def test_clamp_active_varlen(device):
    # sequences ending inside a chunk after log-decays far below -88: the rows past their end must stay
    # out of the sub-chunk factors (exp overflow, then 0 * inf)
    cu = torch.tensor([0, 23, 70], device=device)
    inputs = make_inputs(1, 70, 1, 1, 16, 16, 'on', True, device, cu_seqlens=cu, lam_scale=1e4,
                         beta_range=(1.5, 1.99999))
    check(run_both(*inputs, torch.float32, cu_seqlens=cu, chunk_size=32), torch.float32)


def test_odd_head_dims(device):
    # K, V not powers of two, V over more than one value block, 32-row chunks
    inputs = make_inputs(1, 40, 1, 2, 24, 80, 'on', True, device, seed=3)
    check(run_both(*inputs, torch.float32, chunk_size=32), torch.float32)


def test_zero_keys(device):
    # x = 0 rows: with eps = 0 and no ridge the denominator is 0 and eta := 0 (no write, no decay)
    q, k, v, beta, lam, state = make_inputs(1, 40, 1, 1, 16, 16, 'off', True, device)
    k[:, 5:9] = 0
    k[:, 20] = 0
    check(run_both(q, k, v, beta, None, state, torch.float32, chunk_size=16, eps=0.0), torch.float32)


@pytest.mark.parametrize('shift', [True, False])
def test_varlen(shift, device):
    cu = torch.tensor([0, 1, 20, 20, 57, 90], device=device)
    inputs = make_inputs(1, 90, 1, 2, 16, 16, 'on', True, device, cu_seqlens=cu)
    check(run_both(*inputs, torch.float32, shift=shift, cu_seqlens=cu, chunk_size=16), torch.float32)


@pytest.mark.parametrize('final', [True, False])
@pytest.mark.parametrize('end_in_dhu', [True, False])
def test_end_terms_either_kernel(end_in_dhu, final, monkeypatch, device):
    # the decay gradient's end terms come from _bwd_dhu_delta_col (END) or from _bwd_col_gates, chosen by the
    # sequential kernel's program count against the GPU's multiprocessors (always END under the CPU interpreter):
    # both paths, with and without a final-state gradient, over varlen sequences that end inside a chunk
    calls = []
    monkeypatch.setattr(chunk_col, '_end_in_dhu', lambda programs, dev: calls.append(programs) or end_in_dhu)
    cu = torch.tensor([0, 37, 37, 90], device=device)
    inputs = make_inputs(1, 90, 1, 2, 16, 40, 'on', True, device, cu_seqlens=cu, seed=6)
    check(run_both(*inputs, torch.float32, cu_seqlens=cu, chunk_size=16, final=final), torch.float32)
    assert calls == [3 * 2 * 2]   # sequences x value heads x 32-wide value blocks


def test_fp64_inputs(device):
    # fp64 inputs are computed in fp32; o and the final state come back in fp64
    q, k, v, beta, lam, state = (t.double() if isinstance(t, torch.Tensor) else t
                                 for t in make_inputs(1, 20, 1, 1, 16, 16, 'on', False, device))
    o, fs = chunk_falcon2(q, k, v, beta, lam, output_final_state=True, chunk_size=16)
    ro, rfs = naive_recurrent_falcon(q, k, v, beta, lam, rule='falcon2', output_final_state=True)
    assert o.dtype == fs.S.dtype == torch.float64
    assert_close('o', ro, o, RATIO[torch.float32])
    assert_close('S', rfs.S, fs.S, RATIO[torch.float32])


@pytest.mark.parametrize('shift', [True, False])
def test_segments(shift, device):
    """Two segments with the carried state give the outputs and final state of one pass."""
    q, k, v, beta, lam, _ = make_inputs(2, 70, 1, 1, 16, 16, 'on', False, device)
    kw = dict(output_final_state=True, chunk_size=16, shift=shift)
    o, fs = chunk_falcon2(q, k, v, beta, lam, **kw)
    o1, fs1 = chunk_falcon2(q[:, :33], k[:, :33], v[:, :33], beta[:, :33], lam[:, :33], **kw)
    o2, fs2 = chunk_falcon2(q[:, 33:], k[:, 33:], v[:, 33:], beta[:, 33:], lam[:, 33:], initial_state=fs1, **kw)
    assert_close('o', o, torch.cat([o1, o2], 1), SAME_OP_RATIO[device])
    for name, a, b in zip(FalconState._fields, fs, fs2):
        assert a.shape == b.shape, name
        if a.numel():
            assert_close(name, a.double(), b.double(), SAME_OP_RATIO[device])


def test_equal_gains_is_falcon1(device):
    """falcon2 with the same gain in every value column is falcon1 (outputs, state, gradients)."""
    torch.manual_seed(5)
    q, k, v, _, lam, state = make_inputs(1, 40, 1, 1, 16, 16, 'on', True, device)
    beta = torch.rand(1, 40, 1, device=device) * 1.8 + 0.1
    outs = []
    for rule in ('falcon1', 'falcon2'):
        xs = [t.clone().requires_grad_() for t in (q, k, v, beta, lam)]
        if rule == 'falcon2':
            o, fs = chunk_falcon2(xs[0], xs[1], xs[2], xs[3][..., None].expand(*beta.shape, 16), xs[4],
                                  initial_state=state, output_final_state=True, chunk_size=32)
        else:
            o, fs = chunk_falcon(*xs, rule=rule, initial_state=state, output_final_state=True, chunk_size=32)
        (o.sum() + fs.S.square().sum()).backward()
        outs.append([o, fs.S] + [t.grad for t in xs])
    for name, a, b in zip(['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam'], *outs):
        assert_close(name, a.double(), b.double(), SAME_OP_RATIO[device])


def test_bad_args(device):
    q, k, v, beta, lam, _ = make_inputs(1, 8, 1, 1, 16, 16, 'on', False, device)
    with pytest.raises(ValueError, match='chunk_size'):
        chunk_falcon2(q, k, v, beta, lam, chunk_size=48)
    with pytest.raises(ValueError, match='beta'):
        chunk_falcon2(q, k, v, beta[..., 0], lam)
    with pytest.raises(ValueError, match='lam_coupled'):
        chunk_falcon2(q, k, v, beta, None, lam_coupled=True)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gpu_long(dtype, device):
    inputs = make_inputs(2, 1000, 2, 2, 64, 64, 'on', True, device)
    check(run_both(*inputs, dtype), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gpu_heads128_varlen(dtype, device):
    cu = torch.tensor([0, 100, 611, 1000], device=device)
    inputs = make_inputs(1, 1000, 2, 1, 128, 128, 'coupled', True, device, cu_seqlens=cu)
    check(run_both(*inputs, dtype, lam_mode='coupled', cu_seqlens=cu), dtype)
