"""Registers vllm-ling's layers and quantization config with vLLM (called by the plugin)."""

from __future__ import annotations


def register_layers() -> list[str]:
    from vllm_ling.layers.quant_config import register_ling_quant_config

    done: list[str] = register_ling_quant_config()
    from vllm_ling.layers.kda_cpu import register_cpu_kda
    from vllm_ling.layers.kda_merged_in_proj import register_merged_kda

    # one KDA replacement per platform: CPU's (plain PyTorch, merged in-projection) or vLLM's
    # kernels with the merged in-projection
    done += register_cpu_kda() or register_merged_kda()
    from vllm_ling.layers.router_gate_cuda import register_router_gate

    done += register_router_gate()
    from vllm_ling.layers.router_topk import register_router_topk

    done += register_router_topk()
    from vllm_ling.layers.residual_norm import register_residual_norm

    done += register_residual_norm()
    return done
