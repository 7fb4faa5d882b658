# -*- coding: utf-8 -*-

from __future__ import annotations

from fla.models.configuration_utils import (
    AttentionConfig,
    AttentionConfigBase,
    validate_attnres_config,
    validate_loss_config,
)
from fla.models.gated_deltanet.configuration_gated_deltanet import GatedDeltaNetConfig
from transformers.configuration_utils import PreTrainedConfig

from fla_falcon.layers.falcon_net import validate_falcon_args
from fla_falcon.ops.falcon.utils import DEFAULT_EPS, DEFAULT_EPS_GAMMA

# the fields a FalconNetConfig shares with fla's GatedDeltaNetConfig (all of them but attn_mode, which
# GatedDeltaNet uses for the kernel and Falcon for the rule: the kernel is `mode` here)
_SHARED_FIELDS = (
    'hidden_size', 'expand_v', 'use_gate', 'use_short_conv', 'allow_neg_eigval', 'conv_size', 'head_dim',
    'num_heads', 'num_v_heads', 'max_position_embeddings', 'hidden_ratio', 'intermediate_size', 'hidden_act',
    'num_hidden_layers', 'norm_eps', 'attn', 'use_cache', 'pad_token_id', 'bos_token_id', 'eos_token_id',
    'tie_word_embeddings', 'initializer_range', 'fuse_norm', 'fuse_swiglu', 'fuse_cross_entropy',
    'fuse_linear_cross_entropy', 'use_l2warp', 'vocab_size', 'attnres_block_size', 'output_gate_activation',
)


class FalconNetConfig(AttentionConfigBase, PreTrainedConfig):
    """Config of :class:`FalconNetModel`: every field of fla's `GatedDeltaNetConfig` with its default, plus
    the Falcon options of :class:`fla_falcon.layers.FalconNet`.

    ``attn_mode`` names the Falcon rule (falcon1, falcon2, falcon3, falcon1a, falcon2a, falcon3a); the
    kernel that GatedDeltaNetConfig selects with ``attn_mode`` is ``mode`` here ('chunk' or
    'fused_recurrent'). ``attn`` adds fla softmax-attention layers exactly as in GatedDeltaNet.
    :meth:`to_gated_deltanet_config` gives the GatedDeltaNet baseline that differs only in the mixer.
    """

    model_type = 'falcon_net'
    keys_to_ignore_at_inference = ['past_key_values']

    def __init__(
        self,
        attn_mode: str = 'falcon1',
        hidden_size: int = 2048,
        expand_v: float = 2.0,
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        max_position_embeddings: int = 2048,
        hidden_ratio: int | None = 4,
        intermediate_size: int | None = None,
        hidden_act: str = "swish",
        num_hidden_layers: int = 21,
        norm_eps: float = 1e-6,
        attn: AttentionConfig = None,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_norm: bool = True,
        fuse_swiglu: bool = True,
        fuse_cross_entropy: bool = True,
        fuse_linear_cross_entropy: bool = False,
        use_l2warp: bool = False,
        vocab_size: int = 32000,
        attnres_block_size: int | None = None,
        output_gate_activation: str = "swish",
        mode: str = 'chunk',
        window: int | None = None,
        qk_norm: str = 'rms',
        shift: bool = True,
        lam_coupled: bool = False,
        gate_param: str = 'gain',
        falcon_eps: float = DEFAULT_EPS,
        falcon_eps_gamma: float = DEFAULT_EPS_GAMMA,
        **kwargs,
    ):
        self.window = validate_falcon_args(
            attn_mode=attn_mode, window=window, qk_norm=qk_norm, gate_param=gate_param,
            allow_neg_eigval=allow_neg_eigval, num_heads=num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
            expand_v=expand_v, mode=mode, shift=shift, lam_coupled=lam_coupled)
        self.attn_mode = attn_mode
        self.mode = mode
        self.qk_norm = qk_norm
        self.shift = shift
        self.lam_coupled = lam_coupled
        self.gate_param = gate_param
        self.falcon_eps = falcon_eps
        self.falcon_eps_gamma = falcon_eps_gamma

        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_gate = use_gate
        self.output_gate_activation = output_gate_activation
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.max_position_embeddings = max_position_embeddings

        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.num_hidden_layers = num_hidden_layers
        self.norm_eps = norm_eps
        self.attn = attn   # validated by AttentionConfigBase (needs num_hidden_layers first)
        self.use_cache = use_cache
        self.initializer_range = initializer_range

        self.fuse_norm = fuse_norm
        self.fuse_swiglu = fuse_swiglu
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.use_l2warp = use_l2warp
        self.vocab_size = vocab_size
        self.allow_neg_eigval = allow_neg_eigval
        self.attnres_block_size = attnres_block_size

        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output_gate_activation must be 'swish', 'silu', or 'sigmoid', "
                             f"got {output_gate_activation!r}.")
        validate_loss_config(fuse_cross_entropy=fuse_cross_entropy, fuse_linear_cross_entropy=fuse_linear_cross_entropy)
        validate_attnres_config(attnres_block_size=attnres_block_size)

        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def falcon_layer_kwargs(self) -> dict:
        """The Falcon options of :class:`fla_falcon.layers.FalconNet` set by this config."""
        return dict(attn_mode=self.attn_mode, window=self.window, qk_norm=self.qk_norm, shift=self.shift,
                    lam_coupled=self.lam_coupled, gate_param=self.gate_param, eps=self.falcon_eps,
                    eps_gamma=self.falcon_eps_gamma)

    def to_gated_deltanet_config(self, **overrides) -> GatedDeltaNetConfig:
        """fla's GatedDeltaNet config with every shared field (sizes, hybrid `attn` layers, MLP, norms,
        losses) equal to this one: the two models differ only in the mixer."""
        fields = {name: getattr(self, name) for name in _SHARED_FIELDS}
        fields['attn_mode'] = self.mode
        fields.update(overrides)
        return GatedDeltaNetConfig(**fields)
