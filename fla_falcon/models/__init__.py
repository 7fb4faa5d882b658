# -*- coding: utf-8 -*-

from fla_falcon.models.falcon_net import FalconNetConfig, FalconNetForCausalLM, FalconNetModel

__all__ = ['FalconNetConfig', 'FalconNetForCausalLM', 'FalconNetModel']
