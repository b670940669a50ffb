"""Plain-PyTorch reference of the Ling-3.0 MoE block: routed experts, shared expert, whole
block, in float32 (the independent reference the kernels are tested against and the CPU
path of the layer).

Semantics follow vLLM 0.32's Ling model (``model_executor/models/bailing_moe_v3.py``) except the
routed experts' SwiGLU clamp, which is applied after the SiLU as Ling was trained (vLLM 0.32
clamps the gate before it; :mod:`vllm_ling.ops.moe.activation`); the router is
:mod:`vllm_ling.ops.moe.routing`.

Weights use vLLM's MXFP4 MoE layout: ``w13_weight`` uint8 [E, 2I, H/2] (gate rows, then up
rows), ``w13_weight_scale`` uint8 E8M0 [E, 2I, H/32], ``w2_weight`` uint8 [E, H, I/2],
``w2_weight_scale`` uint8 [E, H, I/32]; or real weights [E, 2I, H] / [E, H, I].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_ling.ops.fp8 import FP8_E4M3_MAX
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, SHARED_EXPERT_CLAMP, SwigluClamp, swiglu
from vllm_ling.ops.moe.routing import route
from vllm_ling.ops.mxfp4 import MXFP4_GROUP_SIZE, mxfp4_dequantize


@dataclasses.dataclass(frozen=True)
class LingMoEConfig:
    """The routing/shape fields of a Ling MoE layer (from the HF config)."""

    num_experts: int = 512
    top_k: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    hidden_size: int = 2560
    moe_intermediate_size: int = 768
    shared_intermediate_size: int = 768

    @classmethod
    def from_hf_config(cls, config: Any) -> "LingMoEConfig":
        get = (config.get if isinstance(config, dict)
               else lambda k, d=None: getattr(config, k, d))
        shared = get("moe_shared_expert_intermediate_size") or get("moe_intermediate_size")
        return cls(
            num_experts=int(get("num_experts")),
            top_k=int(get("num_experts_per_tok")),
            n_group=int(get("n_group") or 1),
            topk_group=int(get("topk_group") or 1),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
            hidden_size=int(get("hidden_size")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_intermediate_size=int(shared) * int(get("num_shared_experts") or 1),
        )


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Round rows to FP8 e4m3 with a per-row dynamic scale amax/448 (what a W4A8 kernel
    does to its activations), returned dequantized in float32."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
    if w.dtype == torch.uint8:
        if scale is None:
            raise ValueError("MXFP4 (uint8) expert weights need their E8M0 scales")
        return mxfp4_dequantize(w[e], scale[e], MXFP4_GROUP_SIZE, torch.float32)
    return w[e].float()


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    clamp: SwigluClamp = ROUTED_EXPERT_CLAMP,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """Weighted routed-expert sum in float32: sum_k w[t,k] * expert_{id[t,k]}(x[t]).

    ``w13`` [E, 2I, H] / ``w2`` [E, H, I] real weights, or MXFP4 uint8 [E, 2I, H/2] /
    [E, H, I/2] with ``w13_scale`` / ``w2_scale`` (only the selected experts are
    dequantized). ``fp8_activations`` rounds both GEMM inputs to FP8 e4m3 per token, as
    the W4A8 kernel does. Returns float32 [T, H].
    """
    xf = x.float()
    T = xf.shape[0]
    H = w2.shape[1]
    out = torch.zeros(T, H, dtype=torch.float32, device=xf.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13_e = _expert_weight(w13, w13_scale, e)
        w2_e = _expert_weight(w2, w2_scale, e)
        xe = xf[tok]
        if fp8_activations:
            xe = fake_quant_fp8_per_token(xe)
        act = swiglu(xe @ w13_e.t(), swiglu_limit, clamp)
        if fp8_activations:
            act = fake_quant_fp8_per_token(act)
        y = act @ w2_e.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
    return out


def shared_expert_reference(x: torch.Tensor, gate_up_weight: torch.Tensor,
                            down_weight: torch.Tensor, swiglu_limit: float | None = None,
                            clamp: SwigluClamp = SHARED_EXPERT_CLAMP) -> torch.Tensor:
    """Dense SwiGLU MLP ([2I, H] gate_up, [H, I] down) in float32 -> [T, H]."""
    h = x.float() @ gate_up_weight.float().t()
    return swiglu(h, swiglu_limit, clamp) @ down_weight.float().t()


def moe_block_reference(
    x: torch.Tensor,
    cfg: LingMoEConfig,
    *,
    gate_weight: torch.Tensor,
    expert_bias: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    routed_swiglu_limit: float | None = None,
    shared_swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Whole Ling MoE block: routed (scaled) experts + shared expert, float32 [T, H]."""
    weights, ids = route(x, gate_weight, expert_bias, top_k=cfg.top_k, n_group=cfg.n_group,
                         topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                         routed_scaling_factor=cfg.routed_scaling_factor)
    routed = experts_reference(x, w13, w2, weights, ids, routed_swiglu_limit,
                               w13_scale=w13_scale, w2_scale=w2_scale)
    shared = shared_expert_reference(x, shared_gate_up, shared_down, shared_swiglu_limit)
    return routed + shared


