"""SwiGLU with Ling's per-layer clamp: the two clamp modes (:class:`SwigluClamp`, their one
home), which mode each MoE part serves, and how each implementation (plain PyTorch here,
humming's activation expression, the decode kernels' ``CLAMP_GATE_OUTPUT`` define) spells them.

With a limit ``L`` the up projection is always clamped to ``[-L, L]``; the modes differ in where
the gate ``g`` is clamped:

- :attr:`SwigluClamp.GATE_OUTPUT`, ``min(silu(g), L) * clamp(u, -L, L)``: the form Ling-3.0 was
  trained with and what vllm-ling serves on the routed *and* shared experts. The public
  implementations agree: llama.cpp's ``build_moe_ffn`` for ``bailingmoe3``
  (``gate_act = ggml_silu(cur); gate_act = ggml_clamp(gate_act, -INFINITY, limit)``, limits
  ``swiglu_clamp_exp`` / ``_shexp``), vLLM's ``SwigluStepAndMul`` (``silu(x[:d]).clamp(max=limit)
  * x[d:].clamp(-limit, limit)``; vLLM 0.32 uses it for Ling's shared expert), and, per the
  study notes (issue 43), inclusionAI's SGLang branch ("Bailing SwiGLU", FlashInfer
  ``SwigluStep``), sglang-jax (``clip(silu(g), max=L) * clip(u, -L, L)``) and vLLM 0.34's
  ``activation="swiglustep"`` (a later vLLM main we could read, commit 055e47c, passes
  ``activation="silu"`` with ``swiglu_limit`` again: recheck on every vLLM upgrade).
- :attr:`SwigluClamp.GATE_INPUT`, ``silu(min(g, L)) * clamp(u, -L, L)``: what vLLM 0.32's own
  fused-MoE path computes for Ling's routed experts (``activation="silu"`` with
  ``swiglu_limit`` -> ``silu_and_mul_with_clamp``; its humming backend's ``_CLAMPED_SILU_IMPL``
  clamps ``fminf(a, limit)`` before the SiLU too): the upstream composition
  (``VLLM_LING_MOE_BACKEND=vllm``) serves this, :data:`VLLM_ROUTED_EXPERT_CLAMP`.

The two agree while ``g <= L``; above it the gate-input form gives at most ``silu(L)`` where the
trained form gives ``L`` (1.8 % low at L=4, 0.09 % at L=7). A limit of ``None`` or ``0`` means
no clamp (vLLM's ``_get_layer_swiglu_limit``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_ling.options import Choice


class SwigluClamp(Choice):
    """Where the per-layer limit L clamps the gate g (the up projection u is always clamped)."""

    GATE_INPUT = "gate_input"    # silu(min(g, L)) * clamp(u, -L, L): vLLM 0.32's fused-MoE routed experts
    GATE_OUTPUT = "gate_output"  # min(silu(g), L) * clamp(u, -L, L): as trained (SwigluStep)

    @property
    def formula(self) -> str:
        return {SwigluClamp.GATE_INPUT: "silu(min(g, L)) * clamp(u, -L, L)",
                SwigluClamp.GATE_OUTPUT: "min(silu(g), L) * clamp(u, -L, L)"}[self]

    @property
    def where(self) -> str:
        return "before the SiLU" if self is SwigluClamp.GATE_INPUT else "after the SiLU"

    def describe(self) -> str:
        return f"clamped {self.where}, {self.formula}"


ROUTED_EXPERT_CLAMP = SwigluClamp.GATE_OUTPUT  # every routed-expert path vllm-ling owns
SHARED_EXPERT_CLAMP = SwigluClamp.GATE_OUTPUT  # vLLM's SwigluStepAndMul, which serves the shared expert
VLLM_ROUTED_EXPERT_CLAMP = SwigluClamp.GATE_INPUT  # vLLM 0.32's own MoE methods (the upstream composition)


def check_clamp(clamp: SwigluClamp | str) -> SwigluClamp:
    """The mode as a member (benchmarks pass the plain word); refuses anything else."""
    try:
        return SwigluClamp(clamp)
    except ValueError:
        raise ValueError(f"clamp must be one of {[m.value for m in SwigluClamp]}, got {clamp!r}") from None


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
           clamp: SwigluClamp | str = ROUTED_EXPERT_CLAMP) -> torch.Tensor:
    """SwiGLU on [..., 2d] (gate first, then up) -> [..., d], computed in x's dtype.

    ``limit`` None/0: ``silu(gate) * up``. Otherwise ``clamp`` picks where the gate is
    clamped (see the module docstring); ``up`` is always clamped to [-limit, limit].
    """
    clamp = check_clamp(clamp)
    gate, up = x.chunk(2, dim=-1)
    limit = effective_limit(limit)
    if limit is None:
        return F.silu(gate) * up
    up = up.clamp(min=-limit, max=limit)
    if clamp is SwigluClamp.GATE_INPUT:
        return F.silu(gate.clamp(max=limit)) * up
    return F.silu(gate).clamp(max=limit) * up


def swiglu_activation_expr(limit: float | None, clamp: SwigluClamp | str = ROUTED_EXPERT_CLAMP) -> str:
    """C++ expression of floats ``a`` (gate) and ``b`` (up) for humming's ``binary_split``
    input processing: the clamp is done inside humming's activation kernel, no extra pass.
    (Unlike vLLM's humming ``SWIGLUSTEP`` expression, whose limit is the literal ``7.f``, the
    layer's own limit is written in.)"""
    clamp = check_clamp(clamp)
    limit = effective_limit(limit)
    if limit is None:
        return "(a / (1.f + expf(-a))) * b"
    lim = f"({limit!r}f)"
    up = f"fmaxf(fminf(b, {lim}), -{lim})"
    if clamp is SwigluClamp.GATE_INPUT:
        return f"(fminf(a, {lim}) / (1.f + expf(-fminf(a, {lim})))) * {up}"
    return f"fminf(a / (1.f + expf(-a)), {lim}) * {up}"


def clamp_define(clamp: SwigluClamp | str) -> int:
    """The decode kernels' ``CLAMP_GATE_OUTPUT`` define: 1 clamps the SiLU output, 0 its input."""
    return int(check_clamp(clamp) is SwigluClamp.GATE_OUTPUT)
