"""Patch P3: let vLLM-CPU's reference MLA backend run inside hybrid (KDA + MLA) models.

What: ``CPUMLABackend.supports_block_size`` accepts any multiple of its 16-token kernel
block, the rule vLLM's base ``AttentionBackend.supports_block_size`` applies to every
backend with "hybrid blocks" (the manager block is split into kernel blocks).
Why: in a hybrid model vLLM raises the attention page to match the KDA state page
(256 tokens for the tiny model); CPU_MLA's override accepts only exactly 16, so the
hybrid Ling model cannot start on CPUs without AMX. Greedy decoding across 16-token
block boundaries was checked equal to prefill-only recomputation.
Upstream: vLLM 0.32 ``v1/attention/backends/mla/cpu_mla.py`` (override added with the
CPU MLA backend); AMX_MLA has no such limit.
Delete when: CPU_MLA drops its ``supports_block_size`` override.
Applied: only on the CPU platform, from the plugin's ``register()`` in every process.
"""

from __future__ import annotations

_applied = False
KERNEL_BLOCK = 16


def apply() -> bool:
    global _applied
    if _applied:
        return True
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % KERNEL_BLOCK == 0

    CPUMLABackend.supports_block_size = classmethod(supports_block_size)
    _applied = True
    return True
