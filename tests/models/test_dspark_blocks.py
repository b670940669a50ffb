"""The drafter's KV block: sized so vLLM's own page unification leaves every target layer as it is.

At full size (TP 1, 8 draft tokens) vLLM's hybrid alignment gives Ling a 2176-token block so one
MLA page (576 BF16 per token) covers one KDA state page. A dense drafter layer reading that block
has a page 14.2 times larger and no multiple of the MLA page: vLLM cannot unify them. The sized
draft block fits the shared page instead.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")


@pytest.mark.parametrize("page,per_token,kernel,want", [
    (2_506_752, 16_384, 16, 144),   # full size, TP 1, 8 draft tokens (153 tokens would fit; 16-aligned: 144)
    (1_179_648, 8_192, 16, 144),    # TP 2, 3 draft tokens: exactly 144 tokens, no padding
    (1_327_104, 8_192, 16, 160),    # TP 2, 8 draft tokens
    (2_211_840, 16_384, 16, 128),   # TP 1, no speculation: vllm#54174's fixed 128 is this case
    (10_000, 16_384, 16, None),     # not even one kernel block fits
])
def test_draft_block_tokens(page, per_token, kernel, want):
    from vllm_ling.models.dspark_blocks import draft_block_tokens

    got = draft_block_tokens(page, per_token, kernel)
    assert got == want
    if got:
        assert got % kernel == 0 and got * per_token <= page < (got + kernel) * per_token


def _full_size_specs(draft_block: int | None):
    """KV-cache specs of the full-size pair at TP 1 with 8 draft tokens, built with vLLM's spec
    classes: 35 KDA state layers, 7 MLA layers at the hybrid-aligned block, 5 dense draft layers."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    shapes = MambaStateShapeCalculator.kda_state_shape(1, 32, 128, conv_kernel_size=4, num_spec=8)
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    mla_token = MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=576, dtype=torch.bfloat16).page_size_bytes
    block = 128 * math.ceil(mamba_page / (128 * mla_token))  # vLLM's _align_hybrid_block_size (MLA: x128)
    page = block * mla_token
    specs = {f"kda.{i}": MambaSpec(shapes=shapes, dtypes=dtypes, block_size=block, page_size_padded=page,
                                   num_speculative_blocks=8) for i in range(35)}
    specs |= {f"mla.{i}": MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
              for i in range(7)}
    specs |= {f"draft.{i}": FullAttentionSpec(block_size=draft_block or block, num_kv_heads=32, head_size=128,
                                              dtype=torch.bfloat16) for i in range(5)}
    return specs, block, page


def test_global_block_cannot_be_unified_but_the_sized_one_can():
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size

    from vllm_ling.models.dspark_blocks import draft_block_tokens

    specs, block, page = _full_size_specs(None)
    assert block == 2176 and page == 2_506_752
    assert specs["draft.0"].page_size_bytes / page > 14  # 35.7 MB against 2.5 MB
    with pytest.raises(NotImplementedError, match="page size is not divisible"):
        unify_kv_cache_spec_page_size(specs)

    sized = draft_block_tokens(page, 32 * 128 * 2 * 2, 16)
    specs, _, _ = _full_size_specs(sized)
    unified = unify_kv_cache_spec_page_size(specs)
    assert {s.page_size_bytes for s in unified.values()} == {page}
    for name, spec in unified.items():
        if not name.startswith("draft."):
            assert spec == specs[name], name  # no target layer changed
    draft = unified["draft.0"]
    assert draft.block_size == sized == 144
    padding = page - sized * 32 * 128 * 2 * 2
    assert 0 <= padding < 16 * 32 * 128 * 2 * 2  # less than one kernel block of the draft's own page


def test_loaded_drafter_reports_the_sized_block(loaded_agreeing_dspark):
    from vllm_ling.models.dspark_blocks import BLOCK_ATTR, kernel_block, unified_page_bytes
    from vllm_ling.models.ling3 import LingForCausalLM
    from vllm_ling.layers.dspark_drafter import draft_pages
    from vllm_ling.models.dspark_selection import PAGES_FIT

    vllm_config, _, draft = loaded_agreeing_dspark
    page = unified_page_bytes(vllm_config, LingForCausalLM)
    attn = draft.model.layers[0].self_attn.attn
    spec = attn.get_kv_cache_spec(vllm_config)
    assert spec.block_size == getattr(attn, BLOCK_ATTR)
    assert spec.block_size % kernel_block(attn) == 0
    assert spec.page_size_bytes <= page < spec.page_size_bytes + kernel_block(attn) * spec.page_size_bytes // spec.block_size
    assert spec.block_size != vllm_config.cache_config.block_size  # the global block would not fit
    assert draft_pages(draft, vllm_config) == PAGES_FIT  # as the drafter's reader reports it
