"""The fused KDA short-convolution problem: one causal conv over a KDA layer's q, k and v channel
blocks at once, as served (a [tokens, 3 P] view inside the wider in-projection output row, the
layer's whole conv state, the three weights as one [3 P, W] tensor), for plain decode, for a
speculative verify window, and for a prefill batch of a new sequence and a continued one.

The answer is the plain-PyTorch conv (:func:`vllm_ling.ops.kda.causal_conv1d_update` and
:func:`~vllm_ling.ops.kda.causal_conv1d_prefill`, the CPU layer's, tested against a direct convolution
in tests/ops/test_kda.py) run on each block alone with that block's weights and state: a launch that
pairs a block with another block's weights or state, writes its state elsewhere, or starts a new
sequence from a stale state, fails. Each block's weights and state differ (block b is scaled by
b + 1). Judged: the outputs row by row (BF16 inputs and state, fp32 accumulation: ``KDA_CONV_RTOL``)
and the states after exactly (copies of BF16 values: ``STATE_RTOL``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.ops import kda as kda_ops
from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check

KDA_CONV_RTOL = 2.0 ** -7  # per row: BF16 output of an fp32 sum of at most W BF16 products
STATE_RTOL = 1e-12  # the states after are copies of BF16 values: equal (a nonzero tolerance for the ratio)
BLOCKS = 3  # q, k, v
ROW_BLOCKS = 5  # the merged in-projection's row: [q, k, v, f, g]


@dataclasses.dataclass(frozen=True)
class ConvCall:
    """One conv as the layer makes it. ``x`` [T, 3 P] (a view inside the projection row), ``state``
    [slots, 3 P, L] (updated in place), ``weight`` [3 P, W]; ``indices`` one slot per sequence; for
    a verify window also ``cu_seqlens``, ``accepted`` and ``max_len``; for a prefill ``cu_seqlens``
    and ``initial`` (per sequence: continue from its slot's state, else from zeros; a prefill call
    is one with ``initial``) and, served, vLLM's ``metadata`` (its precomputed launch grid)."""

    x: torch.Tensor
    state: torch.Tensor
    weight: torch.Tensor
    indices: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    max_len: int = -1
    initial: torch.Tensor | None = None
    metadata: object | None = None


def _reference(call: ConvCall, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [T, 3 P] float64, state after [slots, 3 P, L] float64): block by block."""
    outs, states = [], []
    for b in range(BLOCKS):
        cols = slice(b * width, (b + 1) * width)
        state = call.state[:, cols].clone()
        if call.initial is not None:
            out = kda_ops.causal_conv1d_prefill(call.x[:, cols].clone(), call.weight[cols], None, state,
                                                call.cu_seqlens, call.indices, call.initial)
        else:
            out = kda_ops.causal_conv1d_update(call.x[:, cols].clone(), call.weight[cols], None, state,
                                               call.indices, cu_seqlens=call.cu_seqlens,
                                               num_accepted_tokens=call.accepted)
        outs.append(out.double())
        states.append(state.double())
    return torch.cat(outs, dim=1), torch.cat(states, dim=1)


def _calls(width: int, kernel_width: int, num_spec: int, gen: torch.Generator) -> dict[str, ConvCall]:
    slots, state_len = 6, kernel_width - 1 + num_spec
    scale = torch.arange(1, BLOCKS + 1, dtype=torch.float32).repeat_interleave(width)  # block b: x (b + 1)
    weight = (torch.randn((BLOCKS * width, kernel_width), generator=gen) * 0.5) * scale[:, None]

    def state() -> torch.Tensor:
        return (torch.randn((slots, BLOCKS * width, state_len), generator=gen) * scale[None, :, None]).bfloat16()

    def rows(tokens: int) -> torch.Tensor:  # the served layout: q, k, v inside a row of five blocks
        return torch.randn((tokens, ROW_BLOCKS * width), generator=gen).bfloat16()[:, :BLOCKS * width]

    window = num_spec + 1
    return {
        "decode (3 tokens)": ConvCall(rows(3), state(), weight, torch.tensor([4, 1, 3], dtype=torch.int32)),
        f"verify window (2 x {window} tokens, accepted 1 and {window - 1})": ConvCall(
            rows(2 * window), state(), weight, torch.tensor([2, 5], dtype=torch.int32),
            cu_seqlens=torch.tensor([0, window, 2 * window], dtype=torch.int32),
            accepted=torch.tensor([1, window - 1], dtype=torch.int32), max_len=window),
        # a new sequence of 5 tokens (its slot's stale state must not leak in) and one continued for 9
        "prefill (5 new + 9 continued tokens)": ConvCall(
            rows(14), state(), weight, torch.tensor([3, 5], dtype=torch.int32),
            cu_seqlens=torch.tensor([0, 5, 14], dtype=torch.int32), initial=torch.tensor([False, True])),
    }


def check_kda_conv(conv: Callable[[ConvCall], torch.Tensor], label: str, width: int, kernel_width: int = 4,
                   num_spec: int = 3, device: torch.device | str = "cpu", seed: int = 0) -> KernelCheckResult:
    """``conv(call)`` -> the outputs [T, 3 P], the served fused conv (``call.state`` in place), on a
    decode batch, a verify window and a prefill batch at the layer's block width ``width`` (P) and
    conv width."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for name, call in _calls(width, kernel_width, num_spec, gen).items():
        out, state = _reference(call, width)
        touched = torch.zeros(call.state.shape[0], dtype=torch.bool)
        touched[call.indices.long()] = True
        for what, ref, rtol in (("outputs", out, KDA_CONV_RTOL), ("states after", state[touched], STATE_RTOL)):
            def explain(bad: torch.Tensor, what=what) -> str:
                return f"{int(bad.sum())} of {bad.numel()} {'token rows' if what == 'outputs' else 'state rows'} differ"
            cases.append(KnownAnswerCase(f"{name}, {what}", {"call": call, "what": what, "touched": touched},
                                         ref.reshape(ref.shape[0], -1) if what != "outputs" else ref,
                                         rtol, per_row=True, explain=explain))

    def forward(inputs: dict) -> torch.Tensor:
        call: ConvCall = inputs["call"]
        row = call.x.new_zeros((call.x.shape[0], ROW_BLOCKS * width))
        row[:, :BLOCKS * width] = call.x
        served = dataclasses.replace(
            call, x=row.to(device)[:, :BLOCKS * width], state=call.state.clone().to(device),
            weight=call.weight.to(device), indices=call.indices.to(device),
            cu_seqlens=None if call.cu_seqlens is None else call.cu_seqlens.to(device),
            accepted=None if call.accepted is None else call.accepted.to(device),
            initial=None if call.initial is None else call.initial.to(device))
        out = conv(served)
        if inputs["what"] == "outputs":
            return out
        return served.state.cpu()[inputs["touched"]].reshape(int(inputs["touched"].sum()), -1)

    return run_check("kda_conv", label, cases, forward)
