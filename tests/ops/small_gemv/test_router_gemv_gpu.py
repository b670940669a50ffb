"""The router GEMV against the float64 plain-PyTorch reference (GPU only).

Ling's gate (512 experts x 2560, fp32) at 1..32 rows, other expert counts (a partial last CTA)
and hidden sizes (128..4096), every CTA width and tokens per pass, PDL on and off, strided
activation rows, extreme magnitudes, CUDA-graph capture, bad inputs refused before launch.

Tolerance per output: ``2**-16 S`` with ``S = |x| @ |w|.T`` (float64). Each fused
multiply-add rounds once (2**-24 relative); a lane chains H / 32 <= 128 of them and the warp
butterfly adds 5 levels, so even the worst case stays below 2**-16.9 S at H = 4096 (Ling's 2560:
2**-17.5 S). A wrong pairing of weights and activations, a lost term or a wrong row is off by
O(S / H) >= 2**-12 S. Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from vllm_ling.ops.small_gemv.router import (MAX_ROWS, magnitude_bound, reference_router_logits, router_logits,
                                  unavailable_reason)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or unavailable_reason() is not None:
    pytest.skip(f"needs a CUDA GPU the kernel runs on ({unavailable_reason()})", allow_module_level=True)

CONFIG = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "vllm_ling", "data",
                                     "ling3_flash_fp4_config.json")))
E, H = CONFIG["num_experts"], CONFIG["hidden_size"]
DEV = torch.device("cuda")


def _inputs(t, e, h, seed=0, x_scale=1.0, w_scale=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn((t, h), device=DEV, generator=g) * x_scale).to(torch.bfloat16)
    w = torch.randn((e, h), device=DEV, generator=g) * (w_scale if w_scale is not None else h**-0.5)
    return x, w


def _check(x, w, **kw):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.float32, device=DEV)
    got = router_logits(x, w, out=out, **kw).double()
    ref = reference_router_logits(x, w)
    bad = ~((got - ref).abs() <= 2.0**-16 * magnitude_bound(x, w))
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} logits off; worst {(got - ref).abs().max().item():.3g}"
    return got


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 15, MAX_ROWS])
def test_ling_gate_every_row_count(rows):
    _check(*_inputs(rows, E, H, seed=rows))


@pytest.mark.parametrize("experts,hidden", [(512, 128), (7, 2560), (256, 3072), (130, 4096), (1, 256)])
def test_other_shapes_partial_last_cta(experts, hidden):
    _check(*_inputs(3, experts, hidden, seed=experts))


@pytest.mark.parametrize("warps,tokens_per_pass,pdl", [(1, 1, True), (2, 2, False), (4, 2, True), (8, 4, True),
                                                       (4, 3, False)])
def test_launch_shapes(warps, tokens_per_pass, pdl):
    _check(*_inputs(5, E, H, seed=warps), warps=warps, tokens_per_pass=tokens_per_pass, pdl=pdl)


@pytest.mark.parametrize("x_scale,w_scale", [(2.0**60, 1e-30), (2.0**-60, 2.0**60), (1e4, 1e4)])
def test_extreme_magnitudes(x_scale, w_scale):
    _check(*_inputs(2, E, H, seed=1, x_scale=x_scale, w_scale=w_scale))


def test_strided_rows_read_only_their_columns():
    x, w = _inputs(4, E, H, seed=2)
    wide = torch.full((4, H + 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    wide[:, :H] = x
    _check(wide[:, :H], w)


def test_cuda_graph_capture_and_replay():
    x, w = _inputs(4, E, H, seed=3)
    out = torch.empty((4, E), dtype=torch.float32, device=DEV)
    router_logits(x, w, out=out)  # compile outside the capture
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        router_logits(x, w, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from the eager call"
    x.copy_(_inputs(4, E, H, seed=4)[0])
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_router_logits(x, w)
    assert ((out.double() - ref).abs() <= 2.0**-16 * magnitude_bound(x, w)).all(), "replay did not read the new x"


def test_rejects_bad_inputs_before_launch():
    x, w = _inputs(2, E, H)
    for bad_x, bad_w, words in [(x.float(), w, "BF16"), (x, w.bfloat16(), "fp32 gate"),
                                (x[:, :2048], w, "do not match"), (x, w[:, :2000].contiguous(), "multiple of 128"),
                                (torch.zeros((MAX_ROWS + 1, H), dtype=torch.bfloat16, device=DEV), w, "rows"),
                                (x, torch.zeros((E, 8192), device=DEV), "exceeds")]:
        with pytest.raises(ValueError, match=words):
            router_logits(bad_x, bad_w)
