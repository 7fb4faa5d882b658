# -*- coding: utf-8 -*-
"""Falcon fast-weight attention for flash-linear-attention."""

from fla_falcon._platform import INTERPRET  # noqa: F401  (first: sets up Triton on CPU-only machines)

from fla_falcon.ops import RULES, FalconState, fused_recurrent_falcon, naive_recurrent_falcon
from fla_falcon.ops import chunk_falcon

__version__ = '0.1.0'

__all__ = ['naive_recurrent_falcon', 'fused_recurrent_falcon', 'FalconState', 'RULES']
__all__ += ['chunk_falcon']

# layers and models last (they need the ops above); importing the models registers FalconNet with
# transformers' Auto classes
from fla_falcon.layers import FalconNet  # noqa: E402
from fla_falcon.models import FalconNetConfig, FalconNetForCausalLM, FalconNetModel  # noqa: E402

__all__ += ['FalconNet', 'FalconNetConfig', 'FalconNetModel', 'FalconNetForCausalLM']
