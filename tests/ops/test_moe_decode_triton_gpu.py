"""Triton MXFP4 decode experts against the plain-PyTorch reference at Ling shapes (GPU only).

Weights: random MXFP4 codes and E8M0 scales in vLLM's layout (512 experts, hidden 2560,
intermediate 768, top-8). The reference dequantizes the *same* tensors to float32 and
computes in float32 (TF32 off), so both sides use bit-identical weights and the same BF16
hidden states. The kernels decode e2m1 x 2**k exactly (BF16 or fp32 holds it) and
accumulate in fp32; the differences are the BF16 rounding of the SwiGLU output (act) and of
the final output (2**-9 relative each, ~0.3 % together) plus accumulation order.

Tolerance: relative Frobenius error ||out - ref|| / ||ref|| < 1e-2 -- 3x the expected BF16
error, while a wrong expert, a wrong row, a wrong nibble order, a missing scale or a
missed clamp are O(1) errors. The clamp cases also check that the clamp changes the result.
"""

import pytest
import torch

from vllm_ling.ops import moe

import moe_cases  # tests/ops/moe_cases.py
from vllm_ling.ops import moe_decode_triton as mdt

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
_ok, _reason = mdt.triton_decode_available(torch.device("cuda"))
if not _ok:
    pytest.skip(f"Triton decode path cannot run here: {_reason}", allow_module_level=True)

E, H, I, TOP_K = 512, 2560, 768, 8
TOL = 1e-2
LIMIT = 4.0
DEV = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="module")
def weights():
    return moe.random_mxfp4_experts(E, H, I, device=DEV, seed=4321)


@pytest.fixture(scope="module", params=mdt.MODES)
def experts(request, weights):
    return mdt.TritonMxfp4DecodeExperts(**weights, mode=request.param)


def _routing(kind: str, T: int, seed: int):
    return moe_cases.routing(kind, T, seed, DEV, E, TOP_K)


def _x(T: int, seed: int, scale: float = 1.0):
    return moe_cases.hidden(T, seed, H, DEV, scale)


def _ref(weights, x, w, ids, limit=None):
    return moe.experts_reference(x, weights["w13_weight"], weights["w2_weight"], w, ids, limit,
                                 w13_scale=weights["w13_weight_scale"],
                                 w2_scale=weights["w2_weight_scale"])


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", ["random", "one_expert", "edges", "repeated"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_matches_reference(weights, experts, kind, T):
    w, ids = _routing(kind, T, seed=T)
    x = _x(T, seed=100 + T)
    out = experts(x, w, ids)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    rel = _rel(out, _ref(weights, x, w, ids))
    assert rel < TOL, f"{experts.mode} {kind} T={T}: rel err {rel:.2e}"


@pytest.mark.parametrize("T", [1, 4])
def test_clamp_matches_reference(weights, experts, T):
    w, ids = _routing("edges", T, seed=T + 20)
    x = _x(T, seed=30 + T, scale=8.0)  # gate/up values well beyond the limit
    ref = _ref(weights, x, w, ids, LIMIT)
    unclamped = _ref(weights, x, w, ids)
    assert (ref - unclamped).norm() / ref.norm() > 0.1  # the clamp really bites
    rel = _rel(experts(x, w, ids, LIMIT), ref)
    assert rel < TOL, f"{experts.mode} clamp T={T}: rel err {rel:.2e}"
    # 0 means "no clamp", as in vLLM
    assert _rel(experts(x, w, ids, 0.0), unclamped) < TOL


def test_cuda_graph_replay_matches_eager(weights, experts):
    T = 4
    w, ids = _routing("random", T, seed=11)
    x = _x(T, seed=12)
    static = [x.clone(), w.clone(), ids.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts(*static)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(*static)
    w2, ids2 = _routing("edges", T, seed=13)
    x2 = _x(T, seed=14)
    for dst, src in zip(static, (x2, w2, ids2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, experts(x2, w2, ids2))
    assert _rel(out, _ref(weights, x2, w2, ids2)) < TOL


def test_bad_input_is_refused(weights):
    experts = mdt.TritonMxfp4DecodeExperts(**weights)
    w, ids = _routing("random", 5, seed=1)
    with pytest.raises(ValueError, match="max_assignments"):
        experts(_x(5, seed=2), w, ids)
    with pytest.raises(ValueError, match="bfloat16"):
        experts(_x(1, seed=2).float(), w[:1], ids[:1])
    with pytest.raises(ValueError, match="w2_weight_scale"):
        mdt.TritonMxfp4DecodeExperts(weights["w13_weight"], weights["w13_weight_scale"],
                                     weights["w2_weight"], weights["w2_weight_scale"][:, :, :-1])


def test_words_mode_refuses_out_of_range_scales():
    small = moe.random_mxfp4_experts(2, 64, 64, device=DEV, seed=3)
    small["w2_weight_scale"][1, 0, 0] = mdt.WORDS_MAX_SCALE_EXP + 1
    blocks = dict(block_k_gate_up=64, block_k_down=64)
    with pytest.raises(ValueError, match="words_fma"):
        mdt.TritonMxfp4DecodeExperts(**small, mode="words_fma", **blocks)
    mdt.TritonMxfp4DecodeExperts(**small, mode="dot_scaled", **blocks)  # no such limit there
