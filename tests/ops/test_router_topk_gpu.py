"""The grouped top-k kernel (vllm_ling.ops.router_topk) against the plain-PyTorch reference
(vllm_ling.ops.moe.routing.grouped_topk, itself checked by brute force in tests/ops/moe). GPU only:
run on the device with `python -m pytest -m gpu tests/ops/test_router_topk_gpu.py` (the lease's
`cuts` phase of scripts/h200_session.sh)."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu marker)")]

CONFIG = json.loads(resources.files("vllm_ling").joinpath("data/ling3_flash_fp4_config.json").read_text())
LING = (CONFIG["num_experts"], CONFIG["n_group"], CONFIG["topk_group"], CONFIG["num_experts_per_tok"])


VARIANTS = ("rounds", "ranks")  # vllm_ling.ops.router_topk.kernel.VARIANTS: the served one and its candidate


def _check(tokens: int, experts: int, n_group: int, topk_group: int, top_k: int, renormalize: bool, seed: int,
           variant: str = "rounds"):
    from vllm_ling.ops.moe.routing import grouped_topk
    from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=g) * 3
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1
    scale = CONFIG["routed_scaling_factor"]
    want_w, want_ids = grouped_topk(logits, top_k, n_group, topk_group, bias, renormalize, scale)
    got_w, got_ids = grouped_topk_cuda(logits, bias, top_k, n_group, topk_group, renormalize, scale, variant=variant)
    torch.cuda.synchronize()
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids.cpu()), (got_ids, want_ids)  # best first, both
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)  # the sum order of the renormalisation


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 2, 4, 16, 64])
def test_lings_router_picks_the_references_experts_with_its_weights(tokens, variant):
    for seed in range(8):
        _check(tokens, *LING, renormalize=True, seed=seed, variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cfg", [(64, 2, 1, 4), (256, 8, 2, 6), (1024, 32, 5, 32)], ids=str)
def test_other_shapes_and_no_renormalisation(cfg, variant):
    _check(8, *cfg, renormalize=False, seed=1, variant=variant)


def test_the_candidate_agrees_with_the_served_variant_at_exact_ties():
    """Logits rounded to a coarse grid tie often: both variants break ties by the lower expert index (the
    candidate's ranks by warp order across warps), and sum the renormalisation in pick order: equal weights."""
    from vllm_ling.ops.router_topk.kernel import CANDIDATE_VARIANT, SERVED_VARIANT, grouped_topk_cuda

    for seed, routing in ((3, LING), (4, (1024, 32, 5, 32)), (5, (256, 8, 2, 6))):
        g = torch.Generator(device="cuda").manual_seed(seed)
        logits = (torch.randn(64, routing[0], device="cuda", generator=g) * 4).round() / 4
        bias = torch.zeros(routing[0], device="cuda")
        served = grouped_topk_cuda(logits, bias, routing[3], routing[1], routing[2], variant=SERVED_VARIANT)
        candidate = grouped_topk_cuda(logits, bias, routing[3], routing[1], routing[2], variant=CANDIDATE_VARIANT)
        assert torch.equal(served[1], candidate[1]) and torch.equal(served[0], candidate[0]), routing


def test_a_row_stride_other_than_the_expert_count_is_read_as_such():
    from vllm_ling.ops.moe.routing import grouped_topk
    from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda

    wide = torch.randn(4, LING[0] + 32, device="cuda")
    logits, bias = wide[:, :LING[0]], torch.zeros(LING[0], device="cuda")
    got = grouped_topk_cuda(logits, bias, LING[3], LING[1], LING[2])
    want = grouped_topk(logits.contiguous(), LING[3], LING[1], LING[2], bias)
    assert torch.equal(got[1], want[1])


def test_it_captures_in_a_cuda_graph_and_replays_on_new_logits():
    from vllm_ling.ops.moe.routing import grouped_topk
    from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda

    logits = torch.randn(2, LING[0], device="cuda")
    bias = torch.randn(LING[0], device="cuda") * 0.1
    weights, ids = grouped_topk_cuda(logits, bias, LING[3], LING[1], LING[2])  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_topk_cuda(logits, bias, LING[3], LING[1], LING[2], weights=weights, ids=ids)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids, grouped_topk(logits, LING[3], LING[1], LING[2], bias)[1])


def test_a_configuration_it_cannot_route_is_refused_naming_why():
    from vllm_ling.ops.router_topk.kernel import grouped_topk_cuda

    with pytest.raises(ValueError, match="groups"):
        grouped_topk_cuda(torch.randn(1, 512, device="cuda"), torch.zeros(512, device="cuda"), 8, 5, 2)


def test_warmup_builds_lings_kernel_and_refuses_what_it_cannot_route():
    from vllm_ling.ops.router_topk import warmup

    done = warmup.warmup_kernels(*LING)
    assert "ling_grouped_topk (512 experts, 8 groups keep 4, top-8)" == done["kernel"]
    with pytest.raises(ValueError, match="48 experts is not a multiple of 32"):
        warmup.warmup_kernels(48, 4, 2, 2)
