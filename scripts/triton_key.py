# -*- coding: utf-8 -*-
"""Print what decides whether a Triton cache built on one machine hits on another (Triton 3.x): the hash of
triton_key() (Triton's own sources and libtriton.so, so the wheel and the Python version) and the CUDA backend's
hash for a target (ptxas's version and the arch). Equal lines on two machines mean a kernel compiled for that arch on
one (scripts/aot_check.py compiles without a GPU) can be found in a carried cache on the other, given the same
sources, options and specializations.

    python scripts/triton_key.py [--arch 90]
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.cache import triton_key


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--arch', type=int, default=90, help='compute capability x10 (90: H100/H200)')
    args = p.parse_args()
    key = hashlib.sha256(triton_key().encode()).hexdigest()[:16]
    backend = CUDABackend(GPUTarget('cuda', args.arch, 32)).hash()   # ptxas's version text, '-', the arch
    ptxas = next((w for w in backend.split() if w.startswith('V') and w[1:2].isdigit()), '?')
    print(f'python {sys.version.split()[0]} triton {triton.__version__} triton_key {key} '
          f'backend {hashlib.sha256(backend.encode()).hexdigest()[:16]} (ptxas {ptxas}, sm_{args.arch})')


if __name__ == '__main__':
    main()
