# -*- coding: utf-8 -*-
"""Every autotuned kernel gives the same result when it runs more than once per launch, as on a GPU, where the
autotuner's timed runs of each config come before the real one (the interpreter autotunes one config and never
times it). A kernel that adds into one of its arguments must name it in restore_value (or reset_to_zero): falcon3's
step-form backward (a branch) did not, and on the H200 its key gradient came out hundreds of times too large in the
first launch of each autotuning key and right in the later ones (thirty-sixth lease), where the interpreter had
passed every test."""

import contextlib

import pytest
import test_chunk as base
import torch
from conftest import DEVICE
from triton.runtime.autotuner import Autotuner

from fla_falcon import FalconState
from fla_falcon.ops.falcon.chunk import SUPPORTED_RULES, chunk_falcon
from fla_falcon.ops.falcon.fused_recurrent import fused_recurrent_falcon


@contextlib.contextmanager
def timed_runs_first(monkeypatch):
    """Every autotuned launch runs its kernel once more before the real run, with the autotuner's own hooks around
    it, as a timed run of the chosen config would (restore_value copied and put back, reset_to_zero zeroed)."""
    run = Autotuner.run

    def run_twice(self, *args, **kwargs):
        nargs = dict(zip(self.arg_names, args))
        self.nargs = nargs   # before pruning, as Autotuner.run sets it: an early_config_prune reads it (_bwd_dqx's)
        config = self.prune_configs(kwargs)[0]
        current = dict(kwargs, **config.all_kwargs())
        full = {**nargs, **current}
        if config.pre_hook:
            config.pre_hook(full)
        self.pre_hook(full)
        self.fn.run(*args, **current)
        self.post_hook(full, exception=None)
        self.pre_hook(full, reset_only=True)
        return run(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Autotuner, 'run', run_twice)
        yield


def forward_backward(op, rule, window, dtype):
    q, k, v, beta, lam, state = base.make_inputs(rule, 1, 40, 1, 2, 16, 16, 'on', True, DEVICE, seed=4, window=window)
    xs = [t.to(dtype).requires_grad_() for t in (q, k, v, beta, lam)]
    st = FalconState(*(t.detach().clone().requires_grad_() for t in state[:4]), state.count)
    o, fs = op(*xs, rule=rule, window=window, initial_state=st, output_final_state=True)
    g = torch.Generator(device='cpu').manual_seed(5)
    loss = (o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() + \
        (fs.S * torch.randn(fs.S.shape, generator=g).to(o.device)).sum()
    loss.backward()
    return [o, fs.S] + [t.grad for t in xs + list(st[:4]) if t.grad is not None]


@pytest.mark.parametrize('op, rule', [('chunk', r) for r in SUPPORTED_RULES] +
                         [('fused_recurrent', r) for r in ('falcon1', 'falcon2', 'falcon3')])
def test_autotuned_kernels_rerun(op, rule, monkeypatch):
    window = base.WINDOW.get(rule, 1)
    fn = fused_recurrent_falcon if op == 'fused_recurrent' else chunk_falcon
    dtype = torch.float32 if DEVICE == 'cpu' else torch.bfloat16
    once = forward_backward(fn, rule, window, dtype)
    with timed_runs_first(monkeypatch):
        twice = forward_backward(fn, rule, window, dtype)
    assert len(once) == len(twice)
    for i, (a, b) in enumerate(zip(once, twice)):
        # the same kernels on the same inputs: equal but for the order of atomic adds, where a kernel has them
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f'output {i}: {m}')
