# -*- coding: utf-8 -*-
"""Running the Triton kernels on a machine without a GPU.

Triton runs kernels on the CPU only through its interpreter (``TRITON_INTERPRET=1``), which must be
set before any kernel is defined, and its autotuner cannot benchmark there. When no GPU is present,
importing :mod:`fla_falcon` therefore turns the interpreter on (unless ``TRITON_INTERPRET`` is set
already, e.g. to ``0``) and makes every ``triton.autotune`` keep only its first config, fla's
kernels included if fla is imported after us. Import ``fla_falcon`` (or call
:func:`enable_cpu_interpreter`) before ``fla`` to run fla's modules on the CPU as well.
"""

from __future__ import annotations

import os
import sys
import warnings


def _gpu_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available() or (hasattr(torch, 'xpu') and torch.xpu.is_available())
    except Exception:  # pragma: no cover - torch missing is reported by the imports that need it
        return False


def enable_cpu_interpreter(force: bool = False) -> bool:
    """Turns on Triton's interpreter and one-config autotuning; returns whether it is on."""
    if os.environ.get('TRITON_INTERPRET') is None:
        if not force and _gpu_available():
            return False
        if any(m == 'fla' or m.startswith('fla.') for m in sys.modules):
            warnings.warn("fla was imported before fla_falcon on a machine without a GPU: fla's kernels "
                          "were defined without Triton's interpreter and will not run on the CPU.")
        os.environ['TRITON_INTERPRET'] = '1'
    if os.environ.get('TRITON_INTERPRET') != '1':
        return False
    import triton
    if not getattr(triton.autotune, '_fla_falcon_one_config', False):
        autotune = triton.autotune

        def one_config_autotune(configs, key, *args, **kwargs):
            # the interpreter has no driver to benchmark with: keep the first config only
            return autotune(configs[:1], key, *args, **kwargs)

        one_config_autotune._fla_falcon_one_config = True
        triton.autotune = one_config_autotune
    # fla's own `fla_cache_autotune` (ShortConvolution, ...) builds its Autotuner subclass without going
    # through `triton.autotune`: keep only the first pruned config at run time as well, which also
    # covers kernels defined before this call
    from triton.runtime.autotuner import Autotuner
    if not getattr(Autotuner.prune_configs, '_fla_falcon_one_config', False):
        prune_configs = Autotuner.prune_configs

        def prune_to_first(self, *args, **kwargs):
            return prune_configs(self, *args, **kwargs)[:1]

        prune_to_first._fla_falcon_one_config = True
        Autotuner.prune_configs = prune_to_first
    _patch_interpreter_bf16_dot()
    return True


def _patch_interpreter_bf16_dot() -> None:
    """The interpreter stores bf16 as raw uint16 bits and its `tl.dot` multiplies those integers
    (garbage for every bf16 matmul, e.g. chunk_falcon on bf16 inputs). Widen bf16 operands to fp32
    first: exact (bf16 is the top half of an fp32), and what the GPU's bf16 MMA with fp32 accumulation
    computes."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:  # pragma: no cover - another Triton layout: leave it alone
        return
    create_dot = InterpreterBuilder.create_dot
    if getattr(create_dot, '_fla_falcon_bf16', False):
        return

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot_bf16(self, a, b, d, *args, **kwargs):
        return create_dot(self, widen(a), widen(b), d, *args, **kwargs)

    create_dot_bf16._fla_falcon_bf16 = True
    InterpreterBuilder.create_dot = create_dot_bf16


INTERPRET = enable_cpu_interpreter()
