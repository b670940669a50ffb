"""A KDA layer's decode step after its in-projection, at Ling-3.0-flash's shape (32 heads of 128, conv
width 4, safe gate): vllm-ling's one Triton launch (``vllm_ling.ops.kda_decode``, each block size and warp
count tried) against vLLM 0.32's three kernels as the fused-conv layer runs them (the conv update over q, k
and v in one launch, ``fused_kda_gate``, ``fused_recurrent_kda`` or ``_fwd`` for verify windows), in CUDA
graphs of 35 distinct layers (a step's KDA layers, each its own state pool: 70 MB of states, more than
the 60 MB L2), for plain decode batches and MTP verify windows of 4 tokens. A head runs in one program or
split over 2 or 4 (each its share of the value channels; more programs at small batches). As served, the
launch applies the layer's gated output norm (``OutputNorm``; ``--no-output-norm``: the core alone), and vLLM's
side runs vLLM's norm kernel after its three (``rms_norm_gated``; the served vLLM step compiles the norm with
Inductor instead, 1.9 us in lease 2026-12-07g).

    python -m benchmarks.kda_decode --out benchmarks/results/kda_decode_h100.md   # on the GPU (_h200 on an H200)

Bytes per layer: the recurrent state read and written (32 x 128 x 128 fp32 = 2 MB per sequence; a verify
window writes one state per position), the conv state read and written, the inputs and the output. In the
real H100 step vLLM's three took 2.6 + 3.3 + 4.2 us per layer at one token
(``benchmarks/results/step_profile_real_h100.md``, fourth reading).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from importlib import resources

import torch

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from vllm_ling.models.dspark_format import read_fields
from vllm_ling.ops.kda_decode import TILE_WINDOW_MAX, KdaDecodeCall, OutputNorm, kda_decode, streams
from vllm_ling.runtime.spec_policy import DEFAULT_DSPARK_CONFIG, load_config

CONFIG = json.loads(resources.files("vllm_ling").joinpath("data/ling3_flash_fp4_config.json").read_text())
HEADS, HEAD_DIM, WIDTH = CONFIG["num_attention_heads"], CONFIG["head_dim"], CONFIG["short_conv_kernel_size"]
LAYERS = 35  # Ling-3.0-flash's KDA layers
NUM_SPEC = 3
# DSpark's verify window: the packaged drafter's block of draft tokens + 1
DSPARK_WINDOW = read_fields(load_config(DEFAULT_DSPARK_CONFIG), str(DEFAULT_DSPARK_CONFIG)).block_size + 1
# (value channels per step, warps, programs per head, state prefetch): what serves (the launch table) and its
# neighbours, each block's state read where it is used (fastest at every batch in lease 2026-12-07b); the served
# shapes with the prefetch; and programs of one or two warps, as vLLM's recurrence runs (one warp per [32, 128]
# state tile: its sums over the key channels stay within the warp; 3.9 us per layer in lease 07b's real step).
# Lease 07b's losers at every batch are out: 128-channel blocks or one 32-channel block per program with the
# prefetch, 8 programs of 16 channels with the prefetch and 2 or 4 warps. On the streamed path (DSpark's windows)
# the prefetch pipelines the token loop: the streamed rows' configuration both ways.
CONFIGS = [(32, 4, 4, False), (32, 8, 4, False), (32, 8, 4, True), (64, 4, 2, False), (64, 8, 1, False),
           (32, 4, 1, False),
           (128, 8, 1, False), (128, 16, 1, False), (32, 4, 4, True), (64, 4, 2, True), (64, 8, 1, True),
           (32, 1, 4, False), (32, 2, 4, False), (32, 1, 4, True), (16, 1, 8, False), (16, 2, 8, False),
           (32, 1, 1, False)]


def layer_calls(seqs: int, window: int, norm: bool = True) -> list[KdaDecodeCall]:
    """One call per layer, each with its own pools; ``window`` 1: plain decode, else verify windows; ``norm``:
    with the layer's gated output norm (the gate the merged row's last block), as served."""
    proj = HEADS * HEAD_DIM
    spec = window > 1
    slots_per_seq = window if spec else 1
    pool = seqs * slots_per_seq + 1
    state_len = WIDTH - 1 + (window - 1 if spec else 0)
    calls = []
    for _ in range(LAYERS):
        tokens = seqs * window
        row = torch.randn(tokens, 5 * proj, device="cuda").bfloat16()
        slots = (torch.arange(seqs * slots_per_seq, device="cuda", dtype=torch.int32) + 1).view(seqs, slots_per_seq)
        calls.append(KdaDecodeCall(
            row[:, :3 * proj], row[:, 3 * proj:4 * proj], torch.randn(tokens, HEADS, device="cuda").bfloat16(),
            torch.randn(3 * proj, WIDTH, device="cuda") * 0.3,
            torch.randn(pool, 3 * proj, state_len, device="cuda").bfloat16(),
            torch.linspace(-2, 1, HEADS, device="cuda"), torch.randn(proj, device="cuda") * 0.5,
            torch.randn(pool, HEADS, HEAD_DIM, HEAD_DIM, device="cuda") * 0.1,
            slots if spec else slots[:, 0], HEAD_DIM ** -0.5, CONFIG.get("kda_lower_bound", -5.0),
            torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * window if spec else None,
            torch.full((seqs,), window - 1, device="cuda", dtype=torch.int32) if spec else None,
            OutputNorm(row[:, 4 * proj:], (1 + 0.2 * torch.randn(HEAD_DIM, device="cuda")).bfloat16(),
                       CONFIG["rms_norm_eps"]) if norm else None))
    return calls


def step_bytes(seqs: int, window: int, norm: bool = False) -> int:
    """A step's bytes: states, conv states, its rows (``norm``: and the output gate's rows the norm reads)."""
    proj = HEADS * HEAD_DIM
    state = HEADS * HEAD_DIM * HEAD_DIM * 4
    states = seqs * state * (1 + window)  # read once, written per position (plain: once)
    conv = seqs * 3 * proj * 2 * ((WIDTH - 1) + (WIDTH - 2 + window))
    rows = seqs * window * (3 * proj * 2 + proj * 2 + HEADS * 2 + proj * 2)  # qkv, f, beta logits in; output
    gate = seqs * window * proj * 2 if norm else 0
    return states + conv + rows + gate


def vllm_step(call: KdaDecodeCall):
    """vLLM's kernels for ``call`` as the fused-conv layer runs them: a function running the conv update
    over q, k and v, ``fused_kda_gate``, the sigmoid and the recurrence (the pools of ``call`` in place)
    and returning the output [tokens, heads, head_dim] (None without vLLM). The GPU tests compare the
    kernel with it. With the call's output norm, vLLM's norm kernel after them (``rms_norm_gated``)."""
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
        from vllm.third_party.flash_linear_attention.ops.kda import (fused_kda_gate, fused_recurrent_kda,
                                                                      fused_recurrent_kda_fwd, rms_norm_gated)
    except Exception:  # noqa: BLE001 - kernel-only device bundles carry no vLLM
        return None
    heads, head_dim = call.A_log.numel(), call.state.shape[-1]
    n = call.x.shape[0]
    out = torch.empty_like(call.x)
    core = torch.empty((n, heads, head_dim), dtype=call.x.dtype, device=call.x.device)  # the layer's output
    cu_plain = torch.arange(n + 1, device=call.x.device, dtype=torch.int32)

    def run() -> torch.Tensor:
        if call.spec:
            y = causal_conv1d_update(call.x, call.conv_state, call.conv_weight, None, activation="silu",
                                     conv_state_indices=call.slots[:, 0], num_accepted_tokens=call.accepted,
                                     query_start_loc=call.cu_seqlens, max_query_len=call.slots.shape[1],
                                     validate_data=False, out=out)
        else:
            y = causal_conv1d_update(call.x, call.conv_state, call.conv_weight, None, activation="silu",
                                     conv_state_indices=call.slots, validate_data=False, out=out)
        # as the served layer passes them (vllm_ling.layers.kda_fused_conv): views at plain decode, copies for
        # verify windows (timing copies the served step does not make put vLLM's time at 14.0 us per layer in
        # lease 2026-12-07b, against 9.8 in the real step)
        q, k, v = (t.unflatten(-1, (heads, head_dim)).unsqueeze(0) for t in y.split(heads * head_dim, dim=-1))
        if call.spec:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = fused_kda_gate(call.f.contiguous(), call.A_log, head_dim, g_bias=call.dt_bias,
                           lower_bound=call.lower_bound).unsqueeze(0)
        beta = call.beta_logits.float().sigmoid().unsqueeze(0)
        if call.spec:
            o, _ = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=call.scale, initial_state=call.state,
                                           inplace_final_state=True, cu_seqlens=call.cu_seqlens,
                                           ssm_state_indices=call.slots, num_accepted_tokens=call.accepted,
                                           use_qk_l2norm_in_kernel=True)
        else:
            o, _ = fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=call.scale, initial_state=call.state,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu_plain,
                                       ssm_state_indices=call.slots)
        core.copy_(o[0])  # the layer copies the result into its output (a kernel in the served step)
        norm = call.output_norm
        if norm is None:
            return core
        return rms_norm_gated(core, norm.gate.unflatten(-1, (heads, head_dim)), norm.weight, None,
                              activation="sigmoid", eps=norm.eps)
    return run


def config_name(config: tuple[int, int, int, bool]) -> str:
    block_v, warps, split, prefetch = config
    return f"bv{block_v} w{warps}{f' x{split}' if split > 1 else ''}{'' if prefetch else ' no-pf'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # windows of 4 tokens (MTP's, the kernel's tile path) and DSpark's (its streamed path)
    parser.add_argument("--cases", default=f"1x1,2x1,4x1,8x1,1x4,2x4,4x4,1x{DSPARK_WINDOW},2x{DSPARK_WINDOW}",
                        help="sequences x window tokens")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-output-norm", dest="norm", action="store_false",
                        help="the core alone on both sides (served: the launch applies the layer's output norm)")
    parser.add_argument("--launch-table", metavar="JSON", default=None,
                        help="also write the fastest configuration per batch as vllm_ling/data/kda_decode_launch.json "
                             "takes it (what launch_config serves)")
    args = parser.parse_args(argv)
    bw, how = copy_bandwidth_gbs()
    rows = []
    for case in args.cases.split(","):
        seqs, window = (int(v) for v in case.split("x"))
        calls = layer_calls(seqs, window, args.norm)
        outs = [torch.empty(seqs * window, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in calls]
        nbytes = step_bytes(seqs, window, args.norm)
        timed = {}
        for config in CONFIGS:  # launched plainly, as the served configuration's first column
            timed[config] = stacked_time_us(
                [lambda c=c, o=o, b=config: kda_decode(c, o, block_v=b[0], num_warps=b[1], split=b[2], pdl=False,
                                                       prefetch=b[3])
                 for c, o in zip(calls, outs)], args.iters)
        # the configuration launch_config serves, without and with programmatic dependent launch (each layer's
        # kernel reads its first state block while the one before finishes: here the previous layer's KDA kernel,
        # in the served step the b_proj small GEMV)
        served = {pdl: stacked_time_us([lambda c=c, o=o, p=pdl: kda_decode(c, o, pdl=p) for c, o in zip(calls, outs)],
                                       args.iters) for pdl in (False, True)}
        # verify windows: the served configuration on the kernel's other path (tile or streamed), which says
        # where kda_decode.TILE_WINDOW_MAX belongs
        other = None if window == 1 else stacked_time_us(
            [lambda c=c, o=o: kda_decode(c, o, stream=not streams(True, window)) for c, o in zip(calls, outs)],
            args.iters)
        theirs = [vllm_step(dataclasses.replace(c)) for c in calls]
        their_us = None if theirs[0] is None else stacked_time_us(theirs, args.iters)
        best = min(timed, key=timed.get)
        rows.append((seqs, window, nbytes, timed, best, their_us, served, other))
        print(f"{case}: best {best} {timed[best]:.2f} us, vLLM {their_us} us", file=sys.stderr)
    header = " | ".join(config_name(c) + " (us)" for c in CONFIGS)
    lines = [f"# A KDA layer's decode step ({torch.cuda.get_device_name()})", "",
             f"{HEADS} heads of {HEAD_DIM}, conv width {WIDTH}, safe gate; verify windows of w tokens resume after "
             f"w - 1 accepted; windows of more than {TILE_WINDOW_MAX} tokens take the kernel's streamed path; "
             + ("with the layer's gated output norm (vLLM's side: its norm kernel after its three). "
                if args.norm else "the core alone (--no-output-norm). ") +
             f"CUDA-graph medians ({args.iters} replays) of {LAYERS} distinct layers "
             f"(own pools each), us per layer. Copy bandwidth in this run: {bw:,.0f} GB/s ({how}).", "",
             f"| sequences x tokens | bytes | {header} | best ours (us) | fraction of copy BW (best) "
             "| vLLM's three kernels (us) | vLLM / best ours | served config (us) | served with PDL (us) "
             "| served, other path (us) |",
             "|---|---|" + "---|" * len(CONFIGS) + "---|---|---|---|---|---|---|"]
    for seqs, window, nbytes, timed, best, their_us, served, other in rows:
        cells = " | ".join(f"{timed[c]:.2f}" for c in CONFIGS)
        frac = nbytes / (timed[best] * 1e-6) / (bw * 1e9)
        ratio = f"{their_us / timed[best]:.2f}x" if their_us else "-"
        lines.append(f"| {seqs} x {window} | {nbytes:,} | {cells} | {timed[best]:.2f} ({config_name(best)}) "
                     f"| {frac:.2f} | {'-' if their_us is None else f'{their_us:.2f}'} | {ratio} "
                     f"| {served[False]:.2f} | {served[True]:.2f} | {'-' if other is None else f'{other:.2f}'} |")
    write_outputs("\n".join(lines) + "\n", args.out)
    if args.launch_table:
        table = launch_table_of([(seqs, window, best) for seqs, window, _, _, best, _, _, _ in rows],
                                f"benchmarks/kda_decode.py on the {torch.cuda.get_device_name()}, "
                                f"{time.strftime('%Y-%m-%d')}: the fastest configuration per batch")
        with open(args.launch_table, "w") as f:
            f.write(json.dumps(table, indent=2) + "\n")
    return 0


def launch_table_of(bests: list[tuple[int, int, tuple[int, int, int, bool]]], source: str) -> dict:
    """The launch table (vllm_ling.ops.kda_decode.launch_table's file) from (sequences, window tokens, fastest
    configuration) per measured batch: a row per batch, plain decodes, the tile path's verify windows and the
    streamed path's apart (the last only where measured), by size."""
    table = {"source": source, "columns": ["up to sequences", "value channels per step", "warps", "programs per head",
                                           "state prefetch"], "plain": [], "spec": [], "stream": []}
    for seqs, window, (block_v, warps, split, prefetch) in sorted(bests):
        step = "stream" if streams(window > 1, window) else "spec" if window > 1 else "plain"
        table[step].append([seqs, block_v, warps, split, prefetch])
    missing = [step for step in ("plain", "spec") if not table[step]]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} batch measured: the launch table needs both")
    if not table["stream"]:
        del table["stream"]
    return table


if __name__ == "__main__":
    sys.exit(main())
