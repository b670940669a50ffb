"""Every feature's :class:`~vllm_ling.selection.Reader`, in report order: how the startup
verification reads back what each module serves. Each reader lives beside the layer code that
builds what it reads; a new feature adds its reader here (and its selector beside its kernel)."""

from __future__ import annotations

from vllm_ling.selection import Reader


def readers() -> tuple[Reader, ...]:
    """Imported on use: the layer modules import vLLM's layers, which must wait for the platform."""
    from vllm_ling.layers import dense_fp8_path, dspark_drafter, fp8_lm_head, kda_decode, kda_direct_output, kda_fused_conv
    from vllm_ling.layers import kda_merged_in_proj, kda_output_norm
    from vllm_ling.layers import moe_method, router_gate_cuda, router_topk, shared_swiglu, small_bf16_cuda

    return (moe_method.READER, fp8_lm_head.FP8_HEAD_READER, fp8_lm_head.KERNEL_READER, dense_fp8_path.READER,
            small_bf16_cuda.READER, kda_merged_in_proj.READER, kda_fused_conv.READER, kda_decode.READER,
            kda_output_norm.READER, kda_direct_output.READER, shared_swiglu.READER,
            router_gate_cuda.READER, router_topk.READER, dspark_drafter.READER)
