"""The DSpark drafter's KV-cache block: as many tokens as fit the hybrid target's page.

vLLM shares one block pool among all KV-cache groups, so every layer's page must have the same
size. For Ling's hybrid target vLLM first inflates the global block size until one MLA page covers
one KDA state page (``Platform._align_hybrid_block_size``: 2176 tokens at full size, TP 1, 8 draft
tokens). The drafter's dense MHA layers read that same global block size, and an MHA page of
2176 tokens is 14 times the others and no multiple of them: vLLM's ``unify_kv_cache_spec_page_size``
cannot unify the MLA layers with it (docs/dspark.md, section 3; vllm#54174 gives the draft a fixed
128-token block instead).

Here the draft's block is computed: the largest multiple of its attention backend's kernel block
whose page fits the unified page, so at most one kernel block of the draft's own page is padding
and no other layer changes. Pure arithmetic plus the KV-cache spec of one ``Attention`` layer.
"""

from __future__ import annotations

import dataclasses

# Set on each draft ``Attention`` layer whose spec this module sizes (read by the verification).
BLOCK_ATTR = "ling_draft_block_tokens"


def draft_block_tokens(unified_page_bytes: int, draft_bytes_per_token: int, kernel_block: int) -> int | None:
    """The largest multiple of ``kernel_block`` tokens whose draft page fits ``unified_page_bytes``;
    None when not even one kernel block fits."""
    tokens = unified_page_bytes // draft_bytes_per_token // kernel_block * kernel_block
    return tokens or None


def unified_page_bytes(vllm_config, target_cls) -> int | None:
    """The page every layer of the hybrid target shares (the KDA state page, padded to the MLA
    page when vLLM padded it); None when the target is not hybrid (the global block size is then
    the draft's right block too)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if not vllm_config.model_config.is_hybrid:
        return None
    padded = vllm_config.cache_config.mamba_page_size_padded
    if padded:
        return int(padded)
    return MambaSpec(shapes=target_cls.get_mamba_state_shape_from_config(vllm_config),
                     dtypes=target_cls.get_mamba_state_dtype_from_config(vllm_config),
                     block_size=-1).page_size_bytes


def kernel_block(attn) -> int:
    """The smallest block the draft attention backend's kernels take (manager blocks are multiples)."""
    from vllm.v1.attention.backend import MultipleOf

    sizes = attn.attn_backend.get_supported_kernel_block_sizes()
    return min(s.base if isinstance(s, MultipleOf) else int(s) for s in sizes)


def size_draft_blocks(attn, target_cls) -> None:
    """Make the draft ``Attention`` layer ``attn`` report a KV-cache spec of the computed block size
    (vLLM asks each layer for its spec when it plans the cache; this instance's method answers)."""
    generic = type(attn).get_kv_cache_spec

    def get_kv_cache_spec(vllm_config):
        spec = generic(attn, vllm_config)
        page = unified_page_bytes(vllm_config, target_cls)
        if spec is None or page is None:
            return spec
        per_token = dataclasses.replace(spec, block_size=1).page_size_bytes
        tokens = draft_block_tokens(page, per_token, kernel_block(attn))
        if tokens is None:
            return spec
        setattr(attn, BLOCK_ATTR, tokens)
        return dataclasses.replace(spec, block_size=tokens)

    attn.get_kv_cache_spec = get_kv_cache_spec
