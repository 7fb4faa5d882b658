# -*- coding: utf-8 -*-
"""Shared pieces of every Falcon op: the rule table, the continuation state and input validation.

Every op (`naive_recurrent_falcon`, `fused_recurrent_falcon`, `chunk_falcon`) takes the same
arguments and the same :class:`FalconState`, and validates them here, so a bad argument gets the
same `ValueError`/`TypeError` whichever kernel was asked for.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# rule -> (regression?, per-column gains?, windowed?)
RULES = {
    'falcon1': (True, False, False),
    'falcon2': (True, True, False),
    'falcon3': (True, False, True),
    'falcon1a': (False, False, False),
    'falcon2a': (False, True, False),
    'falcon3a': (False, False, True),
}

DEFAULT_EPS = 1e-6
DEFAULT_EPS_GAMMA = 1e-4


def rule_info(rule: str) -> tuple[bool, bool, bool]:
    """`(regression, per_column, windowed)` for a rule name; `ValueError` for an unknown one."""
    if not isinstance(rule, str) or rule not in RULES:
        raise ValueError(f"rule must be one of {sorted(RULES)}, got {rule!r}")
    return RULES[rule]


class FalconState(NamedTuple):
    """Everything exact continuation needs, for `N` sequences (fp32, or fp64 with fp64 inputs).

    - ``S``: ``[N, HV, K, V]`` the fast-weight matrix.
    - ``last_k``: ``[N, H, K]`` the last key feature seen: with ``shift=True`` it is the write
      feature ``x`` of the next segment's first step.
    - ``tail_x``: ``[N, H, W-1, K]`` and ``tail_v``: ``[N, HV, W-1, V]``: the last ``W-1`` pairs
      ``(x_j, v_j)`` of the windowed rules (``W = window``; empty for the other rules), oldest
      first and right-aligned: the real pairs are the last ``n_tail`` rows, the rows before them
      are zero.
    - ``count``: ``[N]`` int32, ``min(tokens seen, W)`` (read clamped into ``[0, W]``). ``0`` means a
      fresh sequence (no last key, empty tail); with ``shift=True`` the tail holds ``count - 1`` real
      pairs, with ``shift=False`` it holds ``min(count, W - 1)``.

    A zero state with ``count = 0`` is the same as no state. A state is tied to the ``window`` it
    was made with (through the tail length); the other rule options are not stored.
    """

    S: torch.Tensor
    last_k: torch.Tensor
    tail_x: torch.Tensor
    tail_v: torch.Tensor
    count: torch.Tensor

    @property
    def window(self) -> int:
        return self.tail_x.shape[2] + 1

    def n_tail(self, shift: bool = True) -> torch.Tensor:
        """Number of real pairs in the tail, per sequence."""
        if shift:
            return (self.count - 1).clamp(min=0)
        return self.count.clamp(max=self.window - 1)

    @staticmethod
    def zeros(N: int, H: int, HV: int, K: int, V: int, window: int = 1, device=None,
              dtype: torch.dtype = torch.float32) -> 'FalconState':
        return FalconState(
            S=torch.zeros(N, HV, K, V, device=device, dtype=dtype),
            last_k=torch.zeros(N, H, K, device=device, dtype=dtype),
            tail_x=torch.zeros(N, H, window - 1, K, device=device, dtype=dtype),
            tail_v=torch.zeros(N, HV, window - 1, V, device=device, dtype=dtype),
            count=torch.zeros(N, device=device, dtype=torch.int32),
        )

    def detach(self) -> 'FalconState':
        return FalconState(*(t.detach() for t in self))

    def index(self, idx) -> 'FalconState':
        """The state of some sequences (e.g. reorder a cache for beam search)."""
        return FalconState(*(t[idx] for t in self))


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def validate_falcon_inputs(
    q, k, v, beta, lam, *, rule, window, scale, eps, eps_gamma, lam_coupled, shift,
    initial_state, cu_seqlens,
) -> tuple[float, int]:
    """Checks every argument of a Falcon op; returns `(scale, N)` with N the number of sequences."""
    for name, t in (('q', q), ('k', k), ('v', v), ('beta', beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if lam is not None and not isinstance(lam, torch.Tensor):
        raise TypeError(f"lam must be a torch.Tensor or None, got {type(lam).__name__}")
    _, per_column, windowed = rule_info(rule)
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be an int, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if window != 1 and not windowed:
        raise ValueError(f"window={window} is only used by falcon3/falcon3a; rule {rule!r} needs window=1")
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims [B, T, H, D], got shape {_shape(t)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {_shape(q)}, got {_shape(k)}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must have batch and length {(B, T)} like q, got shape {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v has {HV} heads, which is not a multiple of the {H} heads of q/k")
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"head dims must be positive, got q {_shape(q)} and v {_shape(v)}")
    for name, t in (('k', k), ('v', v), ('beta', beta)) + ((('lam', lam),) if lam is not None else ()):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    want_beta = (B, T, HV, V) if per_column else (B, T, HV)
    if tuple(beta.shape) != want_beta:
        kind = 'per-column gains [B, T, HV, V]' if per_column else 'one gain per head [B, T, HV]'
        raise ValueError(f"beta for {rule} must be {kind} = {want_beta}, got {_shape(beta)}")
    if lam is not None:
        if not lam.is_floating_point():
            raise TypeError(f"lam must be a floating-point tensor, got {lam.dtype}")
        if tuple(lam.shape) != (B, T, HV):
            raise ValueError(f"lam must have shape [B, T, HV] = {(B, T, HV)}, got {_shape(lam)}")
    elif lam_coupled:
        raise ValueError("lam_coupled=True needs lam (the dimensionless ridge); got lam=None")
    if scale is None:
        scale = K ** -0.5
    if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if not isinstance(eps_gamma, (int, float)) or not 0 < eps_gamma < 1:
        raise ValueError(f"eps_gamma must be a float in (0, 1), got {eps_gamma!r}")
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be a bool, got {type(shift).__name__}")
    if not isinstance(lam_coupled, bool):
        raise TypeError(f"lam_coupled must be a bool, got {type(lam_coupled).__name__}")

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.LongTensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D tensor of N+1 offsets, got shape {_shape(cu_seqlens)}")
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got {B}")
        cpu = cu_seqlens.detach().cpu()
        if int(cpu[0]) != 0 or int(cpu[-1]) != T or bool((cpu[1:] < cpu[:-1]).any()):
            raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cpu.tolist()}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, FalconState):
            raise TypeError(
                f"initial_state must be a FalconState (matrix, last key, window tail, count), "
                f"got {type(initial_state).__name__}")
        want = FalconState(
            S=(N, HV, K, V), last_k=(N, H, K), tail_x=(N, H, window - 1, K),
            tail_v=(N, HV, window - 1, V), count=(N,))
        for field, t, shape in zip(FalconState._fields, initial_state, want):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"initial_state.{field} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"initial_state.{field} must have shape {shape} for N={N} sequences and window={window}, "
                    f"got {_shape(t)}")
            if t.device != q.device:
                raise ValueError(f"initial_state.{field} is on {t.device} but q is on {q.device}")
        if initial_state.count.is_floating_point():
            raise ValueError("initial_state.count must be an integer tensor")
    return float(scale), N
