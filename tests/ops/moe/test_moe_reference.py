"""CPU tests of the Ling MoE block reference: a per-token float64 loop with Python-level
routing, dequantized weights, the FP8 activation rounding, the HF config."""

import json
import math
from pathlib import Path

import pytest
import torch

from moe_cases import brute_force_route
from vllm_ling.ops.moe import reference
from vllm_ling.ops.mxfp4 import mxfp4_dequantize, mxfp4_quantize

REPO = Path(__file__).resolve().parents[3]
SILU = lambda v: v / (1.0 + math.exp(-v))  # noqa: E731


# ----------------------------------------------------------------------------- block

def _make_block(E=16, H=64, I=32, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    w13_q, w13_s = mxfp4_quantize(w13)
    w2_q, w2_s = mxfp4_quantize(w2)
    return dict(
        gate_weight=torch.randn(E, H, generator=g) * 0.3,
        expert_bias=torch.randn(E, generator=g) * 0.1,
        w13=w13_q, w13_scale=w13_s, w2=w2_q, w2_scale=w2_s,
        shared_gate_up=torch.randn(2 * S, H, generator=g) * 0.2,
        shared_down=torch.randn(H, S, generator=g) * 0.2,
    )


def _per_token_loop(x, blk, cfg, routed_limit, shared_limit):
    """Independent per-token computation in float64 with Python-level routing."""
    w13 = mxfp4_dequantize(blk["w13"], blk["w13_scale"]).double()
    w2 = mxfp4_dequantize(blk["w2"], blk["w2_scale"]).double()
    out = []
    for t in range(x.shape[0]):
        xt = x[t].double()
        logits = (blk["gate_weight"].double() @ xt).tolist()
        routes = brute_force_route(logits, blk["expert_bias"].tolist(), cfg.top_k, cfg.n_group,
                                    cfg.topk_group, cfg.routed_scaling_factor)
        acc = torch.zeros_like(xt)
        for e, weight in routes.items():
            h = w13[e] @ xt
            I = h.shape[0] // 2
            gate, up = h[:I].tolist(), h[I:].tolist()
            act = []
            for gv, uv in zip(gate, up):  # routed experts clamp after the SiLU, as trained (issue 43)
                a = SILU(gv)
                if routed_limit:
                    a, uv = min(a, routed_limit), max(min(uv, routed_limit), -routed_limit)
                act.append(a * uv)
            acc += weight * (w2[e] @ torch.tensor(act, dtype=torch.float64))
        hs = blk["shared_gate_up"].double() @ xt
        S = hs.shape[0] // 2
        sact = []
        for gv, uv in zip(hs[:S].tolist(), hs[S:].tolist()):
            a = SILU(gv)
            if shared_limit:
                a, uv = min(a, shared_limit), max(min(uv, shared_limit), -shared_limit)
            sact.append(a * uv)
        acc += blk["shared_down"].double() @ torch.tensor(sact, dtype=torch.float64)
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("routed_limit, shared_limit", [(None, None), (0.5, 0.3)])
def test_block_reference_matches_per_token_loop(routed_limit, shared_limit):
    cfg = reference.LingMoEConfig(num_experts=16, top_k=4, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, hidden_size=64,
                            moe_intermediate_size=32, shared_intermediate_size=32)
    blk = _make_block()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got = reference.moe_block_reference(x, cfg, routed_swiglu_limit=routed_limit,
                                  shared_swiglu_limit=shared_limit, **blk)
    ref = _per_token_loop(x, blk, cfg, routed_limit, shared_limit)
    assert got.dtype == torch.float32
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-5, rel  # both float-accurate; only fp32 vs fp64 rounding differs
    if routed_limit:
        # the clamp must actually bite in this case, or the test proves nothing
        unclamped = reference.moe_block_reference(x, cfg, **blk)
        assert (unclamped - got).norm() / got.norm() > 1e-2


def test_experts_reference_mxfp4_equals_dequantized_weights():
    blk = _make_block(seed=4)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[0, 15, 3, 3]] * 3 + [[7, 7, 7, 7]] * 3, dtype=torch.int32)
    w = torch.rand(6, 4, generator=torch.Generator().manual_seed(6))
    a = reference.experts_reference(x, blk["w13"], blk["w2"], w, ids, 0.5,
                              w13_scale=blk["w13_scale"], w2_scale=blk["w2_scale"])
    b = reference.experts_reference(x, mxfp4_dequantize(blk["w13"], blk["w13_scale"]),
                              mxfp4_dequantize(blk["w2"], blk["w2_scale"]), w, ids, 0.5)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="scales"):
        reference.experts_reference(x, blk["w13"], blk["w2"], w, ids)


def test_fake_quant_fp8_keeps_row_max_and_relative_error():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)) * 3
    q = reference.fake_quant_fp8_per_token(x)
    assert torch.allclose(q.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    assert ((q - x).norm() / x.norm()) < 0.05  # e4m3 has 3 mantissa bits


def test_config_from_hf_config_file():
    path = REPO / "vllm_ling" / "data" / "ling3_flash_fp4_config.json"  # shipped with the package
    cfg = reference.LingMoEConfig.from_hf_config(json.loads(path.read_text()))
    assert (cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == (512, 8, 8, 4)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.routed_scaling_factor) == (2560, 768, 2.5)
