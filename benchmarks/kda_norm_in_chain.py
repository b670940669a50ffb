"""The KDA layer's gated output norm between its real neighbours: the one-launch KDA decode, the norm, then the
out-projection it feeds (vllm-ling's FP8 decode kernel), over distinct layers in one CUDA graph, with the norm
as Inductor compiles vLLM's ``FusedRMSNormGated.forward_native`` (vLLM's default under torch.compile), inside
the launch (``OutputNorm``: the out-projection, a programmatic dependent, streams its weights during the step),
and without a norm (the chain's floor), at batch 1 for one token and for a 4-token verify window.

Why: in lease 2026-12-07g's 32K step the norm was an Inductor kernel of its own after each of the 35 KDA
launches (1.9 us), which the out-projection waited for in full (``benchmarks/results/gpu_serving_h200.md``).

    python -m benchmarks.kda_norm_in_chain --out benchmarks/results/kda_norm_in_chain_h100.md   # on the GPU

No vLLM import.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from benchmarks.kda_decode import HEAD_DIM, HEADS, WIDTH, step_bytes
from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us

H, EPS = 2560, 1e-6  # Ling-3.0-flash's hidden size and norm epsilon (the KDA layer's shape: benchmarks.kda_decode)
P = HEADS * HEAD_DIM


def _layer_calls(window: int, gen: torch.Generator):
    """One layer's step (plain decode of one sequence, or one verify window of ``window`` tokens) without and
    with the norm, on pools of their own (the launch writes its states in place)."""
    from vllm_ling.ops.kda_decode import KdaDecodeCall, OutputNorm

    dev = torch.device("cuda")
    row = (torch.randn(window, 5 * P, device=dev, generator=gen) * 0.5).bfloat16()
    weight = torch.randn(3 * P, WIDTH, device=dev, generator=gen) * 0.3
    A_log = torch.linspace(-2.0, 1.5, HEADS, device=dev)
    dt_bias = torch.randn(P, device=dev, generator=gen) * 0.5
    norm_w = (1 + 0.2 * torch.randn(HEAD_DIM, device=dev, generator=gen)).bfloat16()
    beta = torch.randn(window, HEADS, device=dev, generator=gen).bfloat16()
    spec = window > 1
    slots = (torch.arange(1, window + 1, device=dev, dtype=torch.int32)[None] if spec
             else torch.ones(1, device=dev, dtype=torch.int32))
    extra = ({"cu_seqlens": torch.tensor([0, window], device=dev, dtype=torch.int32),
              "accepted": torch.ones(1, device=dev, dtype=torch.int32)} if spec else {})
    state = torch.randn(window + 2, HEADS, HEAD_DIM, HEAD_DIM, device=dev, generator=gen) * 0.1
    conv = torch.randn(window + 2, 3 * P, WIDTH - 2 + window, device=dev, generator=gen).bfloat16()

    def call(norm: bool) -> KdaDecodeCall:
        return KdaDecodeCall(row[:, :3 * P], row[:, 3 * P:4 * P], beta, weight, conv.clone(), A_log, dt_bias,
                             state.clone(), slots, HEAD_DIM ** -0.5, -5.0,
                             output_norm=OutputNorm(row[:, 4 * P:], norm_w, EPS) if norm else None, **extra)

    return call(False), call(True), row[:, 4 * P:], norm_w


def layer_bytes(window: int) -> int:
    """A layer's bytes: the KDA step's (benchmarks.kda_decode: states, conv states, its rows), the gate rows the
    norm reads, the out-projection's FP8 weight and fp32 block scales and its output rows."""
    return step_bytes(1, window, norm=True) + H * P + (H // 128) * (P // 128) * 4 + window * H * 2


def chain_rows(windows: list[int], layers: int, iters: int) -> list[dict]:
    from vllm_ling.ops.dense_fp8.linear import w8a16_linear
    from vllm_ling.ops.kda import gated_rms_norm
    from vllm_ling.ops.kda_decode import kda_decode

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    o_w = [(torch.randn(H, P, device=dev, generator=gen) * 0.05).to(torch.float8_e4m3fn) for _ in range(layers)]
    o_s = [torch.rand(H // 128, P // 128, device=dev, generator=gen) + 0.5 for _ in range(layers)]
    # vLLM's FusedRMSNormGated.forward_native (sigmoid gate): the project's plain-PyTorch gated norm, compiled
    inductor_norm = torch.compile(functools.partial(gated_rms_norm, activation="sigmoid"), dynamic=False,
                                  fullgraph=True)
    rows = []
    for window in windows:
        steps = [_layer_calls(window, gen) for _ in range(layers)]
        core = [torch.empty(window, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        normed = [torch.empty_like(c) for c in core]
        out = [torch.empty(window, H, device=dev, dtype=torch.bfloat16) for _ in range(layers)]

        def layer(mode: str, i: int):
            plain, with_norm, gate, norm_w = steps[i]
            kda_decode(with_norm if mode == "inside" else plain, core[i])
            src = core[i]
            if mode == "inductor":
                normed[i] = inductor_norm(core[i], gate.unflatten(-1, (HEADS, HEAD_DIM)), norm_w, EPS)
                src = normed[i]
            w8a16_linear(src.view(window, P), o_w[i], o_s[i], out=out[i])

        def per_layer(mode: str) -> float:
            return stacked_time_us([functools.partial(layer, mode, i) for i in range(layers)], iters)

        # the launch's norm against vLLM's on this run's inputs first (fresh pools: one step each)
        plain, with_norm, gate, norm_w = _layer_calls(window, gen)
        got = kda_decode(with_norm, torch.empty(window, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16))
        want = gated_rms_norm(kda_decode(plain, torch.empty_like(got)), gate.unflatten(-1, (HEADS, HEAD_DIM)), norm_w,
                              EPS, activation="sigmoid")
        torch.cuda.synchronize()
        err = ((got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)).max().item()
        row = {"window": window, "inductor_us": per_layer("inductor"), "inside_us": per_layer("inside"),
               "none_us": per_layer("none"), "norm_err": err}
        row["bytes"] = layer_bytes(window)
        rows.append(row)
        print(f"window {window}: per layer {row['inductor_us']:.2f} us (Inductor's norm), {row['inside_us']:.2f} "
              f"(inside the launch), {row['none_us']:.2f} (no norm)", file=sys.stderr)
    return rows


def table(rows: list[dict], device: str, bw: float, how: str, layers: int, iters: int) -> str:
    lines = [f"# The KDA output norm between its real neighbours ({device})", "",
             f"Per layer (us): {layers} distinct layers in one CUDA graph, medians of {iters} replays. A layer is "
             f"the one-launch KDA decode ({HEADS} heads of {HEAD_DIM}, the launch table's configuration) -> the "
             f"gated output norm -> the out-projection ([{H}, {P}] FP8, vllm-ling's decode kernel), batch 1. Norm: "
             "Inductor's compilation of vLLM's `FusedRMSNormGated.forward_native` (vLLM's default under "
             "torch.compile), inside the launch (`OutputNorm`), none (the chain's floor). Copy bandwidth in this "
             f"run: {bw:,.0f} GB/s ({how}); fraction = the layer's bytes (the projection's weights and scales, the "
             "state read and written per token, the rows) at that bandwidth over its time. Error: the launch's "
             "normed rows against vLLM's norm of its rows, max relative per row (tolerance 2**-7).", "",
             "| tokens | Inductor's norm | inside the launch | no norm | inside / Inductor | the norm's cost in the "
             "chain (Inductor, inside) | fraction of copy bw (inside) | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor_us = r["bytes"] / (bw * 1e3)
        lines.append(f"| {r['window']} | {r['inductor_us']:.2f} | {r['inside_us']:.2f} | {r['none_us']:.2f} | "
                     f"{r['inside_us'] / r['inductor_us']:.2f} | {r['inductor_us'] - r['none_us']:.2f}, "
                     f"{r['inside_us'] - r['none_us']:.2f} | {floor_us / r['inside_us']:.2f} | {r['norm_err']:.2g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4])
    parser.add_argument("--layers", type=int, default=8, help="distinct layers (10.5 MB of weights, 2 MB of state each)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kda_norm_in_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw, how = copy_bandwidth_gbs()
    rows = chain_rows(args.windows, args.layers, args.iters)
    write_outputs(table(rows, torch.cuda.get_device_name(), bw, how, args.layers, args.iters), args.out)
    return 0 if all(r["norm_err"] < 2 ** -7 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
