"""vLLM's one-launch CUDA routing metadata, which vllm-ling's humming experts take for prefill-sized
batches (issue 47), against the PyTorch reference layout and output (GPU only).

Run on the device: ``python -m pytest -q -m gpu tests/layers/test_moe_routing_gpu.py`` (needs vLLM's
CUDA build and humming-kernels; ``scripts/h200_session.sh`` runs it in the ``moe-clamp`` part).
vLLM's kernel may list one expert's rows in another order than the reference (it scatters them); the
GEMM computes each row on its own, so the layout is compared per expert as a set of rows and the
experts' outputs must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops.moe import routing

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

E, TOP_K = 512, 8


def _ids(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)]).int().cuda()


def _per_expert_rows(sorted_ids, expert_ids, ntp, block):
    used = int(ntp.item())
    rows: dict[int, set[int]] = {}
    for b in range(used // block):
        rows.setdefault(int(expert_ids[b]), set()).update(sorted_ids[b * block:(b + 1) * block].tolist())
    return used, rows


@pytest.mark.parametrize("tokens", [17, 40, 300, 2048])
@pytest.mark.parametrize("block", [16, 64])
def test_vllms_routing_metadata_is_the_reference_layout(tokens, block):
    from vllm_ling.layers.moe_method import vllm_moe_align

    ids = _ids(tokens, tokens * 3 + block)
    got = vllm_moe_align(ids, block, E)
    ref = routing.moe_align_block_size_torch(ids, block, E)
    assert [t.shape for t in got] == [t.shape for t in ref] and all(t.dtype == torch.int32 for t in got)
    assert _per_expert_rows(*got, block) == _per_expert_rows(*ref, block)


@pytest.mark.parametrize("tokens", [40, 300])
def test_humming_experts_compute_the_same_with_either_routing_metadata(tokens):
    from vllm_ling.layers.moe_method import vllm_moe_align
    from vllm_ling.ops.moe import humming
    from vllm_ling.ops.moe.warmup import random_mxfp4_experts

    ok, why = humming.humming_status()
    if not ok:
        pytest.skip(f"humming cannot run here: {why}")
    weights = random_mxfp4_experts(E, 2560, 768, "cuda", seed=3)
    plain = humming.HummingMxfp4Experts(**weights, top_k=TOP_K, decode="off")
    one_launch = humming.HummingMxfp4Experts(**weights, top_k=TOP_K, decode="off", prefill_align=vllm_moe_align)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2560, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = _ids(tokens, tokens)
    w = torch.rand(tokens, TOP_K, device="cuda", generator=g)
    a, b = plain(x, w, ids, 4.0), one_launch(x, w, ids, 4.0)
    assert torch.isfinite(a).all() and torch.equal(a, b)
