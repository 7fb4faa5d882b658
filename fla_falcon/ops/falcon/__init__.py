# -*- coding: utf-8 -*-

from fla_falcon.ops.falcon.chunk import chunk_falcon
from fla_falcon.ops.falcon.fused_recurrent import fused_recurrent_falcon
from fla_falcon.ops.falcon.naive import naive_chunk_falcon, naive_recurrent_falcon
from fla_falcon.ops.falcon.utils import RULES, FalconState

__all__ = ['naive_recurrent_falcon', 'naive_chunk_falcon', 'fused_recurrent_falcon', 'FalconState', 'RULES']
__all__ += ['chunk_falcon']
