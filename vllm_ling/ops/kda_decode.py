"""One Triton launch for a KDA layer's decode step: short convolutions, gate, beta, L2 norms and the
delta-rule recurrence, for plain decodes and for speculative verify windows; no vLLM import.

vLLM 0.32 runs a KDA layer's decode as three kernels after the in-projection (the real H100 step,
``benchmarks/results/step_profile_real_h100.md``, fourth reading): the fused causal conv over q, k, v
(2.6 us), flash-linear-attention's ``kda_gate_fwd_kernel`` (3.3 us) and its recurrence (4.2 us), for a
state read and written once (2 MB per layer at Ling's 32 heads of 128 x 128 fp32: 1.3 us at the copy
bandwidth). Here the programs of a (head, sequence) do all of it: every quantity the recurrence needs
for a head (q, k, the gate over the head's 128 key channels) is computed from the layer's raw inputs
in the program that uses it, so nothing goes through memory between the steps. By default one program
owns a head's conv channels and state rows, reading each before writing it; with ``split`` programs per
head each owns 1/split of the value channels (their conv channels and state rows), all of them read the
head's q and k conv state, and the last one writes it after the others counted themselves done on an
int32 counter per (sequence, head): blocks are dispatched in index order, so the others are running
before it waits. The value channels are taken ``block_v`` at a time (a step's state tile is
[block_v, head_dim]). Every token's q, k, v and gate are made at once and the token loop is unrolled (the
tile path), except in verify windows longer than :data:`TILE_WINDOW_MAX` tokens, which loop over their tokens
making each one's inputs in its iteration (the streamed path; its conv-state stores follow the loop).

Semantics are vLLM's kernels', which :mod:`vllm_ling.ops.kda` restates in plain PyTorch (the tests
compare against those references):

* conv (``causal_conv1d_update``): the window is the conv state's ``W - 1`` columns from ``accepted - 1``
  (0 for a plain decode) followed by the sequence's new tokens; output ``silu(sum w * window)`` rounded
  to the input dtype; the state afterwards holds the window without its oldest column
  (``W - 2 + tokens`` columns), so a verify window can resume after any accepted prefix;
* gate (``fused_kda_gate``): ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` (safe gate) or
  ``-exp(A_log) * softplus(f + dt_bias)``; beta ``sigmoid`` of the raw logits;
* recurrence (``fused_recurrent_kda``): q, k L2-normalised (eps inside the sqrt), q scaled; per token
  ``S <- S * exp(g); u = beta (v - S k); S <- S + u k^T; o = S q`` with ``S`` [V, K] per head; a plain
  decode starts from and ends in ``slots[n]``, a verify window starts from ``slots[n, accepted - 1]``
  and leaves the state after its t-th token in ``slots[n, t]``.

A sequence whose slot is vLLM's null block (index <= 0: CUDA-graph padding) gets zero output and
leaves every state alone.

With an :class:`OutputNorm` the launch also applies the layer's gated output norm (vLLM's
``FusedRMSNormGated`` with the sigmoid gate, which its forward runs after the core as a kernel of its own)
to the head's outputs before it ends: the last program of a head, once the others counted their outputs
stored on the head's second counter, normalizes the head's rows in place. The kernel after this one (the
out-projection, launched as a programmatic dependent) then streams its weights during this step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

import torch

from vllm_ling.ops.cuda_jit import pdl_available

L2NORM_EPS = 1e-6  # flash-linear-attention's (inside the sqrt), as vllm_ling.ops.kda
SOFTPLUS_THRESHOLD = 20.0  # fused_kda_gate's default: softplus is linear above it
MIN_BLOCK_V = 32  # the smallest head the layer serves (every configuration's blocks tile it)
# Verify windows of at most this many tokens take the tile path (every token's q, k, v and gate made at once,
# the token loop unrolled): the path the launch table was measured on (MTP's 4-token windows). Longer ones
# (DSpark's 9) stream their tokens: the tile path ran a 9-token window in 83.8 us per layer in lease
# 2026-12-07d's real step (its loop runs to 16 and pulls each token's row out of [16, D] tiles) against
# 14.7 at 4 tokens in the benchmark
TILE_WINDOW_MAX = 4
LAUNCH_TABLE = "data/kda_decode_launch.json"  # the measured choice: written by benchmarks/kda_decode.py


def streams(spec: bool, window: int) -> bool:
    """Whether a step of ``window``-token verify windows (``spec``) or plain decodes takes the streamed path."""
    return spec and window > TILE_WINDOW_MAX


@functools.cache
def launch_table() -> dict[str, list[tuple[int, int, int, int, bool]]]:
    """{"plain" | "spec" | "stream": rows (up to sequences, value channels per step, warps, programs per head,
    state prefetch), by batch}: the fastest configuration per batch in the benchmark's last run
    (``benchmarks/kda_decode.py --launch-table``; the file says which run). "spec": the tile path's verify
    windows, "stream": the streamed path's (the spec rows where the run measured none)."""
    return table_from(json.loads(resources.files("vllm_ling").joinpath(LAUNCH_TABLE).read_text()))


def table_from(data: dict) -> dict[str, list[tuple[int, int, int, int, bool]]]:
    """The launch table of the file's JSON (:func:`launch_table`'s format)."""
    return {step: [(int(n), int(bv), int(w), int(s), bool(pf)) for n, bv, w, s, pf in data.get(step, data["spec"])]
            for step in ("plain", "spec", "stream")}


def launch_config(num_seqs: int, spec: bool, head_dim: int, stream: bool = False) -> tuple[int, int, int, bool]:
    """(value channels per step, warps, programs per head, state prefetch) for a batch of ``num_seqs``
    plain decodes or verify windows (``stream``: long ones, :func:`streams`): the launch table's row for the
    smallest measured batch that holds it; above the largest, that row's blocks with one program per head
    (the batch fills the GPU with programs anyway). Smaller heads take smaller blocks and fewer programs."""
    rows = launch_table()["stream" if stream else "spec" if spec else "plain"]
    row = next((r for r in rows if num_seqs <= r[0]), None)
    _, block_v, warps, split, prefetch = row or (*rows[-1][:3], 1, rows[-1][4])
    block_v = min(block_v, head_dim)
    return block_v, warps, max(1, min(split, head_dim // block_v)), prefetch


@dataclasses.dataclass(frozen=True)
class OutputNorm:
    """The layer's gated output norm, applied in the launch: ``gate`` [T, >= H D] the raw gate projection rows
    (unit stride; sigmoid), ``weight`` [D] the norm's weight, ``eps`` its epsilon."""

    gate: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclasses.dataclass(frozen=True)
class KdaDecodeCall:
    """One layer's decode step as the layer makes it (tensors on one device).

    ``x`` [T, >= 3 P]: the conv inputs q | k | v (a view inside the in-projection row); ``f`` [T, >= P]
    the raw gate; ``beta_logits`` [T, >= H]; ``conv_weight`` [3 P, W]; ``conv_state`` [slots, 3 P, L]
    (updated in place); ``A_log`` (H values), ``dt_bias`` [P] or None; ``state`` [slots, H, V, K]
    (updated in place); ``slots`` [N] (plain decode, one token per sequence) or [N, S] with
    ``cu_seqlens`` [N + 1] and ``accepted`` [N] (verify windows of at most S tokens); ``output_norm``: the
    layer's gated output norm applied to ``out`` in the launch (None: the core's outputs)."""

    x: torch.Tensor
    f: torch.Tensor
    beta_logits: torch.Tensor
    conv_weight: torch.Tensor
    conv_state: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor | None
    state: torch.Tensor
    slots: torch.Tensor
    scale: float
    lower_bound: float | None = None
    cu_seqlens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    output_norm: OutputNorm | None = None

    @property
    def spec(self) -> bool:
        return self.slots.dim() == 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_readers: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown counters, kept: a CUDA graph captured with one replays it
COUNTERS_PER_HEAD = 2  # a split head's: its q/k conv state's readers, its outputs' writers (the output norm)


def reserve_reader_counts(device: torch.device, heads: int) -> torch.Tensor:
    """Zeroed int32 counters on ``device``, :data:`COUNTERS_PER_HEAD` per (sequence, head) for ``heads`` of
    them, that a split head's last program waits on and zeroes again (zero between launches, so a captured
    CUDA graph keeps working). Reserve the largest batch's before capturing: a buffer made inside a capture
    would hold whatever its memory held (its zeroing is a captured kernel, run at replay only)."""
    device = torch.device(device)
    count = COUNTERS_PER_HEAD * heads
    buffer = _readers.get(device)
    if buffer is None or buffer.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kda_decode: {count} split-head counters needed inside a CUDA graph capture, "
                               f"{0 if buffer is None else buffer.numel()} reserved before it")
        if buffer is not None:
            _retired.append(buffer)
        buffer = _readers[device] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return buffer


def kda_decode(call: KdaDecodeCall, out: torch.Tensor, block_v: int | None = None,
               num_warps: int | None = None, split: int | None = None, pdl: bool | None = None,
               prefetch: bool | None = None, stream: bool | None = None) -> torch.Tensor:
    """Run the step into ``out`` [T, H, V] (rows of null-block sequences zeroed; rows past the
    sequences' tokens untouched); the conv state and the state pool in place. Returns ``out``.
    ``block_v``, ``num_warps``, ``split`` (programs per head, each its 1/split of the value channels): the
    launch configuration (default: :func:`launch_config`'s). ``pdl``: launched as a programmatic dependent
    (default: where it takes effect, sm_90+), so its programs start while the kernel before finishes (with
    ``prefetch``, reading their first state block); every read of the step's inputs and every store waits
    for that kernel. ``prefetch``: each value block's state read before the work that precedes its use (on
    the streamed path: the token loop software-pipelined, the next token's loads in flight during this
    token's state update); off, each block's read where it is used (default: :func:`launch_config`'s; off
    with an explicit ``block_v``). ``stream``: the tokens in a loop of the window's length rather than the
    tile path (default: verify windows longer than :data:`TILE_WINDOW_MAX`)."""
    heads = call.A_log.numel()
    width = call.conv_weight.shape[1]
    head_dim = call.state.shape[-1]
    window = call.slots.shape[1] if call.spec else 1
    if stream is None:
        stream = streams(call.spec, window)
    if block_v is None:
        block_v, default_warps, default_split, default_prefetch = launch_config(call.slots.shape[0], call.spec,
                                                                               head_dim, stream)
    else:
        default_warps, default_split, default_prefetch = 4, 1, False
    num_warps, split = num_warps or default_warps, split or default_split
    prefetch = default_prefetch if prefetch is None else prefetch
    if head_dim % (split * block_v):
        raise ValueError(f"{split} programs of {block_v}-channel blocks do not tile head_dim {head_dim}")
    proj = heads * head_dim
    if call.conv_weight.shape[0] != 3 * proj or call.conv_weight.stride(1) != 1 or call.conv_weight.stride(0) != width:
        raise ValueError(f"conv weight {tuple(call.conv_weight.shape)} is not a contiguous [3 x {proj}, W]")
    if call.state.shape[-2] != head_dim or head_dim % block_v or head_dim & (head_dim - 1):
        raise ValueError(f"state {tuple(call.state.shape)}: needs square power-of-2 heads divisible by {block_v}")
    norm = call.output_norm
    if out.stride(-1) != 1 or call.x.stride(-1) != 1 or call.f.stride(-1) != 1 or (norm and norm.gate.stride(-1) != 1):
        raise ValueError("x, f, the output norm's gate and out need unit-stride rows")
    if norm is not None and (norm.weight.numel() != head_dim or norm.gate.shape[-1] < proj
                             or norm.gate.shape[0] < call.x.shape[0]):
        raise ValueError(f"output norm: weight of {norm.weight.numel()} values for heads of {head_dim}, or gate "
                         f"{tuple(norm.gate.shape)} not [{call.x.shape[0]}, >= {proj}]")
    if call.x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError(f"BF16 activations only (x {call.x.dtype}, out {out.dtype}): the kernel rounds as BF16 stores")
    if call.spec:
        if call.cu_seqlens is None or call.accepted is None:
            raise ValueError("a verify window needs cu_seqlens and accepted")
        num_seqs, max_t = call.slots.shape[0], call.slots.shape[1]
        cu, acc = call.cu_seqlens, call.accepted
        stride_n, stride_t = call.slots.stride()
    else:
        num_seqs, max_t = call.slots.shape[0], 1
        cu = acc = call.slots  # unread
        stride_n, stride_t = call.slots.stride(0), 0
    if num_seqs == 0:
        return out
    if width < 2 or call.conv_state.shape[-1] < width - 2 + max_t:
        raise ValueError(f"conv state of {call.conv_state.shape[-1]} columns for width {width} and "
                         f"{max_t}-token windows")
    max_pow2 = _next_pow2(max_t)
    from vllm_ling.ops.kda_decode_kernel import kda_decode_kernel

    readers = reserve_reader_counts(out.device, num_seqs * heads) if split > 1 else call.slots  # unread unsplit
    gate, norm_w = (norm.gate, norm.weight) if norm is not None else (call.f, call.A_log)  # unread without
    if pdl is None:
        pdl = out.device.type == "cuda" and pdl_available(out.device)
    kda_decode_kernel[(split, heads, num_seqs)](
        call.x, call.x.stride(0), call.f, call.f.stride(0), call.beta_logits, call.beta_logits.stride(0),
        call.conv_weight, call.conv_state, *call.conv_state.stride(),
        call.A_log, call.dt_bias if call.dt_bias is not None else call.A_log,
        call.state, *call.state.stride(), call.slots, stride_n, stride_t, cu, acc,
        out, out.stride(0), out.stride(1), readers, gate, gate.stride(0), norm_w, float(norm.eps if norm else 0.0),
        float(call.scale), float(call.lower_bound or 0.0), L2NORM_EPS, proj,
        D=head_dim, W=width, MAX_T=max_pow2,
        LP=_next_pow2(width - 2 + max_pow2), BV=block_v, SPLIT=split, SPEC=call.spec,
        SAFE_GATE=call.lower_bound is not None, HAS_BIAS=call.dt_bias is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD, USE_PDL=pdl, PREFETCH=prefetch, STREAM=stream, NORM=norm is not None, num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}))
    return out
