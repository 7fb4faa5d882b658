# -*- coding: utf-8 -*-
"""The compared models: configs that share width, depth, heads, MLP and vocabulary and differ in the mixer.

All are built through transformers' Auto classes (`AutoModelForCausalLM.from_config`). Names:

- ``falcon1 falcon2 falcon3 falcon1a falcon2a falcon3a``: FalconNet with that rule (fla_falcon.models);
  ``<rule>-noshift``: the same with ``shift=False`` (same-step pair (phi(k_t), v_t), the ablation).
- ``gdn``: fla's GatedDeltaNet, from ``FalconNetConfig.to_gated_deltanet_config()`` (only the mixer differs).
- ``deltanet``: fla's DeltaNet (l2-normalized q/k, short convs, output gate, as GDN), through fla's
  ``fused_recurrent_delta_rule`` (fla's chunk kernel refuses the fp32 these models train in).
- ``mamba2``: fla's Mamba2 (no MLP blocks, so 2x layers, Mamba's convention for matching a Transformer).
- ``transformer``: transformers' LlamaForCausalLM (RoPE, SDPA attention): fla's Transformer needs flash-attn.

Kernel routes (`kernels`): 'fla' runs the Triton kernels (fla's and ours); 'torch' runs the recurrences
(on CPU also fla's Triton convs, norms and activations) through the PyTorch stand-ins of
:mod:`evals.addition.torch_path` (same functions, autograd gradients). 'auto': 'torch' on CPU (the interpreter
is ~1000x slower), 'fla' on GPU. Where fla refuses its gated chunk backward (#640 guard: Hopper + Triton < 3.7.1
miscompiles one kernel, `chunk_bwd_dqkwg`), GatedDeltaNet and Mamba-2's SSD (fla's simple GLA) run fla's chunk
kernels with that one kernel replaced (route 'fla+dqkwg'): our Triton version of it (`evals/addition/dqkwg.py`,
without the miscompiled pattern), used for each kind of call after it matched the PyTorch stand-in
(`torch_path.chunk_bwd_dqkwg_torch`, tested against fla's kernel) on that call's inputs, else the stand-in.
`--kernels torch` keeps the PyTorch recurrences on a GPU too.
"""

from __future__ import annotations

import fla_falcon  # noqa: F401  (first: Triton interpreter on CPU-only machines; registers falcon_net)
from fla_falcon.ops.falcon.utils import RULES

BASELINES = ('gdn', 'deltanet', 'mamba2', 'transformer')
ALL_MODELS = tuple(RULES) + ('falcon3a-noshift',) + BASELINES
KERNEL_ROUTES = ('auto', 'fla', 'torch')


class Unavailable(RuntimeError):
    """The model cannot be trained correctly on this device / route; the message says why."""


def check_model_name(name: str) -> None:
    rule = name[:-len('-noshift')] if name.endswith('-noshift') else name
    if rule not in RULES and name not in BASELINES:
        raise ValueError(f"models: unknown model {name!r}; known: {', '.join(ALL_MODELS)} (any <rule>-noshift)")


def _gdn_backward_refused(device: str) -> bool:
    """Whether fla 0.6.0 refuses GatedDeltaNet's gated chunk backward here (its #640 guard)."""
    if not str(device).startswith('cuda'):
        return False
    try:
        from fla.ops.common.chunk_o import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla version: let the run itself fail loudly if it refuses
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def resolve_route(name: str, kernels: str, device: str) -> str:
    """'fla', 'fla+dqkwg' (fla's kernels, `chunk_bwd_dqkwg` in PyTorch) or 'torch' for this model; raises
    Unavailable where no correct training route exists."""
    if kernels not in KERNEL_ROUTES:
        raise ValueError(f"kernels must be one of {KERNEL_ROUTES}, got {kernels!r}")
    cpu = not str(device).startswith('cuda')
    if kernels == 'auto':
        kernels = 'torch' if cpu else 'fla'
    if kernels == 'fla' and name == 'gdn' and cpu:
        raise Unavailable("unavailable: fla's chunk_gated_delta_rule fails under the Triton interpreter on CPU "
                          "and fused_recurrent_gated_delta_rule has no backward; use --kernels torch/auto for "
                          "the torch reference route")
    if kernels == 'fla' and name in ('gdn', 'mamba2') and _gdn_backward_refused(device):
        return 'fla+dqkwg'
    return kernels


def build_model(name: str, size: dict, *, device: str = 'cpu', kernels: str = 'auto'):
    """(model on `device`, info dict: name, route, class, params). `size`: hidden, layers, heads, intermediate,
    max_len (positions). Raises Unavailable when the model cannot be trained correctly here."""
    from transformers import AutoModelForCausalLM

    from evals.addition import torch_path
    from evals.addition.data import TOKENIZER as tok

    check_model_name(name)
    route = resolve_route(name, kernels, device)
    if route == 'fla+dqkwg':
        torch_path.enable(['dqkwg'])
    if route == 'torch':
        if str(device).startswith('cuda'):
            torch_path.enable([p for p in ('gdn', 'deltanet', 'falcon') if p == _family(name)])
        else:   # CPU: also fla's Triton convs and norms, and the Falcon / DeltaNet recurrences
            torch_path.enable(torch_path.PARTS)
    fused = route != 'torch'
    h, L, nh, inter = size['hidden'], size['layers'], size['heads'], size['intermediate']
    common = dict(vocab_size=tok.vocab_size, pad_token_id=tok.pad, bos_token_id=tok.bos, eos_token_id=tok.eos,
                  tie_word_embeddings=False, use_cache=False)
    fla_common = dict(common, fuse_norm=fused, fuse_swiglu=fused, fuse_cross_entropy=False)
    if name in BASELINES and name != 'gdn':
        if name == 'deltanet':
            from fla.models import DeltaNetConfig
            # fla's chunk_delta_rule refuses fp32 inputs (these models train in fp32); its fused_recurrent kernel
            # takes them and has a backward (tests/test_addition.py checks it against the reference on the GPU)
            config = DeltaNetConfig(attn_mode='fused_recurrent', hidden_size=h, num_heads=nh, expand_k=1.0,
                                    expand_v=1.0, use_gate=True, num_hidden_layers=L, intermediate_size=inter,
                                    **fla_common)
        elif name == 'mamba2':
            from fla.models import Mamba2Config
            config = Mamba2Config(hidden_size=h, num_hidden_layers=2 * L, head_dim=h // nh, expand=2,
                                  state_size=h // nh, n_groups=1, chunk_size=size.get("mamba_chunk", 16), **fla_common)
        else:
            from transformers import LlamaConfig
            config = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=L, num_attention_heads=nh,
                                 num_key_value_heads=nh, max_position_embeddings=max(size.get('max_len', 512), 512),
                                 rms_norm_eps=1e-6, **common)
            config._attn_implementation = 'sdpa'
    else:
        from fla_falcon.models import FalconNetConfig
        rule = name[:-len('-noshift')] if name.endswith('-noshift') else name
        fcfg = FalconNetConfig(attn_mode=rule if rule in RULES else 'falcon1', shift=not name.endswith('-noshift'),
                               hidden_size=h, num_heads=nh, head_dim=h // nh, expand_v=1.0, num_hidden_layers=L,
                               intermediate_size=inter, **fla_common)
        config = fcfg.to_gated_deltanet_config() if name == 'gdn' else fcfg
    model = AutoModelForCausalLM.from_config(config).to(device)
    if name == 'mamba2':
        # fla's torch_forward materializes huge products (torch_path); the SSD as simple GLA instead
        torch_path.use_chunked_ssd(model, kernel='torch' if route == 'torch' else 'fla')
    info = dict(name=name, route=route, model_class=type(model).__name__, model_type=config.model_type,
                params=sum(p.numel() for p in model.parameters()), config=config.to_dict())
    return model, info


def _family(name: str) -> str:
    return name if name in BASELINES else 'falcon'
