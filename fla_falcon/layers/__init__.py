# -*- coding: utf-8 -*-

from fla_falcon.layers.falcon_net import FalconNet

__all__ = ['FalconNet']
