"""SwiGLU with the Ling per-layer clamp: the two clamp modes, their names, and how each
implementation (plain PyTorch here, humming's activation expression, the decode kernels'
``CLAMP_GATE_OUTPUT`` define) spells them.

vLLM applies the per-layer limits in two *different* ways, and we match each:

- routed experts (FusedMoE, activation ``silu`` with ``swiglu_limit``;
  ``fused_moe/activation.py`` -> ``silu_and_mul_with_clamp``):
  ``silu(min(gate, L)) * clamp(up, -L, L)`` -- the gate is clamped *before* SiLU
  (:data:`CLAMP_GATE_INPUT`);
- shared expert (``SwigluStepAndMul`` in ``layers/activation.py``):
  ``min(silu(gate), L) * clamp(up, -L, L)`` -- the SiLU *output* is clamped
  (:data:`CLAMP_GATE_OUTPUT`).

A limit of ``None`` or ``0`` means no clamp (vLLM's ``_get_layer_swiglu_limit``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CLAMP_GATE_INPUT = "gate_input"  # vLLM fused-MoE experts: silu(min(g, L)) * clamp(u)
CLAMP_GATE_OUTPUT = "gate_output"  # vLLM SwigluStepAndMul (shared expert): min(silu(g), L) * clamp(u)
CLAMP_MODES = (CLAMP_GATE_INPUT, CLAMP_GATE_OUTPUT)
ROUTED_EXPERT_CLAMP = CLAMP_GATE_INPUT
SHARED_EXPERT_CLAMP = CLAMP_GATE_OUTPUT


def check_clamp(clamp: str) -> str:
    if clamp not in CLAMP_MODES:
        raise ValueError(f"clamp must be one of {CLAMP_MODES}, got {clamp!r}")
    return clamp


def layer_swiglu_limit(limit_list: list | None, layer_idx: int) -> float | None:
    """Per-layer limit as vLLM reads it: missing, ``None`` or ``0`` -> no clamp."""
    if not limit_list or layer_idx >= len(limit_list):
        return None
    limit = limit_list[layer_idx]
    if limit in (None, 0):
        return None
    return float(limit)


def effective_limit(limit: float | None) -> float | None:
    """The limit to apply: None for no clamp (``None`` or 0); refuses negative or NaN."""
    if limit is None:
        return None
    limit = float(limit)
    if limit < 0 or math.isnan(limit):
        raise ValueError(f"swiglu_limit must be None, 0 or positive, got {limit}")
    return limit if limit > 0 else None


def swiglu(x: torch.Tensor, limit: float | None = None,
           clamp: str = ROUTED_EXPERT_CLAMP) -> torch.Tensor:
    """SwiGLU on [..., 2d] (gate first, then up) -> [..., d], computed in x's dtype.

    ``limit`` None/0: ``silu(gate) * up``. Otherwise ``clamp`` picks where the gate is
    clamped (see the module docstring); ``up`` is always clamped to [-limit, limit].
    """
    check_clamp(clamp)
    gate, up = x.chunk(2, dim=-1)
    limit = effective_limit(limit)
    if limit is None:
        return F.silu(gate) * up
    up = up.clamp(min=-limit, max=limit)
    if clamp == CLAMP_GATE_INPUT:
        return F.silu(gate.clamp(max=limit)) * up
    return F.silu(gate).clamp(max=limit) * up


def swiglu_activation_expr(limit: float | None, clamp: str = ROUTED_EXPERT_CLAMP) -> str:
    """C++ expression of floats ``a`` (gate) and ``b`` (up) for humming's ``binary_split``
    input processing: the clamp is done inside humming's activation kernel, no extra pass."""
    limit = effective_limit(limit)
    if limit is None:
        return "(a / (1.f + expf(-a))) * b"
    lim = f"({limit!r}f)"
    up = f"fmaxf(fminf(b, {lim}), -{lim})"
    if clamp == CLAMP_GATE_INPUT:
        return f"(fminf(a, {lim}) / (1.f + expf(-fminf(a, {lim})))) * {up}"
    if clamp == CLAMP_GATE_OUTPUT:
        return f"fminf(a / (1.f + expf(-a)), {lim}) * {up}"
    raise ValueError(f"clamp must be one of {CLAMP_MODES}, got {clamp!r}")


def clamp_define(clamp: str) -> int:
    """The decode kernels' ``CLAMP_GATE_OUTPUT`` define: 1 clamps the SiLU output, 0 its input."""
    return int(check_clamp(clamp) == CLAMP_GATE_OUTPUT)
