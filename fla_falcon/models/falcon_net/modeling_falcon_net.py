# -*- coding: utf-8 -*-
"""FalconNet models: fla's GatedDeltaNet models with :class:`fla_falcon.layers.FalconNet` as the mixer."""

from __future__ import annotations

import functools

import torch.nn as nn
from fla.models.gated_deltanet.modeling_gated_deltanet import GatedDeltaNetBlock
from fla.models.generation_utils import FLAUnsupportedCacheGenerationMixin
from fla.models.modeling_utils import FLAForCausalLM, FLAModel, FLAPreTrainedModel, get_attention
from fla.modules import GatedMLP as FalconNetMLP
from fla.modules import RMSNorm
from transformers.modeling_layers import GradientCheckpointingLayer

from fla_falcon.layers.falcon_net import FalconNet
from fla_falcon.models.falcon_net.configuration_falcon_net import FalconNetConfig


class FalconNetBlock(GatedDeltaNetBlock):
    """GatedDeltaNet's block (pre-norm mixer + GatedMLP, optional attention residuals) around FalconNet.

    Only the construction differs; `forward` is GatedDeltaNetBlock's.
    """

    def __init__(self, config: FalconNetConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)   # not GatedDeltaNetBlock.__init__: it builds a GatedDeltaNet

        self.config = config
        self.layer_idx = layer_idx

        self.attn_norm = (RMSNorm if config.fuse_norm else nn.RMSNorm)(config.hidden_size, eps=config.norm_eps)
        self.attn = get_attention(config=config, layer_idx=layer_idx)
        if self.attn is None:
            self.attn = FalconNet(
                hidden_size=config.hidden_size,
                expand_v=config.expand_v,
                head_dim=config.head_dim,
                num_heads=config.num_heads,
                num_v_heads=config.num_v_heads,
                mode=config.mode,
                use_gate=config.use_gate,
                use_short_conv=config.use_short_conv,
                allow_neg_eigval=config.allow_neg_eigval,
                conv_size=config.conv_size,
                layer_idx=layer_idx,
                norm_eps=config.norm_eps,
                output_gate_activation=config.output_gate_activation,
                **config.falcon_layer_kwargs(),
            )
        self.mlp_norm = (RMSNorm if config.fuse_norm else nn.RMSNorm)(config.hidden_size, eps=config.norm_eps)
        self.mlp = FalconNetMLP(
            hidden_size=config.hidden_size,
            hidden_ratio=config.hidden_ratio,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            fuse_swiglu=config.fuse_swiglu,
        )

        self.use_attnres = config.attnres_block_size is not None
        if self.use_attnres:
            self.attn_res_proj = nn.Linear(in_features=config.hidden_size, out_features=1, bias=False)
            self.attn_res_norm = nn.RMSNorm(normalized_shape=config.hidden_size, eps=config.norm_eps)
            self.mlp_res_proj = nn.Linear(in_features=config.hidden_size, out_features=1, bias=False)
            self.mlp_res_norm = nn.RMSNorm(normalized_shape=config.hidden_size, eps=config.norm_eps)
            block_size = config.attnres_block_size
            self.attnres_is_attn_boundary = (2 * layer_idx) % block_size == 0
            self.attnres_is_mlp_boundary = (2 * layer_idx + 1) % block_size == 0
            self.attn_res_proj._is_attnres_proj = True
            self.mlp_res_proj._is_attnres_proj = True


class FalconNetPreTrainedModel(FLAPreTrainedModel):

    config_class = FalconNetConfig
    base_model_prefix = 'model'
    supports_gradient_checkpointing = True
    _no_split_modules = ['FalconNetBlock']
    _supports_cache_class = True

    def __init__(self, *inputs, **kwargs):
        super().__init__(*inputs, **kwargs)

    def _init_weights(self, module: nn.Module, prenorm_residual_strategy: str | None = None,
                      num_residuals_per_layer: int = 2):
        if isinstance(module, FalconNet) and next(module.parameters()).device.type != 'meta':
            # the gate biases keep their layer initialization unless loaded from a checkpoint
            biases = [module.lam_bias] + ([module.eta_bias] if module.gate_param == 'step' else [])
            if not any(getattr(p, '_is_hf_initialized', False) for p in biases):
                module.reset_gate_parameters()
            for p in biases:
                p._no_weight_decay = True
        # Linear/Embedding init and the prenorm residual rescaling of `o_proj`, as for GatedDeltaNet
        super()._init_weights(module, prenorm_residual_strategy=prenorm_residual_strategy,
                              num_residuals_per_layer=num_residuals_per_layer)


def _cache_kwarg(kwargs: dict) -> dict:
    # transformers >= 5.2x renamed `past_key_values` to `cache` and `generate()` passes `cache=`, which
    # fla 0.6.0's FLAModel/FLAForCausalLM would silently drop (a fresh cache every decoding step)
    cache = kwargs.pop('cache', None)
    if cache is not None:
        if kwargs.get('past_key_values') is not None:
            raise ValueError("pass either `cache` or `past_key_values`, not both")
        kwargs['past_key_values'] = cache
    return kwargs


class FalconNetModel(FalconNetPreTrainedModel, FLAModel):

    def __init__(self, config: FalconNetConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([FalconNetBlock(config, layer_idx)
                                     for layer_idx in range(config.num_hidden_layers)])
        self.norm = (RMSNorm if config.fuse_norm else nn.RMSNorm)(config.hidden_size, eps=config.norm_eps)

        self.use_attnres = config.attnres_block_size is not None
        if self.use_attnres:
            self.res_proj = nn.Linear(in_features=config.hidden_size, out_features=1, bias=False)
            self.res_norm = nn.RMSNorm(normalized_shape=config.hidden_size, eps=config.norm_eps)
            self.res_proj._is_attnres_proj = True

        self.gradient_checkpointing = False

        self.post_init()

    @functools.wraps(FLAModel.forward)
    def forward(self, *args, **kwargs):
        return super().forward(*args, **_cache_kwarg(kwargs))


class FalconNetForCausalLM(FalconNetPreTrainedModel, FLAForCausalLM, FLAUnsupportedCacheGenerationMixin):

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: FalconNetConfig):
        super().__init__(config)
        self.model = FalconNetModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None

        self.post_init()

    @functools.wraps(FLAForCausalLM.forward)
    def forward(self, *args, **kwargs):
        return super().forward(*args, **_cache_kwarg(kwargs))


__all__ = ['FalconNetBlock', 'FalconNetForCausalLM', 'FalconNetModel', 'FalconNetPreTrainedModel']
