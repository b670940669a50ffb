"""Ling's MoE router gate at prefill sizes: vLLM 0.32's path against a tensor-core GEMM on the fp32 weight
split into BF16 parts, before any of it serves.

The gate is 512 experts x 2560, fp32 weights and fp32 logits. Above the router GEMV's 16 tokens vLLM's
``GateLinear`` has no tensor-core tier for fp32 weights on sm_90 or on the Spark's sm_121 (its BF16x3 GEMM
is SM100's, CuteDSL): it casts the tokens to fp32 and runs cuBLAS's fp32 SIMT GEMM, about 128 us per MoE
layer of a 1,920-token prefill step on the H100 (``benchmarks/results/prefill_profile_h100.md``, fifth
reading). The candidate: the weight as BF16 parts (``hi = w.bf16()``, then the remainders), the tokens are
BF16 already, so every product of a part is exact in fp32 and ``torch.mm(x, parts.T, out_dtype=float32)``
(the call GateLinear makes for BF16 weights) followed by the sum of the parts' column blocks gives
fp32-grade logits from tensor cores. Three parts hold an fp32 weight's 24 significand bits; two hold 16.

For each token count: CUDA-graph median time per layer over 40 distinct gates (210 MB of fp32 weights,
more than the L2), the bytes each path reads, the fraction of the copy bandwidth measured in the same run,
the speed-up over vLLM's path, the largest logit error against the float64 product (relative to the
largest logit), and the tokens whose picked experts differ from those of the float64 logits (in brackets
those at a near tie, where either pick is right).

vLLM 0.32 already carries this split and GEMM for fp32 gates, gated to ROCm gfx950 (its
``bf16x3_router_gemm_rocm``: ``split_bf16x3``, three parts, and ``bf16x3_router_gemm``, one ``torch.mm`` with
fp32 output plus a Triton kernel summing the parts' column blocks; its own measurement put the crossover
against fp32 at about 1,536-2,048 tokens there). Where vLLM is installed its function is timed too, on this
GPU: the serving tier would be that function enabled on CUDA above the measured crossover.

    python -m benchmarks.router_gate_prefill --out benchmarks/results/router_gate_prefill_h100.md   # GPU
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.router_topk import CONFIG, LAYERS, NEAR_TIE, ling_routing, tokens_off

PARTS = (2, 3)


def split_bf16(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """The fp32 ``weight`` [N, K] as ``parts`` BF16 matrices stacked [parts * N, K]: each the BF16
    rounding of what the ones before it left over, so their fp32 sum is the weight to
    ``8 * parts`` significand bits."""
    out, rest = [], weight.float()
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return torch.cat(out)


def split_logits(x: torch.Tensor, split: torch.Tensor, parts: int) -> torch.Tensor:
    """fp32 logits [T, N] of BF16 tokens ``x`` [T, K] through ``split`` (:func:`split_bf16`): one GEMM
    with fp32 output, then the parts' column blocks summed. On CPU (tests) the same products in fp32."""
    if x.is_cuda:
        y = torch.mm(x, split.t(), out_dtype=torch.float32)
    else:
        y = x.float() @ split.float().t()
    return y.view(x.shape[0], parts, -1).sum(dim=1)


def vllm_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What GateLinear runs for this gate above 16 tokens on sm_90 / sm_121: the cast, then F.linear."""
    return F.linear(x.to(weight.dtype), weight)


def vllm_bf16x3():
    """vLLM's own BF16x3 router GEMM module (its ROCm tier's split and GEMM), or None without vLLM."""
    try:
        from vllm.model_executor.layers.fused_moe.router import bf16x3_router_gemm_rocm
    except ImportError:
        return None
    return bf16x3_router_gemm_rocm


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest logit error relative to the largest logit magnitude."""
    return float((got.double() - ref).abs().max() / ref.abs().max())


def main(argv: list[str] | None = None) -> int:
    from benchmarks.lm_head import copy_bandwidth_gbs
    from benchmarks.output import write_outputs
    from benchmarks.timing import stacked_time_us
    from vllm_ling.ops.moe.routing import grouped_topk

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[16, 64, 256, 1920, 2048])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    routing = ling_routing()
    e, k = routing.num_experts, CONFIG["hidden_size"]
    bw, how = copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(e, k, device="cuda", generator=gen) * 0.02 for _ in range(LAYERS)]
    biases = [torch.randn(e, device="cuda", generator=gen) * 0.1 for _ in range(LAYERS)]
    splits = {p: [split_bf16(w, p) for w in weights] for p in PARTS}
    vllm_gemm = vllm_bf16x3()
    vllm_splits = [vllm_gemm.split_bf16x3(w) for w in weights] if vllm_gemm else None
    rows = []
    for t in args.tokens:
        xs = [torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
        refs = [x.double() @ w.double().t() for x, w in zip(xs, weights)]
        want = [grouped_topk(r, routing.top_k, routing.n_group, routing.topk_group, b.double(), True,
                             routing.scale)[1] for r, b in zip(refs, biases)]

        def measure(logits_of, nbytes: int):
            us = stacked_time_us([lambda x=x, i=i: logits_of(x, i) for i, x in enumerate(xs)], args.iters)
            got = [logits_of(x, i) for i, x in enumerate(xs)]
            err = max(max_rel_error(g, r) for g, r in zip(got, refs))
            ids = [grouped_topk(g, routing.top_k, routing.n_group, routing.topk_group, b, True, routing.scale)[1]
                   for g, b in zip(got, biases)]
            return us, nbytes, err, tokens_off(ids, want, [r.float() for r in refs], biases, routing)

        act = t * k * 2 + t * e * 4
        runs = {"vLLM (cast + fp32 F.linear)": measure(lambda x, i: vllm_logits(x, weights[i]), e * k * 4 + act)}
        for p in PARTS:
            runs[f"BF16x{p} GEMM"] = measure(lambda x, i, p=p: split_logits(x, splits[p][i], p),
                                             p * e * k * 2 + act + t * p * e * 4)
        if vllm_gemm:
            runs["vLLM's bf16x3_router_gemm"] = measure(lambda x, i: vllm_gemm.bf16x3_router_gemm(x, vllm_splits[i]),
                                                       3 * e * k * 2 + act + t * 3 * e * 4)
        rows.append((t, runs))
        print(f"T={t}: " + ", ".join(f"{n} {r[0]:.1f} us" for n, r in runs.items()), file=sys.stderr)
    base = next(iter(rows[0][1]))
    lines = [f"# Ling's MoE router gate at prefill sizes ({torch.cuda.get_device_name()})", "",
             f"{e} experts x {k}, fp32 weights and logits, BF16 tokens. CUDA-graph medians ({args.iters} replays) over "
             f"{LAYERS} distinct gates, us per layer. Copy bandwidth in this run: {bw:,.0f} GB/s ({how}). Error: the "
             "largest logit error against the float64 product, relative to the largest logit. Off: tokens whose "
             f"picked experts differ from the float64 logits' (of {LAYERS} x tokens; in brackets at a near tie, "
             f"decision margin < {NEAR_TIE:g}).", "",
             "| tokens | path | us | bytes | fraction of copy BW | vLLM / this | error | off |", "|---|---|---|---|---|---|---|---|"]
    for t, runs in rows:
        for name, (us, nbytes, err, (off, near)) in runs.items():
            lines.append(f"| {t} | {name} | {us:.1f} | {nbytes:,} | {nbytes / (us * 1e-6) / (bw * 1e9):.3f} | "
                         f"{runs[base][0] / us:.2f}x | {err:.1e} | {off} ({near}) |")
    write_outputs("\n".join(lines) + "\n", args.out)
    # a pick that differs away from a near tie is wrong logits, for vLLM's path as for the candidates
    return 0 if all(off == near for _, runs in rows for *_, (off, near) in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
