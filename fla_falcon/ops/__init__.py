# -*- coding: utf-8 -*-

from fla_falcon.ops.falcon import RULES, FalconState, naive_recurrent_falcon

__all__ = ['naive_recurrent_falcon', 'FalconState', 'RULES']
