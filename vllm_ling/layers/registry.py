"""Registers vllm-ling's layers and quantization config with vLLM (called by the plugin)."""

from __future__ import annotations


def register_layers() -> list[str]:
    from vllm_ling.layers.quant_config import register_ling_quant_config

    done: list[str] = register_ling_quant_config()
    try:
        from vllm_ling.layers.kda_cpu import register_cpu_kda
    except ImportError:  # TODO(lead): remove once layers/kda_cpu.py lands
        register_cpu_kda = None
    if register_cpu_kda is not None:
        done += register_cpu_kda()
    return done
