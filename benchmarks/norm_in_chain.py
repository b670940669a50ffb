"""The decode step's residual norms between their real neighbours: residual add + RMSNorm, then the linear
it feeds (the KDA layer's merged in-projection on vllm-ling's FP8 decode kernel, the MoE router's gate GEMV),
over distinct layers in one CUDA graph, with the norm as Inductor compiles it (vLLM's default under
torch.compile), as vllm-ling's kernel (programmatic dependent launch: the linear streams its weights while the
norm runs), and without a norm (the linears alone: the floor of the chain).

Why: in the real step each norm is an Inductor reduction of 2-4.7 us that the next kernel waits for in full
(``benchmarks/results/gpu_serving_h200.md``): about 80 a step. This chain tells what a norm costs in place.
As in the served graph, the input norm's x is the MoE's shared + routed outputs, which vLLM's runner adds in
Python after its op: Inductor fuses that add into its norm; before vllm-ling's (an opaque op) it stays a
pointwise kernel of its own (``--no-moe-sum``: x one tensor, lease 2026-12-07h's chain).

    python -m benchmarks.norm_in_chain --out benchmarks/results/norm_in_chain_h100.md   # on the GPU

No vLLM import.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us

H, IN_PROJ_N, EXPERTS, EPS = 2560, 20480, 512, 1e-6  # Ling-3.0-flash: hidden, KDA q/k/v/f/g rows, experts


def chain_rows(token_counts: list[int], layers: int, iters: int, moe_sum: bool = True) -> list[dict]:
    from vllm_ling.ops.dense_fp8.linear import w8a16_linear
    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add_rms_norm
    from vllm_ling.ops.small_gemv.router import router_logits

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    in_proj = [(torch.randn(IN_PROJ_N, H, device=dev, generator=gen) * 0.05).to(torch.float8_e4m3fn)
               for _ in range(layers)]
    scales = [torch.rand(IN_PROJ_N // 128, H // 128, device=dev, generator=gen) + 0.5 for _ in range(layers)]
    gates = [torch.randn(EXPERTS, H, device=dev, generator=gen) * H ** -0.5 for _ in range(layers)]
    norm_w = [(1 + 0.1 * torch.randn(H, device=dev, generator=gen)).bfloat16() for _ in range(2 * layers)]
    inductor_norm = torch.compile(add_rms_norm, dynamic=False, fullgraph=True)
    inductor_sum_norm = torch.compile(lambda a, b, r, w, eps: add_rms_norm(a + b, r, w, eps), dynamic=False,
                                      fullgraph=True)
    moe_add = torch.compile(lambda a, b: a + b, dynamic=False, fullgraph=True)  # the sum before an opaque norm
    rows = []
    for t in token_counts:
        xs = [torch.randn(t, H, device=dev, generator=gen).bfloat16() for _ in range(2 * layers)]
        residuals = [torch.randn(t, H, device=dev, generator=gen).bfloat16() for _ in range(2 * layers)]
        proj_out = [torch.empty(t, IN_PROJ_N, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        logits = [torch.empty(t, EXPERTS, device=dev) for _ in range(layers)]
        normed = [xs[i] for i in range(2 * layers)]  # what the linears read (the norm's output where there is one)
        # the MoE's shared output beside each input norm's x (its routed output)
        shared = [torch.randn(t, H, device=dev, generator=gen).bfloat16() for _ in range(layers)] if moe_sum else None

        def norm(impl, j):
            if shared is None or j % 2:
                normed[j] = impl(xs[j], residuals[j], norm_w[j], EPS)[0]
            elif impl is inductor_norm:  # Inductor fuses the sum into its reduction
                normed[j] = inductor_sum_norm(xs[j], shared[j // 2], residuals[j], norm_w[j], EPS)[0]
            else:
                normed[j] = impl(moe_add(xs[j], shared[j // 2]), residuals[j], norm_w[j], EPS)[0]

        def layer(impl, i):
            if impl is not None:
                norm(impl, 2 * i)
            w8a16_linear(normed[2 * i], in_proj[i], scales[i], out=proj_out[i])
            if impl is not None:
                norm(impl, 2 * i + 1)
            router_logits(normed[2 * i + 1], gates[i], out=logits[i])

        def per_layer(impl):
            return stacked_time_us([functools.partial(layer, impl, i) for i in range(layers)], iters)

        # the kernel against the reference on this run's rows first: a wrong kernel's time is no result
        got = add_rms_norm_cuda(xs[0], residuals[0], norm_w[0], EPS)
        want = add_rms_norm(xs[0], residuals[0], norm_w[0], EPS)
        torch.cuda.synchronize()
        exact_residual = torch.equal(got[1], want[1])
        norm_err = (got[0].float() - want[0].float()).abs().max().item()
        row = {"tokens": t, "inductor_us": per_layer(inductor_norm), "ling_us": per_layer(add_rms_norm_cuda),
               "none_us": per_layer(None), "exact_residual": exact_residual, "norm_err": norm_err,
               "inductor_alone_us": stacked_time_us([functools.partial(norm, inductor_norm, j)
                                                     for j in range(2 * layers)], iters),
               "ling_alone_us": stacked_time_us([functools.partial(norm, add_rms_norm_cuda, j)
                                                 for j in range(2 * layers)], iters)}
        row["bytes"] = (IN_PROJ_N * H + IN_PROJ_N * H // 128 // 128 * 4 + EXPERTS * H * 4 + 2 * 3 * t * H * 2
                        + 2 * H * 2 + (t * H * 2 if moe_sum else 0))  # + the shared output read
        rows.append(row)
        print(f"T={t}: per layer {row['inductor_us']:.2f} us (Inductor norms), {row['ling_us']:.2f} (vllm-ling's), "
              f"{row['none_us']:.2f} (no norm)", file=sys.stderr)
    return rows


def table(rows: list[dict], device: str, bw: float, how: str, layers: int, iters: int, moe_sum: bool = True) -> str:
    lines = [f"# The residual norms between their real neighbours ({device})", "",
             f"Per layer (us): {layers} distinct layers in one CUDA graph, medians of {iters} replays. A layer is "
             f"residual add + RMSNorm -> the KDA merged in-projection ([{IN_PROJ_N}, {H}] FP8, vllm-ling's decode "
             f"kernel) -> residual add + RMSNorm -> the router gate GEMV ([{EXPERTS}, {H}] fp32), Ling-3.0-flash's "
             "two norms per layer and the first kernel each feeds"
             + ("; the input norm's x is the MoE's shared + routed outputs, their sum fused into Inductor's norm "
                "and a pointwise kernel of its own before vllm-ling's" if moe_sum else "; x one tensor (--no-moe-sum)")
             + ". Norms: Inductor's compiled reduction (vLLM's "
             "default under torch.compile), vllm-ling's kernel (programmatic dependent launch), none (the linears "
             f"read their inputs directly: the chain's floor). Copy bandwidth in this run: {bw:,.0f} GB/s ({how}); "
             "fraction = the layer's bytes (weights, scales, activations) at that bandwidth over its time.", "",
             "| tokens | Inductor norms | vllm-ling norms | no norm | vllm-ling / Inductor | norms' cost in the chain "
             "(Inductor, vllm-ling) | fraction of copy bw (vllm-ling) | two norms alone (Inductor, vllm-ling) | "
             "residual exact, max norm error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor_us = r["bytes"] / (bw * 1e3)
        lines.append(f"| {r['tokens']} | {r['inductor_us']:.2f} | {r['ling_us']:.2f} | {r['none_us']:.2f} | "
                     f"{r['ling_us'] / r['inductor_us']:.2f} | {r['inductor_us'] - r['none_us']:.2f}, "
                     f"{r['ling_us'] - r['none_us']:.2f} | {floor_us / r['ling_us']:.2f} | "
                     f"{2 * r['inductor_alone_us']:.2f}, {2 * r['ling_alone_us']:.2f} | "
                     f"{r['exact_residual']}, {r['norm_err']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4])
    parser.add_argument("--layers", type=int, default=8, help="distinct layers (57 MB of weights each)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--no-moe-sum", dest="moe_sum", action="store_false",
                        help="the input norm's x one tensor, not the MoE's shared + routed sum")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("norm_in_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw, how = copy_bandwidth_gbs()
    rows = chain_rows(args.tokens, args.layers, args.iters, args.moe_sum)
    write_outputs(table(rows, torch.cuda.get_device_name(), bw, how, args.layers, args.iters, args.moe_sum),
                  args.out)
    return 0 if all(r["exact_residual"] and r["norm_err"] < 0.1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
