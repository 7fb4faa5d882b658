# -*- coding: utf-8 -*-
"""Falcon fast-weight attention for flash-linear-attention."""

from fla_falcon._platform import INTERPRET  # noqa: F401  (first: sets up Triton on CPU-only machines)

from fla_falcon.ops import RULES, FalconState, naive_recurrent_falcon

__version__ = '0.1.0'

__all__ = ['naive_recurrent_falcon', 'FalconState', 'RULES']
