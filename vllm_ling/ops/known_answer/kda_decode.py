"""The one-launch KDA decode problem: a KDA layer's decode step after its in-projection (short
convolutions, gate, beta, L2 norms, delta rule) for a plain decode batch with a padded sequence and
for two verify windows resuming after different accepted prefixes, at the layer's heads, head size,
conv width and gate.

The answer composes the plain-PyTorch functions of :mod:`vllm_ling.ops.kda` (the CPU layer's, each
tested against a direct computation in tests/ops/test_kda.py): ``causal_conv1d_update``, ``kda_gate``,
``sigmoid`` and ``kda_decode_pooled``, on copies of the same inputs and pools. Judged: the outputs per
token and head, the recurrent states of every slot the step writes per head (a state read from or
written to another slot, a gate or beta from another head, a missed decay is O(1) off), and the conv
states exactly (copies of BF16 inputs). With the output norm (``output_norm``: the launch applies the
layer's gated output norm, :class:`~vllm_ling.ops.kda_decode.OutputNorm`) the answer's outputs go through
:func:`vllm_ling.ops.kda.gated_rms_norm` (sigmoid gate), the gate being the served row's last block.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.ops import kda as kda_ops
from vllm_ling.ops.kda_decode import KdaDecodeCall, OutputNorm
from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check

# Conv inputs, states and weights are multiples of 1/8 with few significant bits, so every conv sum
# is exact in fp32 whatever its order, and the BF16 rounding of the conv outputs (the kernel's and the
# answer's, as vLLM stores them) agrees. Left: fp32 reduction order in the recurrence and the BF16
# output (2**-9 per value). Wrong work (another slot, head, gate, beta or accepted prefix) is O(1).
KDA_DECODE_RTOL = 2.0 ** -7
CONV_STATE_RTOL = 1e-12  # copies of BF16 values: equal (a nonzero tolerance for the ratio)
ROW_BLOCKS = 5  # the merged in-projection's row: [q, k, v, f, g]


def decode_calls(heads: int, head_dim: int, width: int, num_spec: int, lower_bound: float | None,
                 seed: int = 0, conv_dtype: torch.dtype = torch.float32,
                 norm_eps: float | None = None) -> dict[str, KdaDecodeCall]:
    """The two steps (CPU tensors): a plain decode of three sequences (the second padded: vLLM's
    null block 0) and two verify windows of ``num_spec + 1`` tokens (accepted 1 and ``num_spec``).
    ``norm_eps``: with the gated output norm of that epsilon (a weight spread around 1; the gate the row's
    last block), None without."""
    gen = torch.Generator().manual_seed(seed)
    proj = heads * head_dim

    def eighths(shape, most: int) -> torch.Tensor:  # k / 8 for |k| <= most: exact conv sums (above)
        return (torch.randint(-most, most + 1, shape, generator=gen) / 8).bfloat16()

    def rows(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q | k | v, f, g: the served row
        row = torch.randn((tokens, ROW_BLOCKS * proj), generator=gen).bfloat16()
        row[:, :3 * proj] = eighths((tokens, 3 * proj), 16)
        return row[:, :3 * proj], row[:, 3 * proj:4 * proj], row[:, 4 * proj:]

    weight = eighths((3 * proj, width), 4).to(conv_dtype)  # vLLM builds the conv weights in float32
    # A_log spread so that some heads decay strongly and some barely; dt_bias per channel
    A_log = torch.linspace(-2.0, 1.5, heads)
    dt_bias = torch.randn(proj, generator=gen) * 0.5

    def call(tokens: int, slots: torch.Tensor, state_len: int, **kw) -> KdaDecodeCall:
        x, f, g = rows(tokens)
        pool = int(slots.max()) + 2  # slot 0 is the null block; one slot no sequence names
        conv_state = eighths((pool, 3 * proj, state_len), 16)
        state = torch.randn((pool, heads, head_dim, head_dim), generator=gen) * 0.2
        beta_logits = torch.randn((tokens, heads), generator=gen).bfloat16() * 2
        norm = None if norm_eps is None else OutputNorm(
            g, (1 + 0.5 * torch.randn(head_dim, generator=gen)).bfloat16(), norm_eps)
        return KdaDecodeCall(x, f, beta_logits, weight, conv_state, A_log, dt_bias, state, slots, head_dim ** -0.5,
                             lower_bound, output_norm=norm, **kw)

    window = num_spec + 1
    # each sequence its own slots, in an order of its own: a state taken from the wrong position fails
    spec_slots = torch.stack([torch.randperm(window, generator=gen) + 1,
                              torch.randperm(window, generator=gen) + 1 + window]).to(torch.int32)
    return {
        "decode (3 sequences, the second padded)": call(3, torch.tensor([4, 0, 3], dtype=torch.int32), width - 1),
        f"verify windows (2 x {window} tokens, accepted 1 and {window - 1})": call(
            2 * window, spec_slots, width - 1 + num_spec,
            cu_seqlens=torch.tensor([0, window, 2 * window], dtype=torch.int32),
            accepted=torch.tensor([1, window - 1], dtype=torch.int32)),
    }


def reference(call: KdaDecodeCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outputs [T, H, D], conv state after, recurrent state after), from the plain-PyTorch functions."""
    heads, head_dim = call.A_log.numel(), call.state.shape[-1]
    conv_state, state = call.conv_state.clone(), call.state.clone()
    conv_slots = call.slots[:, 0] if call.spec else call.slots
    y = kda_ops.causal_conv1d_update(call.x.clone(), call.conv_weight, None, conv_state, conv_slots,
                                     cu_seqlens=call.cu_seqlens, num_accepted_tokens=call.accepted)
    tokens = y.shape[0]
    q, k, v = (t.reshape(tokens, heads, head_dim) for t in y.split(heads * head_dim, dim=-1))
    g = kda_ops.kda_gate(call.f, call.A_log, call.dt_bias, lower_bound=call.lower_bound)
    beta = call.beta_logits.float().sigmoid()
    bounds = call.cu_seqlens if call.spec else torch.arange(call.slots.shape[0] + 1)
    out = kda_ops.kda_decode_pooled(q, k, v, g, beta, state, bounds, call.slots, call.scale,
                                    num_accepted_tokens=call.accepted)
    norm = call.output_norm
    if norm is not None:
        gate = norm.gate[:tokens, :heads * head_dim].reshape(out.shape)  # the core's outputs stored as BF16 first
        out = kda_ops.gated_rms_norm(out.to(call.x.dtype), gate, norm.weight, norm.eps, activation="sigmoid")
    return out, conv_state, state


def _written(call: KdaDecodeCall) -> torch.Tensor:
    """The slots the step writes (bool, one per pool slot): every slot it names but the null block."""
    written = torch.zeros(call.state.shape[0], dtype=torch.bool)
    written[call.slots.long().flatten()] = True
    written[0] = False
    return written


def check_kda_decode(launch: Callable[[KdaDecodeCall, torch.Tensor], torch.Tensor], label: str, heads: int,
                     head_dim: int, width: int = 4, num_spec: int = 3, lower_bound: float | None = None,
                     device: torch.device | str = "cpu", seed: int = 0,
                     conv_dtype: torch.dtype = torch.float32, norm_eps: float | None = None) -> KernelCheckResult:
    """``launch(call, out)``: the served step into ``out`` [T, H, D] (the pools of ``call`` in place),
    on :func:`decode_calls` at the layer's shapes (``norm_eps``: with the gated output norm)."""
    cases = []
    for name, call in decode_calls(heads, head_dim, width, num_spec, lower_bound, seed, conv_dtype,
                                   norm_eps).items():
        out, conv_state, state = reference(call)
        written = _written(call)
        answers = (("outputs", out.double().reshape(-1, head_dim), KDA_DECODE_RTOL),
                   ("recurrent states after", state[written].double().reshape(-1, head_dim * head_dim),
                    KDA_DECODE_RTOL),
                   ("conv states after", conv_state[written].double().reshape(int(written.sum()), -1),
                    CONV_STATE_RTOL))
        for what, answer, rtol in answers:
            def explain(bad: torch.Tensor, what=what) -> str:
                unit = "token x head rows" if what == "outputs" else ("slot x head states" if "recurrent" in what
                                                                     else "slots")
                return f"{int(bad.sum())} of {bad.numel()} {unit} differ"
            cases.append(KnownAnswerCase(f"{name}, {what}", {"call": call, "what": what, "written": written},
                                         answer, rtol, per_row=True, explain=explain))

    def forward(inputs: dict) -> torch.Tensor:
        call: KdaDecodeCall = inputs["call"]
        moved = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}
        for name, value in moved.items():
            if torch.is_tensor(value):
                moved[name] = value.clone().to(device)
        x = moved["x"]  # the served layout again: q | k | v, f and g views inside one row
        row = x.new_zeros((x.shape[0], ROW_BLOCKS * x.shape[1] // 3))
        proj = x.shape[1] // 3
        row[:, :3 * proj], row[:, 3 * proj:4 * proj] = x, moved["f"]
        moved["x"], moved["f"] = row[:, :3 * proj], row[:, 3 * proj:4 * proj]
        norm = call.output_norm
        if norm is not None:
            row[:, 4 * proj:] = norm.gate
            moved["output_norm"] = OutputNorm(row[:, 4 * proj:], norm.weight.to(device), norm.eps)
        served = KdaDecodeCall(**moved)
        out = torch.full((x.shape[0], heads, head_dim), float("nan"), dtype=x.dtype, device=device)
        launch(served, out)
        written = inputs["written"]
        if inputs["what"] == "outputs":
            return out
        if inputs["what"] == "recurrent states after":
            return served.state.cpu()[written]
        return served.conv_state.cpu()[written].reshape(int(written.sum()), -1)

    return run_check("kda_decode", label, cases, forward)
