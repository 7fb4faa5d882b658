# -*- coding: utf-8 -*-

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from fla_falcon.models.falcon_net.configuration_falcon_net import FalconNetConfig
from fla_falcon.models.falcon_net.modeling_falcon_net import FalconNetForCausalLM, FalconNetModel

AutoConfig.register(FalconNetConfig.model_type, FalconNetConfig, exist_ok=True)
AutoModel.register(FalconNetConfig, FalconNetModel, exist_ok=True)
AutoModelForCausalLM.register(FalconNetConfig, FalconNetForCausalLM, exist_ok=True)

__all__ = ['FalconNetConfig', 'FalconNetForCausalLM', 'FalconNetModel']
