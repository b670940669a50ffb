"""FlashAttention 3's MLA decode at Ling's shape against its split-KV bound (the bound vLLM passes in
CUDA graphs, ``flash_attn_max_num_splits_for_cuda_graph``, and ``VLLM_LING_DECODE_SPLITS`` raises).

Ling's MLA layer at batch 1: 32 query heads over one latent KV head (512 latent + 64 rope values per
token, BF16, in vLLM's paged layout: one [blocks, block, 576] tensor, the latent and rope parts read as
views), the decode token alone or the 4-token verify window of MTP. Each row times the call vLLM's
``FlashAttnMLAImpl`` makes (scheduler metadata from ``get_scheduler_metadata`` with the same bound, as
its metadata builder computes it) over distinct caches in one CUDA graph (a step's MLA layers, more
at short contexts, so the bytes exceed the L2), and checks the output against plain PyTorch attention in fp32.
Splits 0 is FlashAttention's own choice (what an eager step gets).

    python -m benchmarks.mla_decode_splits --out benchmarks/results/mla_decode_splits_h100.md   # on the GPU
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us

HEADS = 32          # Ling-3.0-flash's attention heads (one tensor-parallel rank)
LATENT = 512        # kv_lora_rank
ROPE = 64           # qk_rope_head_dim
NOPE = 128          # qk_nope_head_dim: the softmax scale is over the full query head (nope + rope)
BLOCK = 1920        # vLLM's attention block for the hybrid model at full size (page >= the KDA state's)
LAYERS = 7          # Ling's MLA layers: at least this many distinct caches per graph
ROTATE_BYTES = 128 << 20  # and at least this many bytes of them (more than twice an H100's or H200's L2)
TOLERANCE = 1e-2    # max |out - reference| / max |reference|: BF16 output of fp32 sums
BASELINE_SPLITS = 32  # vLLM 0.32's bound in CUDA graphs


def cache_bytes(context: int) -> int:
    """The latent cache one layer's decode reads (BF16 latent + rope per token)."""
    return context * (LATENT + ROPE) * 2


def distinct_caches(context: int) -> int:
    """How many layer caches one timed graph reads: a step's MLA layers, more where they would fit the L2."""
    return max(LAYERS, -(-ROTATE_BYTES // cache_bytes(context)))


def reference(q_nope, q_pe, cache_flat, context: int, scale: float) -> torch.Tensor:
    """fp32 attention of the query tokens (the last ``T`` positions, causal) over the first ``context``
    tokens of the layer's cache: [T, HEADS, LATENT]."""
    t = q_nope.shape[0]
    kv = cache_flat[:context].float()
    scores = (q_nope.float() @ kv[:, :LATENT].T + q_pe.float() @ kv[:, LATENT:].T) * scale  # [T, H, C]
    position = torch.arange(context, device=kv.device)
    last = context - t + torch.arange(t, device=kv.device)
    scores = scores.masked_fill(position[None, None, :] > last[:, None, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ kv[:, :LATENT]


def rows(contexts: list[int], query_tokens: list[int], splits: list[int], iters: int) -> list[dict]:
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    scale = (NOPE + ROPE) ** -0.5
    out = []
    for context in contexts:
        blocks = -(-context // BLOCK)
        layers = distinct_caches(context)
        caches = [torch.randn(blocks, BLOCK, LATENT + ROPE, device="cuda").bfloat16() for _ in range(layers)]
        block_table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
        seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
        for t in query_tokens:
            cu_q = torch.tensor([0, t], dtype=torch.int32, device="cuda")
            queries = [(torch.randn(t, HEADS, LATENT, device="cuda").bfloat16(),
                        torch.randn(t, HEADS, ROPE, device="cuda").bfloat16()) for _ in range(layers)]
            want = [reference(qn, qp, c.view(-1, LATENT + ROPE), context, scale)
                    for (qn, qp), c in zip(queries, caches)]
            for s in splits:
                meta = get_scheduler_metadata(batch_size=1, max_seqlen_q=t, max_seqlen_k=context, num_heads_q=HEADS,
                                              num_heads_kv=1, headdim=ROPE, cache_seqlens=seq_lens,
                                              qkv_dtype=torch.bfloat16, headdim_v=LATENT, page_size=BLOCK,
                                              cu_seqlens_q=cu_q, causal=True, num_splits=s)
                results = [torch.empty(t, HEADS, LATENT, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]

                def call(qn, qp, cache, o, meta=meta, s=s, t=t, cu_q=cu_q, context=context):
                    flash_attn_varlen_func(q=qp, k=cache[..., LATENT:].unsqueeze(-2), v=cache[..., :LATENT].unsqueeze(-2),
                                           q_v=qn, max_seqlen_q=t, cu_seqlens_q=cu_q, max_seqlen_k=context,
                                           seqused_k=seq_lens, block_table=block_table, softmax_scale=scale,
                                           causal=True, fa_version=3, scheduler_metadata=meta, num_splits=s, out=o)

                fns = [lambda qn=qn, qp=qp, c=c, o=o: call(qn, qp, c, o)
                       for (qn, qp), c, o in zip(queries, caches, results)]
                us = stacked_time_us(fns, iters)
                error = max(float((o.float() - w).abs().max() / w.abs().max()) for o, w in zip(results, want))
                out.append({"context": context, "tokens": t, "splits": s, "us": us, "error": error})
                print(f"C={context} T={t} splits={s}: {us:.2f} us, max rel. error {error:.2e}", file=sys.stderr)
            del want
        del caches
        torch.cuda.empty_cache()
    return out


def table(results: list[dict], bw: float, how: str, iters: int, device: str) -> str:
    base = {(r["context"], r["tokens"]): r["us"] for r in results if r["splits"] == BASELINE_SPLITS}
    lines = [f"# FlashAttention 3's MLA decode against its split bound ({device})", "",
             f"Ling's MLA layer at batch 1 ({HEADS} heads, one latent KV head of {LATENT} + {ROPE} BF16 values, "
             f"{BLOCK}-token pages). CUDA-graph medians ({iters} replays) over distinct caches (at least {LAYERS}, at least "
             f"{ROTATE_BYTES >> 20} MB), us per layer. "
             f"Splits {BASELINE_SPLITS}: vLLM's bound in CUDA graphs; 0: FlashAttention's own choice. Copy bandwidth "
             f"in this run: {bw:,.0f} GB/s ({how}). Error: max |out - fp32 reference| / max |reference| "
             f"(tolerance {TOLERANCE:g}).", "",
             "| context | query tokens | splits | us per layer | cache bytes | fraction of copy BW | "
             f"splits {BASELINE_SPLITS} / this | error |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        nbytes = cache_bytes(r["context"])
        baseline = base.get((r["context"], r["tokens"]))
        ratio = "-" if baseline is None else f"{baseline / r['us']:.2f}x"
        lines.append(f"| {r['context']} | {r['tokens']} | {r['splits']} | {r['us']:.2f} | {nbytes:,} | "
                     f"{nbytes / (r['us'] * 1e-6) / (bw * 1e9):.3f} | {ratio} | {r['error']:.1e} |")
    return "\n".join(lines) + "\n"


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=parse_ints, default=[4096, 32768, 131072])
    parser.add_argument("--tokens", type=parse_ints, default=[1, 4], help="query tokens per step (4: MTP's verify)")
    parser.add_argument("--splits", type=parse_ints, default=[BASELINE_SPLITS, 64, 128, 0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_decode_splits: needs a CUDA GPU with vLLM's FlashAttention 3 (sm_90)", file=sys.stderr)
        return 2
    bw, how = copy_bandwidth_gbs()
    results = rows(args.contexts, args.tokens, args.splits, args.iters)
    device = f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs"
    write_outputs(table(results, bw, how, args.iters, device), args.out)
    return 0 if all(r["error"] <= TOLERANCE for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
