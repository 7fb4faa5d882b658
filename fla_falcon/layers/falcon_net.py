# -*- coding: utf-8 -*-
"""`FalconNet`: a drop-in replacement for fla's `GatedDeltaNet` layer running a Falcon update rule."""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from einops import rearrange
from torch.nn import functional as F

from fla.layers.utils import get_layer_cache, repad_hidden_states, unpad_hidden_states, update_layer_cache
from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
from fla.modules.l2norm import l2norm

import fla_falcon.ops as falcon_ops
from fla_falcon.ops.falcon.utils import DEFAULT_EPS, DEFAULT_EPS_GAMMA, RULES, FalconState, rule_info

if TYPE_CHECKING:
    from fla.models.cache_utils import Cache

DEFAULT_WINDOW = 4          # window of falcon3/falcon3a when none is given
QK_NORMS = ('rms', 'l2')
GATE_PARAMS = ('gain', 'step')
# kernels in order of preference: a missing one falls back to the next
KERNELS = ('chunk', 'fused_recurrent', 'naive')
_KERNEL_FN = {'chunk': 'chunk_falcon', 'fused_recurrent': 'fused_recurrent_falcon', 'naive': 'naive_recurrent_falcon'}
_warned: set = set()


def _kernel_supports(fn, rule: str) -> bool:
    # a kernel declares the rules it implements as `fn.supported_rules` or its module's `SUPPORTED_RULES`
    # (e.g. chunk_falcon while some rules are missing); default: all
    rules = getattr(fn, 'supported_rules', None)
    if rules is None:
        rules = getattr(sys.modules.get(getattr(fn, '__module__', None) or ''), 'SUPPORTED_RULES', None)
    return rules is None or rule in rules


def _warn_fallback(mode: str, name: str, rule: str, why: str = '') -> None:
    if (mode, name, rule, why) not in _warned:
        _warned.add((mode, name, rule, why))
        warnings.warn(f"FalconNet: no '{mode}' kernel for rule {rule!r} in fla_falcon.ops{why}; "
                      f"falling back to '{name}'.", stacklevel=4)


def resolve_falcon_kernel(mode: str, rule: str):
    """`(name, op)`: the op for `mode` ('chunk', 'fused_recurrent' or 'naive') from `fla_falcon.ops`, or
    the first one after it in chunk -> fused_recurrent -> naive that exists and supports `rule`
    (warned once)."""
    if mode not in KERNELS:
        raise ValueError(f"mode must be one of {KERNELS}, got {mode!r}")
    for name in KERNELS[KERNELS.index(mode):]:
        fn = getattr(falcon_ops, _KERNEL_FN[name], None)
        if fn is not None and _kernel_supports(fn, rule):
            if name != mode:
                _warn_fallback(mode, name, rule)
            return name, fn
    raise RuntimeError("fla_falcon.ops has no Falcon kernel")  # unreachable: the naive op always exists


def run_falcon_kernel(mode: str, rule: str, *args, **kwargs):
    """Calls the resolved kernel; one that raises NotImplementedError (an option it does not support
    yet) hands over to the next kernel of the chain."""
    name, fn = resolve_falcon_kernel(mode, rule)
    while True:
        try:
            return fn(*args, rule=rule, **kwargs)
        except NotImplementedError as e:
            if name == KERNELS[-1]:
                raise
            nxt, fn = resolve_falcon_kernel(KERNELS[KERNELS.index(name) + 1], rule)
            _warn_fallback(name, nxt, rule, f" for these options ({e})")
            name = nxt


def validate_falcon_args(
    *, attn_mode, window, qk_norm, gate_param, allow_neg_eigval, num_heads, num_v_heads, head_dim, expand_v,
    mode='chunk', shift=True, lam_coupled=False,
) -> int:
    """Checks the Falcon options of a layer or config (ValueError naming the argument); returns the window."""
    if not isinstance(attn_mode, str) or attn_mode not in RULES:
        raise ValueError(f"attn_mode must be a Falcon rule, one of {list(RULES)}, got {attn_mode!r} "
                         f"(the kernel is chosen by `mode`: 'chunk' or 'fused_recurrent')")
    windowed = rule_info(attn_mode)[2]
    if window is None:
        window = DEFAULT_WINDOW if windowed else 1
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"window must be an int, got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not windowed and window != 1:
        raise ValueError(f"window={window} is only used by falcon3/falcon3a; attn_mode={attn_mode!r} needs window=1")
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
    if gate_param not in GATE_PARAMS:
        raise ValueError(f"gate_param must be one of {GATE_PARAMS}, got {gate_param!r}")
    if mode not in ('chunk', 'fused_recurrent'):
        raise ValueError(f"mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
    if allow_neg_eigval:
        raise ValueError(
            "allow_neg_eigval=True is not supported by FalconNet: Falcon's gain beta already lies in (0, 2), the "
            "range fla reaches by doubling beta, so the transition I - eta x x^T already has eigenvalues in (-1, 1]; "
            "doubling it again would leave the descent range beta < 2 and make the recurrence unstable.")
    if not isinstance(shift, bool):
        raise ValueError(f"shift must be a bool, got {shift!r}")
    if not isinstance(lam_coupled, bool):
        raise ValueError(f"lam_coupled must be a bool, got {lam_coupled!r}")
    for name, value in (('num_heads', num_heads), ('head_dim', head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    nv = num_heads if num_v_heads is None else num_v_heads
    if isinstance(nv, bool) or not isinstance(nv, int) or nv < 1:
        raise ValueError(f"num_v_heads must be a positive int or None, got {num_v_heads!r}")
    if nv % num_heads != 0:
        raise ValueError(f"num_v_heads={nv} must be a multiple of num_heads={num_heads}")
    head_v = head_dim * expand_v
    if not (head_v >= 1 and math.isclose(head_v, round(head_v), rel_tol=1e-5)):
        raise ValueError(f"expand_v={expand_v} must make head_dim * expand_v = {head_v} a positive integer")
    return window


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class FalconNet(nn.Module):
    r"""Falcon fast-weight layer: fla's `GatedDeltaNet` block with a Falcon update rule as the mixer.

    Same projections, short convolutions, output gate/norm, cache and padding handling as
    :class:`fla.layers.GatedDeltaNet` (every constructor argument of it is accepted with the same
    meaning and default), but the state update is the Falcon rule ``attn_mode`` (see
    :func:`fla_falcon.ops.naive_recurrent_falcon`): the written pair is ``(phi(k_{t-1}), v_t)``
    (``shift=True``), the step is normalized, ``eta = beta / (E + lam + eps)``, and forgetting comes
    from the ridge ``lam`` (``gamma = 1 - min(eta * lam, 1 - eps_gamma)``) instead of GDN's ``A_log``/``dt_bias``
    decay. Reads are ``o_t = S_t^T phi(q_t)`` (scale 1, as in the paper) followed by GDN's output norm.

    Falcon options:
        attn_mode: the rule, one of falcon1, falcon2, falcon3, falcon1a, falcon2a, falcon3a. Default `falcon1`.
        window: window B of falcon3/falcon3a (default 4); must be 1 (or None) for the other rules.
        qk_norm: feature map phi on q and k: `rms` (default, the paper's weightless RMSNorm over the head
            dim, ||phi(k)||^2 ~ head_dim) or `l2` (unit norm, as GDN).
        shift: next-latent alignment (True, the paper); False writes the same-step pair (ablation).
        lam_coupled: the network emits a dimensionless ridge and the recurrence uses ``lam * E``
            (E a statistic, no gradient through it).
        gate_param: how the per-token gates are made from the (normed) hidden state x:

            - ``'gain'`` (default): context-conditioned gain ``beta = 2 * sigmoid(b_proj(x))`` in (0, 2),
              one per value head (per value column, ``num_v_heads * head_v_dim`` outputs, for
              falcon2/2a). ``b_proj`` has no bias, so beta starts near 1 (the NLMS projection step).
            - ``'step'``: context-conditioned step size, the ablation the paper compares with the
              context-conditioned gain (and finds better on downstream averages for Falcon-1A). The
              token emits ``eta = softplus(b_proj(x) + eta_bias) / E_ref`` (``E_ref`` = head_dim for
              `rms`, 1 for `l2`: the typical ||phi(k)||^2, so the pre-activation is dimensionless) and the
              layer turns it into the op's gain with ``beta = 2 * (1 - exp(-eta * L / 2))``,
              ``L = ||x_t||^2 + lam_t + eps`` the normalizer of the pair written at t. For small steps the
              realized step ``beta / L`` equals ``eta`` (it no longer adapts to the key energy as in
              'gain'); it saturates smoothly below the descent bound ``2 / L`` instead of leaving it.
              For falcon3/3a L uses the newest pair's energy, not the window statistic, so the realized
              step there is ``eta`` times ``L / (E_window + lam + eps)`` (~1 with RMS-normalized keys).
              ``eta_bias`` starts at ``log 3`` so that beta = 1 at ``L = E_ref``, like 'gain'.

            In both, the ridge is ``lam = softplus(a_proj(x) + lam_bias) >= 0`` per value head;
            ``lam_bias`` is initialized (like GDN's ``dt_bias``) so that the decay fraction
            ``alpha = eta * lam`` at beta = 1 and ``E = E_ref`` is log-uniform in [1e-3, 1e-1].
        eps, eps_gamma: the op's step stabilizer and decay clamp.

    ``allow_neg_eigval`` is accepted for signature compatibility but must be False: Falcon's beta in
    (0, 2) already covers the doubled range fla enables with it (a ValueError says so otherwise).

    Kernels: as fla, 'chunk' for training/prefill and 'fused_recurrent' for short (<= 64 tokens)
    inference steps, taken from :mod:`fla_falcon.ops`; a kernel that is missing there, does not list
    the rule (`fn.supported_rules` or its module's `SUPPORTED_RULES`) or raises NotImplementedError
    for the options falls back chunk -> fused_recurrent -> naive with a one-time warning. The cache
    stores the conv states and the full :class:`FalconState` (S, last key, window tail, count) as the
    layer's `recurrent_state`.

    On a CPU-only machine everything here (fla's ShortConvolution and norms included) runs under
    Triton's interpreter once :mod:`fla_falcon` is imported before fla (it sets it up).
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        mode: str = 'chunk',
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        output_gate_activation: str = 'swish',
        attn_mode: str = 'falcon1',
        window: int | None = None,
        qk_norm: str = 'rms',
        shift: bool = True,
        lam_coupled: bool = False,
        gate_param: str = 'gain',
        eps: float = DEFAULT_EPS,
        eps_gamma: float = DEFAULT_EPS_GAMMA,
        **kwargs,
    ) -> FalconNet:
        super().__init__()
        self.window = validate_falcon_args(
            attn_mode=attn_mode, window=window, qk_norm=qk_norm, gate_param=gate_param,
            allow_neg_eigval=allow_neg_eigval, num_heads=num_heads, num_v_heads=num_v_heads, head_dim=head_dim,
            expand_v=expand_v, mode=mode, shift=shift, lam_coupled=lam_coupled)
        if output_gate_activation not in ('swish', 'silu', 'sigmoid'):
            raise ValueError(f"output_gate_activation must be 'swish', 'silu', or 'sigmoid', "
                             f"got {output_gate_activation!r}.")

        self.mode = mode
        self.attn_mode = attn_mode
        self.qk_norm = qk_norm
        self.shift = shift
        self.lam_coupled = lam_coupled
        self.gate_param = gate_param
        self.eps = eps
        self.eps_gamma = eps_gamma
        self.per_column = rule_info(attn_mode)[1]
        self.allow_neg_eigval = allow_neg_eigval
        self.hidden_size = hidden_size
        self.expand_v = expand_v

        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias

        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads

        self.head_k_dim = head_dim
        self.head_v_dim = int(round(head_dim * expand_v))
        self.key_dim = self.num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.layer_idx = layer_idx
        # the typical ||phi(k)||^2: the energy the gate initializations are calibrated for
        self.energy_ref = float(self.head_k_dim) if qk_norm == 'rms' else 1.0

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        # ridge (per value head) and gain / step (per value head, or per value column for falcon2/2a)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.value_dim if self.per_column else self.num_v_heads, bias=False)
        self.lam_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.lam_bias._no_weight_decay = True
        if gate_param == 'step':
            self.eta_bias = nn.Parameter(torch.empty(self.b_proj.out_features, dtype=torch.float32))
            self.eta_bias._no_weight_decay = True
        self.reset_gate_parameters()

        if qk_norm == 'rms':
            # the paper's RMSNorm(u) = u / sqrt(||u||^2 / d + eps), without a learned weight
            self.q_norm = RMSNorm(self.head_k_dim, elementwise_affine=False, eps=norm_eps)
            self.k_norm = RMSNorm(self.head_k_dim, elementwise_affine=False, eps=norm_eps)

        if use_short_conv:
            self.q_conv1d = ShortConvolution(hidden_size=self.key_dim, kernel_size=conv_size, bias=conv_bias,
                                             activation='silu')
            self.k_conv1d = ShortConvolution(hidden_size=self.key_dim, kernel_size=conv_size, bias=conv_bias,
                                             activation='silu')
            self.v_conv1d = ShortConvolution(hidden_size=self.value_dim, kernel_size=conv_size, bias=conv_bias,
                                             activation='silu')
        else:
            warnings.warn(
                "ShortConvolution is crucial to the performance. "
                "Do not turn it off, i.e., setting `use_short_conv=False` unless you know what you are doing.",
            )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(hidden_size=self.head_v_dim, eps=norm_eps,
                                            activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(hidden_size=self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """(Re)initializes `lam_bias` (and `eta_bias`); see the class docstring."""
        alpha = torch.exp(torch.rand(self.num_v_heads) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
        # alpha = eta * lam with eta = 1 / (E + lam): lam = alpha / (1 - alpha) * E (E = 1 if scale-coupled)
        lam = alpha / (1 - alpha) * (1.0 if self.lam_coupled else self.energy_ref)
        self.lam_bias.copy_(_inv_softplus(lam.clamp(min=1e-6)))
        if self.gate_param == 'step':
            # softplus(eta_bias) = 2 ln 2: beta = 2 (1 - exp(-ln 2)) = 1 at L = E_ref
            self.eta_bias.fill_(math.log(3.0))

    def extra_repr(self) -> str:
        return (f"attn_mode={self.attn_mode}, window={self.window}, qk_norm={self.qk_norm}, shift={self.shift}, "
                f"lam_coupled={self.lam_coupled}, gate_param={self.gate_param}, mode={self.mode}")

    def _feature_map(self, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        return norm(x) if self.qk_norm == 'rms' else l2norm(x)

    def _pair_energy(self, k: torch.Tensor, state: FalconState | None, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """||x_t||^2 of the key written at each step (x_t = phi(k_{t-1}) with the shift), [B, T, H] fp32."""
        e = k.float().pow(2).sum(-1)
        if not self.shift:
            return e
        N = e.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is None:
            first = e.new_zeros(N, e.shape[-1])
        else:  # a continued sequence writes its cached last key first
            first = state.last_k.float().pow(2).sum(-1) * (state.count > 0)[:, None]
        if cu_seqlens is None:
            return torch.cat([first[:, None], e[:, :-1]], 1)
        shifted = torch.cat([e.new_zeros(1, 1, e.shape[-1]), e[:, :-1]], 1)
        starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
        keep = ends > starts   # empty sequences have no first token
        return shifted.index_put((torch.zeros_like(starts[keep]), starts[keep]), first[keep])

    def _gates(self, x: torch.Tensor, k: torch.Tensor, state: FalconState | None, cu_seqlens) -> tuple:
        """beta ([B, T, HV] or [B, T, HV, V]) and lam ([B, T, HV]) from the hidden states, fp32."""
        lam = F.softplus(self.a_proj(x).float() + self.lam_bias)
        b = self.b_proj(x).float()
        if self.gate_param == 'gain':
            beta = 2 * torch.sigmoid(b)
        else:
            eta = F.softplus(b + self.eta_bias) / self.energy_ref
            energy = self._pair_energy(k, state, cu_seqlens).repeat_interleave(self.num_v_heads // self.num_heads, -1)
            L = energy + (lam * energy.detach() if self.lam_coupled else lam) + self.eps
            if self.per_column:
                eta = rearrange(eta, '... (h d) -> ... h d', d=self.head_v_dim)
                L = L[..., None]
            beta = -2 * torch.expm1(-eta * L / 2)
        if self.per_column and beta.dim() == 3:
            beta = rearrange(beta, '... (h d) -> ... h d', d=self.head_v_dim)
        return beta, lam

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None, Cache | None]:
        if attention_mask is not None:
            assert len(attention_mask.shape) == 2, (
                "Expected attention_mask as a 0-1 matrix with shape [batch_size, seq_len] "
                "for padding purposes (0 indicating padding). "
                "Arbitrary attention masks of shape [batch_size, seq_len, seq_len] are not allowed."
            )

        batch_size, q_len, _ = hidden_states.shape
        # kernel choice as fla's GatedDeltaNet
        if torch.is_grad_enabled():
            mode = 'chunk'
        elif q_len <= 64 and not self.training:
            mode = 'fused_recurrent'
        else:
            mode = self.mode

        last_state = get_layer_cache(module=self, past_key_values=past_key_values)

        cu_seqlens = kwargs.get('cu_seqlens')
        hidden_states, indices, cu_seqlens = unpad_hidden_states(
            hidden_states=hidden_states, cu_seqlens=cu_seqlens, attention_mask=attention_mask, q_len=q_len)

        conv_state_q, conv_state_k, conv_state_v = None, None, None
        if self.use_short_conv:
            if last_state is not None and last_state.get('conv_state') is not None:
                conv_state_q, conv_state_k, conv_state_v = last_state['conv_state']
            q, conv_state_q = self.q_conv1d(x=self.q_proj(hidden_states), cache=conv_state_q,
                                            output_final_state=use_cache, cu_seqlens=cu_seqlens)
            k, conv_state_k = self.k_conv1d(x=self.k_proj(hidden_states), cache=conv_state_k,
                                            output_final_state=use_cache, cu_seqlens=cu_seqlens)
            v, conv_state_v = self.v_conv1d(x=self.v_proj(hidden_states), cache=conv_state_v,
                                            output_final_state=use_cache, cu_seqlens=cu_seqlens)
        else:
            q = F.silu(self.q_proj(hidden_states))
            k = F.silu(self.k_proj(hidden_states))
            v = F.silu(self.v_proj(hidden_states))

        q, k = (rearrange(t, '... (h d) -> ... h d', d=self.head_k_dim) for t in (q, k))
        v = rearrange(v, '... (h d) -> ... h d', d=self.head_v_dim)
        q = self._feature_map(q, getattr(self, 'q_norm', None))
        k = self._feature_map(k, getattr(self, 'k_norm', None))

        recurrent_state = last_state['recurrent_state'] if last_state is not None else None
        if recurrent_state is not None and not isinstance(recurrent_state, FalconState):
            # fla's Cache maps states through plain tuples (e.g. when reordering beams)
            recurrent_state = FalconState(*recurrent_state)

        beta, lam = self._gates(hidden_states, k, recurrent_state, cu_seqlens)
        o, recurrent_state = run_falcon_kernel(
            mode, self.attn_mode, q, k, v, beta, lam,
            window=self.window,
            scale=1.0,
            eps=self.eps,
            eps_gamma=self.eps_gamma,
            lam_coupled=self.lam_coupled,
            shift=self.shift,
            initial_state=recurrent_state,
            output_final_state=use_cache,
            cu_seqlens=cu_seqlens,
        )

        update_layer_cache(
            module=self,
            past_key_values=past_key_values,
            recurrent_state=recurrent_state,
            conv_state=(conv_state_q, conv_state_k, conv_state_v) if self.use_short_conv else None,
            offset=q_len,
        )

        if self.use_gate:
            g = rearrange(self.g_proj(hidden_states), '... (h d) -> ... h d', d=self.head_v_dim)
            o = self.o_norm(o, g)
        else:
            o = self.o_norm(o)
        o = rearrange(o, 'b t h d -> b t (h d)')
        o = self.o_proj(o)
        o = repad_hidden_states(hidden_states=o, indices=indices, batch_size=batch_size, q_len=q_len)

        return o, None, past_key_values
