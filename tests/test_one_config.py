# -*- coding: utf-8 -*-
# tests/one_config.py (FLA_FALCON_TEST_CONFIGS=one for GPU runs) on Triton's own Autotuner class, with a stand-in
# kernel and benchmark: no GPU needed, and the real pruning / caching / best-config logic of the installed Triton
import json
import zlib

import pytest
import triton
from triton.runtime.autotuner import Autotuner, OutOfResources

import one_config


class FakeKernel:
    """What Autotuner needs of a JITFunction: a name, its arguments, and run(); records the configs that ran."""
    arg_names = ['x', 'n']

    def __init__(self, too_big=()):
        def fake_kernel(x, n):
            pass

        self.fn = fake_kernel   # Autotuner names the kernel by the function it unwraps to
        self.ran = []
        self.too_big = set(too_big)

    def run(self, *args, BV, **kwargs):
        if BV in self.too_big:
            raise OutOfResources(300000, 232448, 'shared memory')
        self.ran.append(BV)


def _tuner(cls, kernel, n_configs=5):
    configs = [triton.Config({'BV': bv}) for bv in range(n_configs)]
    tuner = cls(kernel, kernel.arg_names, configs, key=['n'], reset_to_zero=None, restore_value=None,
                do_bench=lambda call, quantiles=None: (call(), [1.0, 1.0, 1.0])[1])
    return tuner, configs


@pytest.fixture
def cls():
    # a subclass patched, not Triton's class (which the interpreter's one-config pruning patches for the whole run)
    class Tuner(Autotuner):
        def prune_configs(self, kwargs):
            return self.configs

    one_config.install(Tuner)
    return Tuner


def test_one_config_per_key(cls, tmp_path, monkeypatch):
    log = tmp_path / 'configs.log'
    monkeypatch.setenv('FLA_FALCON_CONFIG_LOG', str(log))
    kernel = FakeKernel()
    tuner, configs = _tuner(cls, kernel)
    picks = []
    for n in range(12):
        kernel.ran.clear()
        tuner.run(None, n)
        tuner.run(None, n)   # the key's config is cached: no second compile or timing
        want = zlib.crc32(f"fake_kernel{(n,)!r}".encode()) % len(configs)
        assert kernel.ran == [want, want, want]   # timed once, then the two launches
        assert tuner.best_config is configs[want]
        picks.append(want)
    assert len(set(picks)) > 1   # the keys spread over the list
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r['index'] for r in rows] == picks and {r['n'] for r in rows} == {5}
    table = one_config.summary(str(log))
    assert f"| fake_kernel | {len(set(picks))} / 5" in table


def test_pick_stays_out_of_the_disk_cache(cls):
    # with TRITON_CACHE_AUTOTUNING=1 (the lease machine) the pick would be saved as the key's best config, and a
    # benchmark later on the same machine would load it instead of autotuning
    kernel = FakeKernel()
    tuner, _ = _tuner(cls, kernel)
    tuner.cache_results = True

    def no_disk(*args, **kwargs):
        raise AssertionError("one_config wrote or read Triton's on-disk autotune cache")

    tuner.check_disk_cache = no_disk
    tuner.run(None, 3)
    assert len(kernel.ran) == 2


def test_config_that_does_not_fit_passes_the_turn(cls):
    n = next(n for n in range(100) if zlib.crc32(f"fake_kernel{(n,)!r}".encode()) % 5 == 3)
    kernel = FakeKernel(too_big={3, 4})
    tuner, configs = _tuner(cls, kernel)
    tuner.run(None, n)
    assert kernel.ran == [0, 0] and tuner.best_config is configs[0]   # 3 and 4 did not fit: the list wraps to 0


def test_no_config_fits_raises_as_triton_does(cls):
    kernel = FakeKernel(too_big=range(5))
    tuner, _ = _tuner(cls, kernel)
    with pytest.raises(OutOfResources):
        tuner.run(None, 7)
