"""humming MXFP4 MoE against the plain-PyTorch reference at Ling shapes (GPU only).

Weights: random MXFP4 codes and E8M0 scales in vLLM's layout, 512 experts, hidden 2560,
intermediate 768, top-8. The reference dequantizes the *same* MXFP4 tensors to float32 and
computes in float32 (TF32 off), so the weights are bit-identical on both sides and the
difference comes only from the kernel's BF16 rounding of intermediates (gate_up output,
SwiGLU output, down output, BF16 top-k weights in the final sum; each about 2**-9 relative)
and its accumulation order.

Tolerances (relative Frobenius error ||out - ref|| / ||ref||):
- W4A16: 1e-2. Four BF16 roundings of ~2**-9 = 0.2 % each give ~0.4-0.5 %; 1e-2 leaves 2x
  margin and still fails on any wrong expert, wrong row or missed clamp (those are O(1)).
- W4A8 vs a reference that rounds both GEMM inputs to FP8 e4m3 per token the same way
  (amax / 448): 3e-2 -- codes near a rounding boundary flip because the kernel quantizes
  BF16 intermediates (one e4m3 step is 6-12 %, a few percent of codes flip).
- W4A8 vs the unquantized float32 reference: 1e-1 (two e4m3 roundings, ~3.5 % rms each).
Every case also requires finite outputs and that the clamp test's clamp changes the result.
"""

import pytest
import torch

import moe_cases  # tests/ops/moe/moe_cases.py
from moe_cases import no_tf32, weights  # noqa: F401  (fixtures)
from vllm_ling.ops.moe import activation, humming, reference, routing

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
_ok, _reason = humming.humming_status()
if not _ok:
    pytest.skip(f"humming cannot run here: {_reason}", allow_module_level=True)

E, H, I, TOP_K = 512, 2560, 768, 8
TOL_W4A16 = 1e-2
TOL_W4A8_SIM = 3e-2
TOL_W4A8_FP32 = 1e-1
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def w4a16(weights):
    return humming.HummingMxfp4Experts(**weights)


@pytest.fixture(scope="module")
def w4a8(weights):
    ok, reason = humming.humming_status(w4a8=True)
    if not ok:
        pytest.skip(reason)
    return humming.HummingMxfp4Experts(**weights, w4a8=True)


def _routing(kind: str, T: int, seed: int):
    return moe_cases.routing(kind, T, seed, DEV, E, TOP_K)


def _x(T: int, seed: int, scale: float = 1.0):
    return moe_cases.hidden(T, seed, H, DEV, scale)


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return ((out.float() - ref).norm() / ref.norm()).item()


def _ref(weights, x, w, ids, limit=None, fp8=False, clamp=activation.ROUTED_EXPERT_CLAMP):
    return reference.experts_reference(x, weights["w13_weight"], weights["w2_weight"], w, ids, limit,
                                 w13_scale=weights["w13_weight_scale"],
                                 w2_scale=weights["w2_weight_scale"], clamp=clamp,
                                 fp8_activations=fp8)


CASES = [(kind, T) for T in (1, 4, 16) for kind in ("random", "one_expert", "edges", "repeated")]


@pytest.mark.parametrize("kind, T", CASES)
def test_w4a16_matches_reference(weights, w4a16, kind, T):
    w, ids = _routing(kind, T, seed=T)
    x = _x(T, seed=100 + T)
    out = w4a16(x, w, ids)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    rel = _rel(out, _ref(weights, x, w, ids))
    assert rel < TOL_W4A16, f"{kind} T={T}: rel err {rel:.2e}"


@pytest.mark.parametrize("kind, T", [("random", 1), ("random", 4), ("random", 16),
                                     ("one_expert", 16), ("edges", 4), ("repeated", 4)])
def test_w4a8_matches_reference(weights, w4a8, kind, T):
    w, ids = _routing(kind, T, seed=T + 50)
    x = _x(T, seed=200 + T)
    out = w4a8(x, w, ids)
    rel_sim = _rel(out, _ref(weights, x, w, ids, fp8=True))
    rel_fp32 = _rel(out, _ref(weights, x, w, ids))
    assert rel_sim < TOL_W4A8_SIM, f"{kind} T={T}: rel err vs fp8-simulating ref {rel_sim:.2e}"
    assert rel_fp32 < TOL_W4A8_FP32, f"{kind} T={T}: rel err vs fp32 ref {rel_fp32:.2e}"


@pytest.mark.parametrize("clamp", list(activation.SwigluClamp))
def test_clamp_is_honoured(weights, w4a16, clamp):
    limit = 4.0
    experts = w4a16
    if clamp != w4a16.clamp:
        experts = humming.HummingMxfp4Experts(**weights, clamp=clamp)
    w, ids = _routing("random", 16, seed=7)
    x = _x(16, seed=8, scale=8.0)  # gate/up values well beyond the limit
    ref = _ref(weights, x, w, ids, limit, clamp=clamp)
    unclamped = _ref(weights, x, w, ids)
    assert (ref - unclamped).norm() / ref.norm() > 0.1  # the clamp really bites
    out = experts(x, w, ids, limit)
    rel = _rel(out, ref)
    assert rel < TOL_W4A16, f"{clamp}: rel err {rel:.2e}"
    # the same layer without a limit must not be clamped
    rel_off = _rel(experts(x, w, ids, None), unclamped)
    assert rel_off < TOL_W4A16


@pytest.mark.parametrize("clamp", list(activation.SwigluClamp))
def test_clamp_mode_is_the_one_built(weights, w4a16, clamp):
    """Issue 43: at a limit below most gates (1.0) the two modes differ by far more than the
    tolerance, and humming's activation expression computes the mode it was built with (the
    served one, after the SiLU, is the fixture's)."""
    assert w4a16.clamp is activation.ROUTED_EXPERT_CLAMP is activation.SwigluClamp.GATE_OUTPUT
    experts = w4a16 if clamp is w4a16.clamp else humming.HummingMxfp4Experts(**weights, clamp=clamp)
    other = next(m for m in activation.SwigluClamp if m is not clamp)
    w, ids = _routing("random", 16, seed=11)
    x = _x(16, seed=12, scale=8.0)
    ref, ref_other = _ref(weights, x, w, ids, 1.0, clamp=clamp), _ref(weights, x, w, ids, 1.0, clamp=other)
    assert (ref - ref_other).norm() / ref.norm() > 10 * TOL_W4A16  # the mode really decides here
    assert _rel(experts(x, w, ids, 1.0), ref) < TOL_W4A16, clamp


@pytest.mark.parametrize("kind, T", CASES)
def test_triton_routing_metadata_equals_torch(kind, T):
    _, ids = _routing(kind, T, seed=T + 3)
    for block in (8, 16, 32, 64):
        a = routing.moe_align_block_size_triton(ids, block, E)
        b = routing.moe_align_block_size_torch(ids, block, E)
        used = int(b[2].item())
        assert int(a[2].item()) == used
        assert torch.equal(a[0][:used], b[0][:used])
        assert torch.equal(a[1][:used // block], b[1][:used // block])
        assert (a[0][used:] == ids.numel()).all()


def test_cuda_graph_replay_matches_eager(weights, w4a16):
    T = 4
    w, ids = _routing("random", T, seed=11)
    x = _x(T, seed=12)
    w4a16(x, w, ids)  # compile outside capture
    static = [x.clone(), w.clone(), ids.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w4a16(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16(*static)
    w2, ids2 = _routing("random", T, seed=13)
    x2 = _x(T, seed=14)
    static[0].copy_(x2)
    static[1].copy_(w2)
    static[2].copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    eager = w4a16(x2, w2, ids2)
    assert torch.equal(out, eager)
    assert _rel(out, _ref(weights, x2, w2, ids2)) < TOL_W4A16


def test_w4a8_refused_below_sm89():
    major, minor = torch.cuda.get_device_capability()
    ok, reason = humming.humming_status(w4a8=True)
    assert ok == ((major, minor) >= (8, 9))
    if not ok:
        assert "sm_89" in reason


@pytest.mark.parametrize("T", [1, 4, 16])
def test_triton_weighted_sum_equals_fp32_sum(T):
    g = torch.Generator(device=DEV).manual_seed(T)
    down = torch.randn(T * TOP_K, H, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.rand(T, TOP_K, device=DEV, generator=g)
    ref = (down.float().view(T, TOP_K, H) * w.unsqueeze(-1)).sum(1)
    got = routing.weighted_topk_sum(down, w, "triton")
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < 4e-3  # only the final BF16 rounding
    assert _rel(routing.weighted_topk_sum(down, w, "torch"), ref) < 1e-2  # BF16 weights too
