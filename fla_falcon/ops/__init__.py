# -*- coding: utf-8 -*-

from fla_falcon.ops.falcon import RULES, FalconState, fused_recurrent_falcon, naive_chunk_falcon, naive_recurrent_falcon
from fla_falcon.ops.falcon import chunk_falcon

__all__ = ['naive_recurrent_falcon', 'naive_chunk_falcon', 'fused_recurrent_falcon', 'FalconState', 'RULES']
__all__ += ['chunk_falcon']
