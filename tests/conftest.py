# -*- coding: utf-8 -*-
# Importing fla_falcon first turns on Triton's interpreter (and one-config autotuning) when no GPU
# is present, before triton or fla define any kernel: see fla_falcon/_platform.py.
import os

import fla_falcon  # noqa: F401
import pytest
import torch

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'


if INTERPRET:
    from triton.runtime.autotuner import Autotuner

    _autotuner_run = Autotuner.run

    def _run_with_tensor_outputs(self, *args, **kwargs):
        # the interpreter never benchmarks (one config), so an argument named in restore_value / reset_to_zero that
        # is not a tensor passes here and crashes only on a GPU, where the timed runs clone or zero it (it happened:
        # falcon3a's _bwd_dhu launched with du=None). Check every launch
        nargs = dict(zip(self.arg_names, args), **kwargs)
        for name in (*self.restore_value, *self.reset_to_zero):
            if not isinstance(nargs.get(name), torch.Tensor):
                raise TypeError(f"{self.fn.__name__}: argument {name!r} is in restore_value/reset_to_zero but is "
                                f"{type(nargs.get(name)).__name__}, not a tensor (the autotuner's timed runs on a GPU "
                                f"copy or zero it)")
        return _autotuner_run(self, *args, **kwargs)

    Autotuner.run = _run_with_tensor_outputs

    if os.environ.get('FLA_FALCON_BOUNDS', '1') != '0':
        # every unmasked load / store inside a kernel argument's storage (tests/interpreter_bounds.py): the
        # interpreter would otherwise carry on where a GPU faults
        from interpreter_bounds import install as _install_bounds

        _install_bounds()


if not INTERPRET and os.environ.get('FLA_FALCON_TEST_CONFIGS') == 'one':
    # a GPU run compiles one config per autotuning key instead of the whole list (tests/one_config.py)
    from one_config import install as _install_one_config

    _install_one_config()


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason='needs a CUDA GPU')
    for item in items:
        if 'gpu' in item.keywords and DEVICE != 'cuda':
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    """With PYTEST_FAIL_LOG set (scripts/gpu_tests.sh sets it), each failure's traceback goes to that file as soon
    as the test ends: pytest prints them only in its final summary, which a GPU lease that ends mid-run never
    reaches. Written once, by the process that reports (the xdist controller, or pytest without xdist)."""
    path = os.environ.get('PYTEST_FAIL_LOG')
    if path and report.failed and not os.environ.get('PYTEST_XDIST_WORKER'):
        with open(path, 'a') as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
