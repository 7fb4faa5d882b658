# -*- coding: utf-8 -*-
"""chunk_falcon (Triton) vs naive_recurrent_falcon (fp64 autograd): outputs, final state and every gradient."""

import pytest
import torch
from conftest import DEVICE
from fla.utils import assert_close

from fla_falcon import FalconState
from fla_falcon.ops.falcon.chunk import SUPPORTED_RULES, chunk_falcon
from fla_falcon.ops.falcon.naive import naive_recurrent_falcon

# fp32 matmuls run in tf32 on the GPU
RATIO = {torch.float32: 5e-3 if DEVICE == 'cuda' else 1e-4, torch.bfloat16: 2e-2}
# the generic tests run the windowed rules with this window; their own tests cover the others (falcon3a below)
WINDOW = {'falcon3a': 3, 'falcon3': 3}
# rules whose length/varlen grid runs in the generic tests (the windowed ones have their own, per window)
BASE_RULES = tuple(r for r in SUPPORTED_RULES if r not in WINDOW)


def win(rule):
    return WINDOW.get(rule, 1)


def make_inputs(rule, B, T, H, G, K, V, lam_mode, init, device, seed=0, cu_seqlens=None, lam_scale=2.0,
                beta_range=(0.1, 1.9), window=1):
    torch.manual_seed(seed)
    HV = H * G
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q = torch.randn(B, T, H, K, device=device)
    k = torch.randn(B, T, H, K, device=device)
    v = torch.randn(B, T, HV, V, device=device)
    lo, hi = beta_range
    per_col = rule.startswith('falcon2')
    beta = torch.rand(B, T, HV, *((V,) if per_col else ()), device=device) * (hi - lo) + lo
    lam = None if lam_mode == 'off' else torch.rand(B, T, HV, device=device) * lam_scale
    if lam_mode == 'coupled':
        lam = lam * 0.5
    state = None
    if init:
        # seen and fresh; windowed: a full tail, a fresh state, a partial tail (rows before the real
        # pairs are random too: the ops must ignore them)
        counts = [1, 0] if window == 1 else [window, 0, 2]
        count = torch.tensor([counts[n % len(counts)] for n in range(N)], dtype=torch.int32, device=device)
        state = FalconState(0.1 * torch.randn(N, HV, K, V, device=device), torch.randn(N, H, K, device=device),
                            torch.randn(N, H, window - 1, K, device=device),
                            torch.randn(N, HV, window - 1, V, device=device), count)
    return q, k, v, beta, lam, state


def run_both(rule, q, k, v, beta, lam, state, dtype, lam_mode='on', shift=True, cu_seqlens=None, chunk_size=64,
             seed=1, eps=1e-6, window=1, final=True, eps_gamma=None, disable_recompute=False):
    """Runs both ops with the same upstream gradients; returns [(name, ref, tri)]. final=False: no final state
    (output_final_state=False), the loss reads the outputs only. disable_recompute: chunk_falcon's."""
    leaves = {'q': q, 'k': k, 'v': v, 'beta': beta}
    if lam is not None:
        leaves['lam'] = lam
    state_leaves = ('S0', 'last_k', 'tail_x', 'tail_v')
    if state is not None:
        leaves['S0'], leaves['last_k'] = state.S, state.last_k
        if window > 1:
            leaves['tail_x'], leaves['tail_v'] = state.tail_x, state.tail_v
    kw = dict(rule=rule, lam_coupled=lam_mode == 'coupled', shift=shift, output_final_state=final,
              cu_seqlens=cu_seqlens, eps=eps, window=window)
    if eps_gamma is not None:
        kw['eps_gamma'] = eps_gamma
    results = {}
    for name, cast in (('ref', torch.float64), ('tri', dtype)):
        # the reference sees the same (rounded) inputs; the state stays fp32 for the kernel
        xs = {n: (t.detach().to(dtype).to(cast) if n not in state_leaves else
                  t.detach().to(torch.float64 if name == 'ref' else torch.float32)).requires_grad_()
              for n, t in leaves.items()}
        st = None
        if state is not None:
            st = FalconState(xs['S0'], xs['last_k'], xs.get('tail_x', state.tail_x.to(xs['S0'].dtype)),
                             xs.get('tail_v', state.tail_v.to(xs['S0'].dtype)), state.count)
        args = (xs['q'], xs['k'], xs['v'], xs['beta'], xs.get('lam'))
        if name == 'ref':
            o, fs = naive_recurrent_falcon(*args, initial_state=st, **kw)
        else:
            o, fs = chunk_falcon(*args, initial_state=st, chunk_size=chunk_size, disable_recompute=disable_recompute,
                                 **kw)
        assert o.dtype == xs['v'].dtype
        g = torch.Generator(device='cpu').manual_seed(seed)
        do = torch.randn(o.shape, generator=g).to(o.device, torch.float64)
        if not final:
            assert fs is None
            (o.double() * do).sum().backward()
            results[name] = [('o', o)] + [(f'd{n}', t.grad if t.grad is not None else torch.zeros_like(t))
                                          for n, t in xs.items()]
            continue
        dS = torch.randn(fs.S.shape, generator=g).to(o.device, torch.float64)
        loss = (o.double() * do).sum() + (fs.S.double() * dS).sum() + fs.last_k.double().sum()
        if window > 1:   # the final window tail is differentiable too (an indexing of k, v and the old tail)
            dtx = torch.randn(fs.tail_x.shape, generator=g).to(o.device, torch.float64)
            dtv = torch.randn(fs.tail_v.shape, generator=g).to(o.device, torch.float64)
            loss = loss + (fs.tail_x.double() * dtx).sum() + (fs.tail_v.double() * dtv).sum()
        loss.backward()
        # a leaf that does not reach the loss has no gradient: compare it as zeros
        tails = [('tail_x_T', fs.tail_x), ('tail_v_T', fs.tail_v)] if window > 1 else []
        results[name] = [('o', o), ('S', fs.S), ('last_k_T', fs.last_k)] + tails + [
            (f'd{n}', t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in xs.items()]
        results[name + '_count'] = fs.count
    if final:
        assert torch.equal(results['ref_count'].cpu(), results['tri_count'].cpu())
    return [(n, r.detach().double(), t.detach().double()) for (n, r), (_, t) in zip(results['ref'], results['tri'])]


def check(pairs, dtype):
    for name, ref, tri in pairs:
        assert torch.isfinite(tri).all(), name
        assert_close(name, ref, tri, RATIO[dtype])


@pytest.mark.parametrize('chunk_size', [16, 64])
@pytest.mark.parametrize('T', [1, 63, 64, 65, 130])
@pytest.mark.parametrize('rule', BASE_RULES)
def test_lengths(rule, T, chunk_size, device):
    inputs = make_inputs(rule, 2, T, 1, 2, 16, 16, 'on', True, device)
    check(run_both(rule, *inputs, torch.float32, chunk_size=chunk_size), torch.float32)


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('lam_mode', ['off', 'on', 'coupled'])
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_options(rule, lam_mode, shift, device):
    inputs = make_inputs(rule, 1, 40, 2, 1, 16, 16, lam_mode, True, device, seed=2, window=win(rule))
    check(run_both(rule, *inputs, torch.float32, lam_mode=lam_mode, shift=shift, chunk_size=16, window=win(rule)),
          torch.float32)


@pytest.mark.parametrize('chunk_size', [16, 64])
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_clamp_active(rule, chunk_size, device):
    # lam >> ||x||^2 and beta near 2: eta*lam hits 1 - eps_gamma for many tokens, so the log-decay
    # inside a chunk falls far below -88; with chunk size 64 the last chunk is partial (T = 40) and its
    # padded rows (G = 0) must never meet a real row in one exponent (falcon2a's NaN gradients, fixed)
    if rule == 'falcon3' and chunk_size != 64:
        pytest.skip("falcon3's chunks are 64 virtual rows whatever chunk_size: the same run as chunk_size=64")
    inputs = make_inputs(rule, 1, 40, 1, 1, 16, 16, 'on', True, device, lam_scale=1e4, beta_range=(1.5, 1.99999),
                         window=win(rule))
    check(run_both(rule, *inputs, torch.float32, chunk_size=chunk_size, window=win(rule)), torch.float32)


@pytest.mark.parametrize('rule', ('falcon2a', 'falcon2'))
def test_col_strong_decay_bf16(rule, device):
    """Strong per-column decays with 16-bit inputs: G (the cumulative log-decay, read by most of the per-column
    kernels) grows large down a chunk while neighbouring rows' differences stay small, so a 16-bit G would show here
    (fp32 G: the final state's RMS error ~3.3e-3 against the fp64 reference on the CPU; G stored in fp16, whose error
    grows with |G|, gives ~9e-3)."""
    inputs = make_inputs(rule, 1, 256, 2, 1, 32, 32, 'on', True, device, lam_scale=40.0)
    pairs = dict((n, (r, t)) for n, r, t in run_both(rule, *inputs, torch.bfloat16))
    assert_close('S', *pairs['S'], 6e-3)
    assert_close('o', *pairs['o'], 1.5e-2)


@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_clamp_tiny_eps_gamma(rule, device):
    """eps_gamma below fp32's resolution under 1 (2^-25): 1 - eps_gamma rounds to 1, so the clamped decay's
    log(1 - alpha) was -inf and the outputs NaN; the decay at the clamp is eps_gamma itself, as in the reference."""
    inputs = make_inputs(rule, 1, 40, 1, 1, 16, 16, 'on', True, device, lam_scale=1e4, beta_range=(1.5, 1.99999),
                         window=win(rule))
    check(run_both(rule, *inputs, torch.float32, chunk_size=16, window=win(rule), eps_gamma=1e-10), torch.float32)


@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_odd_head_dims(rule, device):
    # K, V not powers of two, V over more than one value block
    inputs = make_inputs(rule, 1, 40, 1, 2, 24, 80, 'on', True, device, seed=3, window=win(rule))
    check(run_both(rule, *inputs, torch.float32, chunk_size=32, window=win(rule)), torch.float32)


@pytest.mark.parametrize('key_block', (32, 64))
@pytest.mark.parametrize('rule', ('falcon1a', 'falcon2a', 'falcon3a'))
def test_state_key_blocks(rule, key_block, device, monkeypatch):
    # few (sequence, head) programs: the sequential state kernels of the rules without a delta term split the key
    # dimension (K = 80: blocks of 32, the third one partial and the fourth one past K, or of 64, the second one
    # partial), with varlen, an initial state and a window tail
    from fla_falcon.ops.falcon import chunk as chunk_mod
    split = chunk_mod._state_key_block
    assert split(128, 2, 80, False) == 32 and split(128, 2, 80, True) == 128
    assert split(128, 16, 128, False) == 64 and split(128, 32, 128, False) == 128
    # 2 sequences x 2 value heads, one value block: 4 programs a key block, 8 at key blocks of 64
    monkeypatch.setattr(chunk_mod, 'STATE_PROGRAMS', 8 if key_block == 64 else 64)
    assert split(128, 4, 24, False) == key_block
    cu = torch.tensor([0, 30, 75], device=device)
    inputs = make_inputs(rule, 1, 75, 1, 2, 80, 24, 'on', True, device, seed=4, cu_seqlens=cu, window=win(rule))
    check(run_both(rule, *inputs, torch.float32, cu_seqlens=cu, chunk_size=16, window=win(rule)), torch.float32)


def _state_kernel_configs():
    """(rule, sequential state kernels, config) for every value-block width of their autotune lists: on a GPU the
    tests run whichever config the autotuner picks for their shape, so the others are checked here, one at a time."""
    import fla_falcon.ops.falcon.chunk as ch
    import fla_falcon.ops.falcon.chunk_col as col
    cases = []
    for rule, kernels, configs in (('falcon1', 'fwd_h bwd_dhu', ch.CONFIGS_H),
                                   ('falcon3a', 'fwd_h bwd_dhu', ch.CONFIGS_H),
                                   ('falcon2', 'fwd_h_delta_col bwd_dhu_delta_col', col.CONFIGS_COL_H)):
        seen = set()
        for cfg in configs:
            # the interpreter runs every config the same but for its block sizes
            tag = (cfg.kwargs['BV'],)
            if DEVICE == 'cuda':
                tag += (cfg.num_warps, cfg.num_stages)
            if tag not in seen:
                seen.add(tag)
                cases.append(pytest.param(rule, kernels, cfg, id=f"{rule}-{tag}"))
    return cases


@pytest.mark.parametrize('rule, kernels, cfg', _state_kernel_configs())
def test_state_kernel_configs(rule, kernels, cfg, device, monkeypatch):
    # V = 40: one, two or three value blocks (the last one partial) at BV = 64, 32, 16; falcon2: 64-row chunks of four
    # 16-row substitution blocks, T = 100 ending in a partial block (96-99) and one past the end (112-127)
    import fla_falcon.ops.falcon.chunk as ch
    import fla_falcon.ops.falcon.chunk_col as col
    patched = [getattr(ch if hasattr(ch, '_' + name) else col, '_' + name) for name in kernels.split()]
    for kernel in patched:
        monkeypatch.setattr(kernel, 'configs', [cfg])
        monkeypatch.setattr(kernel, 'best_config', None, raising=False)
    w = win(rule)
    T, chunk_size = (100, 64) if rule == 'falcon2' else (40, 16)
    inputs = make_inputs(rule, 1, T, 1, 2, 16, 40, 'on', True, device, seed=5, window=w)
    check(run_both(rule, *inputs, torch.float32, chunk_size=chunk_size, window=w), torch.float32)
    assert all(kernel.best_config is cfg for kernel in patched)   # the config under test is the one that ran


@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_zero_keys(rule, device):
    # x = 0 rows: with eps = 0 and no ridge the denominator is 0 and eta := 0 (no write, no decay)
    q, k, v, beta, lam, state = make_inputs(rule, 1, 40, 1, 1, 16, 16, 'off', True, device, window=win(rule))
    k[:, 5:9] = 0
    k[:, 20] = 0
    pairs = run_both(rule, q, k, v, beta, None, state, torch.float32, chunk_size=16, eps=0.0, window=win(rule))
    check(pairs, torch.float32)


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('rule', BASE_RULES)
def test_varlen(rule, shift, device):
    cu = torch.tensor([0, 1, 20, 20, 57, 90], device=device)
    inputs = make_inputs(rule, 1, 90, 1, 2, 16, 16, 'on', True, device, cu_seqlens=cu)
    check(run_both(rule, *inputs, torch.float32, shift=shift, cu_seqlens=cu, chunk_size=16), torch.float32)


@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_without_final_state(rule, device):
    """output_final_state=False: the backward gets no final-state gradient (dht None), so the kernels must not
    read the final state (the per-column rules' decay gradient takes its last-chunk term from it when given)."""
    cu = torch.tensor([0, 20, 57, 90], device=device)
    inputs = make_inputs(rule, 1, 90, 1, 2, 16, 16, 'on', True, device, cu_seqlens=cu, window=win(rule))
    check(run_both(rule, *inputs, torch.float32, cu_seqlens=cu, chunk_size=16, window=win(rule), final=False),
          torch.float32)


# two fp32 kernel runs that should agree: exactly up to rounding on the CPU, up to TF32 matmul
# rounding (different chunk boundaries / different kernels) on the GPU
SAME_OP_RATIO = {'cpu': 1e-5, 'cuda': 2e-3}


@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_segments(rule, device):
    """Segments with the carried state give the outputs and final state of one pass (the middle
    segment is shorter than falcon3a's window: its tail carries pairs of the first one)."""
    q, k, v, beta, lam, _ = make_inputs(rule, 2, 70, 1, 1, 16, 16, 'on', False, device)
    kw = dict(rule=rule, output_final_state=True, chunk_size=16, window=win(rule))
    o, fs = chunk_falcon(q, k, v, beta, lam, **kw)
    outs, st = [], None
    for a, b in ((0, 33), (33, 34), (34, 70)):
        o_i, st = chunk_falcon(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], lam[:, a:b], initial_state=st, **kw)
        outs.append(o_i)
    fs2 = st
    assert_close('o', o, torch.cat(outs, 1), SAME_OP_RATIO[device])
    for name, a, b in zip(FalconState._fields, fs, fs2):
        assert a.shape == b.shape, name
        if a.numel():
            assert_close(name, a.double(), b.double(), SAME_OP_RATIO[device])


def test_falcon2a_equal_gains_is_falcon1a(device):
    """falcon2a with the same gain in every value column is falcon1a (outputs, state, gradients)."""
    q, k, v, beta, lam, state = make_inputs('falcon1a', 1, 40, 1, 1, 16, 16, 'on', True, device)
    outs = []
    for rule in ('falcon1a', 'falcon2a'):
        xs = [t.clone().requires_grad_() for t in (q, k, v, beta, lam)]
        b = xs[3][..., None].expand(*beta.shape, 16) if rule == 'falcon2a' else xs[3]
        o, fs = chunk_falcon(xs[0], xs[1], xs[2], b, xs[4], rule=rule, initial_state=state,
                             output_final_state=True, chunk_size=32)
        (o.sum() + fs.S.square().sum()).backward()
        outs.append([o, fs.S] + [t.grad for t in xs])
    for name, a, b in zip(['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam'], *outs):
        assert_close(name, a.double(), b.double(), SAME_OP_RATIO[device])


@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_recompute_matches_saved(rule, device):
    """By default the backward recomputes the forward's intermediates from the inputs (as fla's chunk ops do);
    disable_recompute=True keeps them from the forward. Both run the same kernels on the same inputs: the same bits in
    every output and gradient. And by default no chunk-start state ([chunks, HV, K, V]) is held for the backward, and
    fewer bytes in all."""
    cu = torch.tensor([0, 23, 70], device=device)
    N, K, V = 2, 16, 16
    q, k, v, beta, lam, st = make_inputs(rule, 1, 70, 1, 2, K, V, 'on', True, device, cu_seqlens=cu,
                                         window=win(rule))
    g = torch.Generator(device='cpu').manual_seed(5)
    do, dS = torch.randn(v.shape, generator=g).to(device), torch.randn(st.S.shape, generator=g).to(device)
    runs, states, held = {}, {}, {}
    for keep in (True, False):
        xs = [t.clone().requires_grad_() for t in (q, k, v, beta, lam)]
        S0 = st.S.clone().requires_grad_()
        state = FalconState(S0, st.last_k, st.tail_x, st.tail_v, st.count)
        packed = []

        def pack(t):
            packed.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, fs = chunk_falcon(*xs, rule=rule, window=win(rule), initial_state=state, output_final_state=True,
                                 cu_seqlens=cu, chunk_size=16, disable_recompute=keep)
        grads = torch.autograd.grad((o * do).sum() + (fs.S * dS).sum(), xs + [S0])
        runs[keep] = [o, fs.S] + list(grads)
        # tensors of per-chunk states held for the backward (S0 and the final state have N rows)
        states[keep] = [tuple(t.shape) for t in packed if t.dim() == 4 and t.shape[-2:] == (K, V) and t.shape[0] > N]
        held[keep] = sum(t.numel() * t.element_size() for t in {id(t): t for t in packed}.values())
    for name, a, b in zip(['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0'], runs[True], runs[False]):
        assert torch.equal(a, b), name
    assert states[True], "disable_recompute=True: the chunk-start states should be among the saved tensors"
    assert not states[False], f"the default should hold no chunk-start states for the backward: {states[False]}"
    assert held[False] < held[True], held


class _DeferredFork:
    """A stand-in for chunk.py's _Fork that runs the forked launch only at the join, after filling the chunk-start
    states it was handed ([chunks, HV, K, V], more rows than sequences) with NaN: a kernel that reads the states, or
    anything the launch writes, before the join reads NaN or nothing."""
    made = []
    n_seq = 1   # the test's sequences: the states of the sequences' ends (S0, the final state) are left alone

    def __init__(self, device):
        self.pending, self.launched, self.joins = None, False, 0
        _DeferredFork.made.append(self)

    def run(self, launch, tensors):
        assert self.pending is None and not self.launched, "one forked launch per backward"
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] > self.n_seq and t.is_floating_point():
                t.fill_(float('nan'))
        self.pending = launch

    def join(self):
        self.joins += 1
        if self.pending is not None:
            self.pending()
            self.pending, self.launched = None, True


@pytest.mark.parametrize('rule,end', [(r, None) for r in SUPPORTED_RULES if r != 'falcon2']
                         + [('falcon2', False), ('falcon2', True)])
def test_recompute_fork_joins_before_the_states_are_read(rule, end, device, monkeypatch):
    """The recomputing backward with its state pass forked (OVERLAP_RECOMPUTE) gives the bits of the kept
    intermediates' backward when the forked launch only runs at the join (_DeferredFork): every kernel that reads the
    states, or falcon2's residual, runs after the join. falcon2 both ways: its state gradients read the states where
    they form the decay gradient's end terms (END, chunk_col._end_in_dhu), and then join first."""
    from fla_falcon.ops.falcon import chunk as chunk_mod
    from fla_falcon.ops.falcon import chunk_col
    cu = torch.tensor([0, 23, 150], device=device)
    q, k, v, beta, lam, st = make_inputs(rule, 1, 150, 1, 2, 16, 16, 'on', True, device, cu_seqlens=cu,
                                         window=win(rule))
    g = torch.Generator(device='cpu').manual_seed(6)
    do, dS = torch.randn(v.shape, generator=g).to(device), torch.randn(st.S.shape, generator=g).to(device)
    # this test's forks only (a fork left by an earlier test in the same process must not answer for this one)
    monkeypatch.setattr(_DeferredFork, 'made', [])
    if end is not None:
        monkeypatch.setattr(chunk_col, '_end_in_dhu', lambda programs, dev: end)
        grads_fn = chunk_col._bwd_col_grads

        def grads_after_join(*args, **kwargs):
            # the kept backward forks nothing; the forked one must have run its state pass by now
            if chunk_mod._Fork is _DeferredFork:
                made = _DeferredFork.made
                assert made and made[-1].launched, "falcon2's gradients ran before the forked state pass"
            return grads_fn(*args, **kwargs)
        monkeypatch.setattr(chunk_col, '_bwd_col_grads', grads_after_join)
    monkeypatch.setattr(_DeferredFork, 'n_seq', len(cu) - 1)
    runs = {}
    for mode in ('kept', 'forked'):
        if mode == 'forked':
            assert not _DeferredFork.made, 'the kept backward forked'
            monkeypatch.setattr(chunk_mod, '_Fork', _DeferredFork)
            monkeypatch.setattr(chunk_mod, '_overlap_recompute', lambda *args: True)
        xs = [t.clone().requires_grad_() for t in (q, k, v, beta, lam)]
        S0 = st.S.clone().requires_grad_()
        state = FalconState(S0, st.last_k, st.tail_x, st.tail_v, st.count)
        o, fs = chunk_falcon(*xs, rule=rule, window=win(rule), initial_state=state, output_final_state=True,
                             cu_seqlens=cu, disable_recompute=mode == 'kept')
        runs[mode] = [o, fs.S] + list(torch.autograd.grad((o * do).sum() + (fs.S * dS).sum(), xs + [S0]))
    assert len(_DeferredFork.made) == 1, 'one fork per backward'
    fork = _DeferredFork.made[0]
    assert fork.launched and fork.joins >= 1
    for name, a, b in zip(['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0'], runs['kept'], runs['forked']):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_gpu_recompute_overlapped(rule, device, monkeypatch):
    """The recomputing backward's state pass runs on a second stream beside the state gradients (chunk.py's _Fork):
    the same bits as on one stream and as with the states kept, at a length where the two passes overlap for
    milliseconds (a missing join, or a buffer the second stream still reads handed out again, shows here)."""
    from fla_falcon.ops.falcon import chunk as chunk_mod
    cu = torch.tensor([0, 1000, 4096], device=device)
    q, k, v, beta, lam, st = make_inputs(rule, 1, 4096, 4, 1, 128, 128, 'on', True, device, cu_seqlens=cu,
                                         window=win(rule))
    xs = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v, beta, lam)]
    S0 = st.S.clone().requires_grad_()
    state = FalconState(S0, st.last_k, st.tail_x, st.tail_v, st.count)
    do = torch.randn(xs[2].shape, device=device, generator=torch.Generator(device=device).manual_seed(3))
    runs = {}
    for mode in ('overlap', 'one stream', 'kept'):
        monkeypatch.setattr(chunk_mod, 'OVERLAP_RECOMPUTE', mode == 'overlap')
        chunk_mod._SIDE_STREAMS.clear()
        o, fs = chunk_falcon(*xs, rule=rule, window=win(rule), initial_state=state, output_final_state=True,
                             cu_seqlens=cu, disable_recompute=mode == 'kept')
        runs[mode] = [o, fs.S] + list(torch.autograd.grad((o * do.to(o.dtype)).sum() + fs.S.sum(), xs + [S0]))
        assert bool(chunk_mod._SIDE_STREAMS) == (mode == 'overlap'), mode
    names = ['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0']
    for mode in ('one stream', 'kept'):
        differ = [name for name, a, b in zip(names, runs['overlap'], runs[mode]) if not torch.equal(a, b)]
        assert not differ, f"{rule}: overlapped recomputation against {mode}: {differ}"


@pytest.mark.parametrize('kernel_name,flag', [('_fwd_h', 'KT'), ('_bwd_dhu', 'QT')])
@pytest.mark.parametrize('rule', ['falcon1', 'falcon1a', 'falcon2a'])
def test_state_kernels_transposed_loads(rule, kernel_name, flag, device):
    """_fwd_h loads the keys, _bwd_dhu the queries and W, as [BK, BT] (KT / QT, the default), as the products take
    them; the transposed form (KT / QT = 0, benchmarks/sweep_configs.py) gives the same states, final state, state
    gradients and (falcon1) corrected values / dU, varlen, with an initial state whose last key is the first row's (the
    shifted key's only special case) in some sequences."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))
    import sweep_configs as sc
    cu = torch.tensor([0, 1, 70, 130], device=device)
    q, k, v, beta, lam, st = make_inputs(rule, 1, 130, 2, 1, 32, 32, 'on', True, device, cu_seqlens=cu)
    assert bool((st.count > 0).any()) and bool((st.count == 0).any())   # both cases of the first row
    xs = [t.requires_grad_() for t in (q, k, v, beta, lam)]

    def step():
        o, fs = chunk_falcon(*xs, rule=rule, initial_state=st, output_final_state=True, cu_seqlens=cu)
        torch.autograd.grad(o.square().sum() + fs.S.sum(), xs)

    kernel = sc.find_kernel(kernel_name)
    seen = sc.capture(kernel, step)
    rows = sc.run_configs(kernel, seen, [{}, {flag: 0}], time=False)
    tol = 1e-5 if device == 'cpu' else 1e-2   # (a GPU may order the fp32 sums otherwise: a bf16 state's last bit)
    assert rows[0]['outputs'] >= 2 and all(r['outputs'] == rows[0]['outputs'] for r in rows), rows
    assert all(r['max_rel_diff'] < tol for r in rows), rows
    # the comparison can fail: the same-step key (SHIFT = 0) is another state pass, and without the final state's
    # gradient another state gradient
    wrong = dict(SHIFT=0) if kernel_name == '_fwd_h' else dict(USE_FINAL_STATE_GRADIENT=0)
    assert sc.run_configs(kernel, seen, [{}, wrong], time=False)[1]['max_rel_diff'] > 1e-2


def test_overlap_recompute_decision(monkeypatch):
    """Which recomputing backwards fork their state pass: under 'auto' the delta rules (falcon1, falcon3: no key
    split) and falcon2a at few sequence-heads, where the fifty-third / fifty-fourth leases (H100) timed them 9-15%
    faster forked at (1, 16384, 16), and not falcon1a / falcon3a once their key split gives STATE_PROGRAMS programs
    (12-18% slower forked there); falcon2 only with fewer programs than multiprocessors (else its state gradients
    read the states); never off CUDA."""
    from fla_falcon.ops.falcon import chunk as chunk_mod
    from fla_falcon.ops.falcon import chunk_col
    decide = chunk_mod._overlap_recompute
    cuda, cpu = torch.device('cuda', 0), torch.device('cpu')
    monkeypatch.setattr(chunk_mod, 'OVERLAP_RECOMPUTE', 'auto')
    assert decide(cuda, True, False, 128, 128, 16)          # falcon1 / falcon3 at (B, H) = (1, 16): 32 programs
    assert not decide(cuda, True, False, 128, 128, 64)      # (4, 16): 128
    assert not decide(cuda, False, False, 128, 128, 16)     # falcon1a / falcon3a: K split to 64 programs
    assert not decide(cuda, False, False, 128, 128, 8)      # (to 32-wide key blocks: 64)
    assert decide(cuda, False, False, 128, 128, 4)          # ... unless even 32-wide key blocks leave too few
    assert decide(cuda, False, True, 128, 128, 16)          # falcon2a: 64 programs
    assert not decide(cuda, False, True, 128, 128, 64)      # (4, 16): 128
    # falcon2 (32-wide value blocks) on 132 multiprocessors: 64 programs fork, 256 form the end terms from the states
    monkeypatch.setattr(chunk_col, 'get_multiprocessor_count', lambda index: 132)
    assert decide(cuda, True, True, 128, 128, 16)
    assert not decide(cuda, True, True, 128, 128, 64)
    assert not decide(cpu, True, False, 128, 128, 16)
    monkeypatch.setattr(chunk_mod, 'OVERLAP_RECOMPUTE', True)
    assert decide(cuda, False, False, 128, 128, 64) and decide(cuda, True, True, 128, 128, 1)
    assert not decide(cuda, True, True, 128, 128, 64)       # (never where the state gradients read the states)
    assert not decide(cpu, False, False, 128, 128, 1)
    monkeypatch.setattr(chunk_mod, 'OVERLAP_RECOMPUTE', False)
    assert not decide(cuda, True, False, 128, 128, 1) and not decide(cuda, True, True, 128, 128, 16)


def test_unsupported_and_bad_args(device):
    q, k, v, beta, lam, _ = make_inputs('falcon1', 1, 8, 1, 1, 16, 16, 'on', False, device)
    for rule in ('falcon2', 'falcon2a', 'falcon3a'):
        if rule in SUPPORTED_RULES:
            continue
        b = beta[..., None].expand(*beta.shape, 16).contiguous() if rule.startswith('falcon2') else beta
        with pytest.raises(NotImplementedError, match=rule):
            chunk_falcon(q, k, v, b, lam, rule=rule)
    with pytest.raises(ValueError, match='chunk_size'):
        chunk_falcon(q, k, v, beta, lam, rule='falcon1', chunk_size=48)
    with pytest.raises(TypeError, match='disable_recompute'):
        chunk_falcon(q, k, v, beta, lam, rule='falcon1', disable_recompute='yes')
    with pytest.raises(NotImplementedError, match='window'):   # the layer falls back to fused_recurrent
        chunk_falcon(q, k, v, beta, lam, rule='falcon3a', window=9)
    with pytest.raises(ValueError, match='beta'):
        chunk_falcon(q, k, v, beta[..., :1, None], lam, rule='falcon1')
    # falcon3's tiles exceed Hopper's shared memory in training at K > 128 (fp32: K > 64), without gradients at
    # K > 256 (fp32: K > 128): refused before any kernel runs (the layer falls back to fused_recurrent)
    q2, k2, v2, beta2, lam2, _ = make_inputs('falcon3', 1, 8, 1, 1, 80, 16, 'on', False, device, window=2)
    with pytest.raises(NotImplementedError, match='falcon3.*K <= 64.*in training'):
        chunk_falcon(q2.requires_grad_(), k2, v2, beta2, lam2, rule='falcon3', window=2)
    q2 = q2.detach()
    with torch.no_grad():   # the forward fits at fp32 K = 80
        assert torch.isfinite(chunk_falcon(q2, k2, v2, beta2, lam2, rule='falcon3', window=2)[0]).all()
    with pytest.raises(NotImplementedError, match='falcon3.*K <= 128.*without gradients'):
        chunk_falcon(*(t.repeat(1, 1, 1, 2) for t in (q2, k2)), v2, beta2, lam2, rule='falcon3', window=2)
    bf = [t.repeat(1, 1, 1, 2).to(torch.bfloat16).requires_grad_() for t in (q2, k2)]
    with pytest.raises(NotImplementedError, match='falcon3.*K <= 128.*in training'):
        chunk_falcon(*bf, v2, beta2, lam2, rule='falcon3', window=2)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_gpu_long(rule, dtype, device):
    inputs = make_inputs(rule, 2, 1000, 2, 2, 64, 64, 'on', True, device, window=win(rule))
    check(run_both(rule, *inputs, dtype, window=win(rule)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_gpu_bf16_heads128_varlen(rule, device):
    cu = torch.tensor([0, 100, 611, 1000], device=device)
    inputs = make_inputs(rule, 1, 1000, 2, 1, 128, 128, 'coupled', True, device, cu_seqlens=cu, window=win(rule))
    check(run_both(rule, *inputs, torch.bfloat16, lam_mode='coupled', cu_seqlens=cu, window=win(rule)),
          torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize('rule', ('falcon1a', 'falcon2a', 'falcon3a'))
def test_gpu_bf16_state_key_block_64(rule, device):
    # 16 sequence-heads at K = V = 128: the state kernels of the rules without a delta term split K into two blocks
    # of 64 (wgmma), as at the benchmark's (1, 16384, 16, 128, 128)
    from fla_falcon.ops.falcon.chunk import _state_key_block
    assert _state_key_block(128, 16, 128, False) == 64
    inputs = make_inputs(rule, 1, 300, 4, 4, 128, 128, 'on', True, device, window=win(rule))
    check(run_both(rule, *inputs, torch.bfloat16, window=win(rule)), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('K', [16, 32])
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_gpu_small_heads(rule, K, dtype, device):
    # K = V = 16, 32: the heads run on 64-wide blocks masked past the head (chunk.MIN_BLOCK). With blocks as narrow
    # as the head, bf16 went wrong on the H200 in several kernels (illegal memory accesses, NaN, a wrong dk)
    cu = torch.tensor([0, 100, 611, 1000], device=device)
    inputs = make_inputs(rule, 1, 1000, 2, 2, K, K, 'on', True, device, cu_seqlens=cu, window=win(rule))
    check(run_both(rule, *inputs, dtype, cu_seqlens=cu, window=win(rule)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,K', [(torch.float32, 128), (torch.float32, 256), (torch.bfloat16, 256)])
@pytest.mark.parametrize('rule', SUPPORTED_RULES)
def test_gpu_large_heads(rule, dtype, K, device):
    """The shapes whose backward kernels need the most shared memory (fp32 tiles, K up to 256): at 64-row
    chunks some configs exceed Hopper's 227 KB and fp32 at K > 64 exceeds it with every config, so the
    op runs those with smaller chunks (scripts/aot_check.py lists the shared memory of every config)."""
    inputs = make_inputs(rule, 1, 130, 2, 1, K, K, 'on', True, device, window=win(rule))
    if rule == 'falcon3':   # refused in training at K > 128 (fp32: K > 64; test_unsupported_and_bad_args)
        with pytest.raises(NotImplementedError, match='in training'):
            run_both(rule, *inputs, dtype, window=win(rule))
        return
    check(run_both(rule, *inputs, dtype, window=win(rule)), dtype)


# ----------------------------------------------------------------------------------------------
# falcon3a: the window W (pairs before a chunk come from the previous chunk or the carried tail)
# ----------------------------------------------------------------------------------------------

@pytest.fixture(params=['fold', 'gather'])
def band_form(request, monkeypatch):
    """The backward forms of falcon3a's band (chunk.BAND_FORM): in the GLA's score products, or row by row in its
    own kernel."""
    import fla_falcon.ops.falcon.chunk as ch
    monkeypatch.setattr(ch, 'BAND_FORM', request.param)
    return request.param


@pytest.mark.parametrize('window, T, chunk_size', [
    (1, 65, 16), (2, 130, 64), (2, 63, 16), (4, 1, 16), (4, 65, 64), (8, 63, 64), (8, 65, 16)])
def test_falcon3a_windows(window, T, chunk_size, band_form, device):
    # grouped value heads (HV = 2H); initial states with a full tail and a fresh one
    inputs = make_inputs('falcon3a', 2, T, 1, 2, 16, 16, 'on', True, device, window=window)
    check(run_both('falcon3a', *inputs, torch.float32, chunk_size=chunk_size, window=window), torch.float32)


def test_falcon3a_wide_values(band_form, device):
    # V = 200: value blocks of 64 (and 32 in the backward), the last one masked, in the band kernels' value loops
    inputs = make_inputs('falcon3a', 1, 40, 1, 1, 16, 200, 'on', True, device, window=4)
    check(run_both('falcon3a', *inputs, torch.bfloat16, chunk_size=16, window=4), torch.bfloat16)


def test_falcon3a_odd_wide_dims(band_form, device):
    # K = 100, V = 80: key columns masked past K in every kernel, value blocks of 64 and 32 with the last one partial
    # (in _bwd_dqx's two passes too), varlen, an initial state with its tail, the final state's band
    cu = torch.tensor([0, 23, 70], device=device)
    inputs = make_inputs('falcon3a', 1, 70, 1, 2, 100, 80, 'on', True, device, seed=5, cu_seqlens=cu, window=4)
    check(run_both('falcon3a', *inputs, torch.float32, cu_seqlens=cu, chunk_size=16, window=4), torch.float32)


@pytest.mark.parametrize('shift, window', [(True, 4), (False, 8)])
def test_falcon3a_varlen(shift, window, band_form, device):
    # short sequences (1 token, empty) next to ones spanning chunks; full, fresh and partial tails
    cu = torch.tensor([0, 1, 20, 20, 57, 90], device=device)
    inputs = make_inputs('falcon3a', 1, 90, 1, 2, 16, 16, 'on', True, device, cu_seqlens=cu, window=window)
    check(run_both('falcon3a', *inputs, torch.float32, shift=shift, cu_seqlens=cu, chunk_size=16, window=window),
          torch.float32)


@pytest.mark.parametrize('shift', [True, False])
@pytest.mark.parametrize('rule, cuts', [('falcon3a', (0, 2, 5, 21, 40)),
                                        ('falcon3', (0, 2, 5, 17, 30))])   # falcon3's chunks: 8 steps at W = 8
def test_window8_segments(rule, cuts, shift, device):
    """W = 8 over segments shorter than the window, carried through tail_x/tail_v/count, vs one pass."""
    q, k, v, beta, lam, _ = make_inputs(rule, 1, cuts[-1], 1, 2, 16, 16, 'on', False, device)
    kw = dict(rule=rule, window=8, shift=shift, output_final_state=True, chunk_size=16)
    o, fs = chunk_falcon(q, k, v, beta, lam, **kw)
    outs, st = [], None
    for a, b in zip(cuts[:-1], cuts[1:]):
        o_i, st = chunk_falcon(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], lam[:, a:b], initial_state=st, **kw)
        outs.append(o_i)
    assert_close('o', o, torch.cat(outs, 1), SAME_OP_RATIO[device])
    for name, a, b in zip(FalconState._fields, fs, st):
        assert a.shape == b.shape, name
        assert_close(name, a.double(), b.double(), SAME_OP_RATIO[device])


def test_falcon3a_band_form_checked(monkeypatch, device):
    import fla_falcon.ops.falcon.chunk as ch
    monkeypatch.setattr(ch, 'BAND_FORM', 'rows')
    q, k, v, beta, lam, _ = make_inputs('falcon3a', 1, 20, 1, 1, 16, 16, 'on', False, device, window=3)
    q.requires_grad_()
    o, _ = chunk_falcon(q, k, v, beta, lam, rule='falcon3a', window=3, chunk_size=16)
    with pytest.raises(ValueError, match='BAND_FORM'):
        o.sum().backward()


def test_falcon3a_window1_is_falcon1a(device):
    """falcon3a with W = 1 is falcon1a (outputs, state, every gradient), through its own kernels."""
    q, k, v, beta, lam, state = make_inputs('falcon1a', 1, 40, 1, 2, 16, 16, 'on', True, device)
    outs = []
    for rule in ('falcon1a', 'falcon3a'):
        xs = [t.clone().requires_grad_() for t in (q, k, v, beta, lam, state.S, state.last_k)]
        st = FalconState(xs[5], xs[6], state.tail_x, state.tail_v, state.count)
        o, fs = chunk_falcon(*xs[:5], rule=rule, window=1, initial_state=st, output_final_state=True, chunk_size=16)
        (o.sum() + fs.S.square().sum()).backward()
        outs.append([o, fs.S] + [t.grad for t in xs])
    for name, a, b in zip(['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0', 'dlast_k'], *outs):
        assert_close(name, a.double(), b.double(), SAME_OP_RATIO[device])


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('window', [2, 8])
def test_gpu_falcon3a_long(window, dtype, band_form, device):
    inputs = make_inputs('falcon3a', 2, 1000, 2, 2, 64, 64, 'on', True, device, window=window)
    check(run_both('falcon3a', *inputs, dtype, window=window), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('shift', [True, False])
def test_gpu_falcon3a_bf16_heads128_varlen(shift, band_form, device):
    cu = torch.tensor([0, 5, 611, 1000], device=device)
    inputs = make_inputs('falcon3a', 1, 1000, 2, 1, 128, 128, 'coupled', True, device, cu_seqlens=cu, window=8)
    check(run_both('falcon3a', *inputs, torch.bfloat16, lam_mode='coupled', shift=shift, cu_seqlens=cu, window=8),
          torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize('rule, window', [(r, win(r)) for r in SUPPORTED_RULES] + [('falcon3a', 8)])
def test_gpu_deterministic(rule, window, device):
    """The chunk kernels have no atomics, so repeated calls on the same inputs give the same bits. A race inside a
    kernel shows here first: falcon3a's bf16 dq at K = V = 128 changed between reruns of one recorded launch on the
    H200 (fifteenth lease; Triton 3.6's pipeliner reused the shared-memory slot of an asynchronous wgmma's operand,
    scripts/wgmma_hazards.py), while each run alone was within tolerance most of the time."""
    cu = torch.tensor([0, 5, 611, 1000], device=device)
    q, k, v, beta, lam, st = make_inputs(rule, 1, 1000, 2, 1, 128, 128, 'coupled', True, device, cu_seqlens=cu,
                                         window=window)
    xs = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v, beta, lam)]
    S0 = st.S.clone().requires_grad_()
    state = FalconState(S0, st.last_k, st.tail_x, st.tail_v, st.count)
    g = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(xs[2].shape, device=device, generator=g).to(torch.bfloat16)
    runs = []
    for _ in range(6):
        o, fs = chunk_falcon(*xs, rule=rule, window=window, lam_coupled=True, initial_state=state,
                             output_final_state=True, cu_seqlens=cu)
        grads = torch.autograd.grad((o * do).sum() + fs.S.sum(), xs + [S0])
        runs.append([o, fs.S] + list(grads))
    names = ['o', 'S', 'dq', 'dk', 'dv', 'dbeta', 'dlam', 'dS0']
    differ = {name: (i, (a.float() - b.float()).abs().max().item()) for i, run in enumerate(runs[1:], 1)
              for name, a, b in zip(names, runs[0], run) if not torch.equal(a, b)}
    assert not differ, f"{rule}: (run, max difference) against run 0: {differ}"


def test_narrow_heads_take_64_wide_blocks():
    """Heads narrower than 64 run on 64-wide key / value blocks (chunk.MIN_BLOCK): the compiled tiles of K = V = 64,
    which the GPU tests cover; blocks as narrow as the head went wrong in bf16 on the H200 (see MIN_BLOCK)."""
    from fla_falcon.ops.falcon.chunk import _meta
    for (K, V), want in {(16, 16): (64, 64), (32, 48): (64, 64), (100, 80): (128, 64), (128, 128): (128, 64),
                         (256, 32): (256, 64)}.items():
        m = _meta(torch.empty(1, 8, 1, K), torch.empty(1, 8, 1, V), 64, None)
        assert (m['BK'], m['BV']) == want, (K, V)
