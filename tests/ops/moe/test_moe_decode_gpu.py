"""Fused MXFP4 decode kernels against the plain-PyTorch reference (GPU only).

Same weights, routings and reference as tests/ops/moe/test_moe_humming_gpu.py (random MXFP4
codes and E8M0 scales in vLLM's layout at Ling shapes; the reference dequantizes the same
tensors and computes in float32, TF32 off).

Tolerance (relative Frobenius error): 1e-2. The kernels accumulate in FP32 (tensor core)
and round twice to BF16 (SwiGLU output, final output), each ~2**-9 relative, so the
expected error is ~3e-3; a wrong expert, row, scale, clamp or a flushed subnormal code is
O(1) (the ``half_codes`` case uses only the codes +-0.5, which the decode turns into BF16
subnormals: flushing them would give 100 % error).
"""

import copy

import pytest
import torch

import moe_cases  # tests/ops/moe/moe_cases.py
from moe_cases import no_tf32, weights  # noqa: F401  (fixtures)
from vllm_ling.ops.moe import activation, humming, reference
from vllm_ling.ops.moe.decode import layouts, packing, shapes

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
_ok, _reason = humming.humming_status()
if not _ok:  # the kernels are compiled by humming's JIT runtime
    pytest.skip(f"humming cannot run here: {_reason}", allow_module_level=True)


E, H, I, TOP_K = 512, 2560, 768, 8
TOL = 1e-2
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def humming_layer(weights):
    return humming.HummingMxfp4Experts(**weights)


@pytest.fixture(scope="module", params=["packed_copy", "humming_layout"])
def fused(request, weights, humming_layer):
    if request.param == "packed_copy":
        return layouts.PackedLayoutDecode(**weights, top_k=TOP_K)
    return layouts.HummingLayoutDecode(humming_layer, TOP_K)


def test_our_reading_of_humming_layout(weights, humming_layer):
    """humming_layout_pack / humming_layout_scales (which the kernels' index math follows)
    reproduce humming's own transform bit for bit."""
    for sub, w, sc in (("w13", "w13_weight", "w13_weight_scale"), ("w2", "w2_weight", "w2_weight_scale")):
        t = humming_layer.tensors[sub]
        assert torch.equal(packing.humming_layout_pack(weights[w][:4]), t["weight"][:4]), sub
        assert torch.equal(packing.humming_layout_scales(weights[sc]), t["weight_scale"].view(torch.uint8)), sub
    ok, reason = layouts.humming_decode_support(humming_layer, TOP_K)
    assert ok, reason


def test_support_refuses_tensors_the_bulk_copies_cannot_read(humming_layer):
    """The streamed kernel bulk-copies raw rows in 16-byte units: a misaligned or strided
    humming tensor is refused with the reason (HummingMxfp4Experts then logs it and keeps
    humming's GEMM) instead of faulting."""
    w = humming_layer.tensors["w13"]["weight"]
    shifted = torch.empty(w.numel() + 1, dtype=w.dtype, device=w.device)[1:].view(w.shape)  # 4-byte offset
    for bad in (shifted, w.transpose(1, 2).contiguous().transpose(1, 2)):
        other = copy.copy(humming_layer)
        other.tensors = {**humming_layer.tensors, "w13": {**humming_layer.tensors["w13"], "weight": bad}}
        ok, reason = layouts.humming_decode_support(other, TOP_K)
        assert not ok and reason == "w13 weight is not a contiguous, 16-byte aligned tensor"


@pytest.mark.parametrize("mode", ["auto", "copy", "off"])
def test_humming_experts_route_small_batches_to_the_decode_kernels(weights, mode):
    """HummingMxfp4Experts(top_k=...) sends T <= decode_max_tokens through the decode kernels
    (bit-identical to calling them) and larger batches through humming's GEMM."""
    experts = humming.HummingMxfp4Experts(**weights, top_k=TOP_K, decode=mode, decode_max_tokens=4)
    expected = {"auto": layouts.HummingLayoutDecode, "copy": layouts.PackedLayoutDecode}.get(mode)
    assert (experts.decoder is None) if expected is None else isinstance(experts.decoder, expected)
    assert experts.decode_status.startswith({"auto": "humming layout", "copy": "packed copy", "off": "off"}[mode])
    gemm_only = humming.HummingMxfp4Experts(**weights, top_k=TOP_K, decode="off")
    for T in (1, 4, 5):
        w, ids = moe_cases.routing("random", T, 40 + T, DEV, E, TOP_K)
        x = moe_cases.hidden(T, 50 + T, H, DEV)
        out = experts(x, w, ids)
        path = experts.decoder if (experts.decoder is not None and T <= 4) else gemm_only
        assert torch.equal(out, path(x, w, ids)), (mode, T)
        assert _rel(out, _ref(weights, x, w, ids)) < TOL


def _ref(weights, x, w, ids, limit=None, clamp=activation.ROUTED_EXPERT_CLAMP):
    return reference.experts_reference(x, weights["w13_weight"], weights["w2_weight"], w, ids, limit,
                                 w13_scale=weights["w13_weight_scale"],
                                 w2_scale=weights["w2_weight_scale"], clamp=clamp)


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


CASES = [(kind, T) for T in (1, 4, 8, 16) for kind in ("random", "one_expert", "edges", "repeated")]


@pytest.mark.parametrize("kind, T", CASES)
def test_matches_reference(weights, fused, kind, T):
    w, ids = moe_cases.routing(kind, T, T, DEV, E, TOP_K)
    x = moe_cases.hidden(T, 100 + T, H, DEV)
    out = fused(x, w, ids)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    rel = _rel(out, _ref(weights, x, w, ids))
    assert rel < TOL, f"{kind} T={T}: rel err {rel:.2e}"


def test_int64_ids_and_launch_variants_agree(weights, fused):
    w, ids = moe_cases.routing("random", 4, 9, DEV, E, TOP_K)
    x = moe_cases.hidden(4, 9, H, DEV)
    base = fused(x, w, ids)
    assert torch.equal(fused(x, w, ids.long()), base)
    if isinstance(fused, layouts.PackedLayoutDecode):
        configs = (shapes.PackedDecodeConfig(k_split_gate_up=4, k_split_down=1, use_pdl=False),
                   shapes.PackedDecodeConfig(k_split_gate_up=10, k_split_down=3, min_blocks_gate_up=2))
    else:  # the default's launch shapes differ for 1 token: both, and other streaming shapes
        configs = (*fused.configs.values(),
                   shapes.HummingDecodeConfig(gate_up=shapes.StreamedGateUp(cluster=4, blocks_per_cta=6, stages=3,
                                                                  groups_per_stage=2, min_blocks=2),
                                         down=shapes.RegisterDown(groups_per_warp=1), use_pdl=False),
                   shapes.HummingDecodeConfig(gate_up=shapes.StreamedGateUp(blocks_per_cta=12, stages=2, min_blocks=2),
                                         down=shapes.RegisterDown(groups_per_warp=6)),
                   shapes.HummingDecodeConfig(gate_up=shapes.StreamedGateUp(blocks_per_cta=1, cluster=2, stages=8)))
    for cfg in configs:
        out = fused.with_config(cfg)(x, w, ids)
        assert _rel(out, base.float()) < 2e-3, cfg  # only the FP32 summation order differs


def test_clamp_is_honoured(weights, fused):
    limit = 4.0
    w, ids = moe_cases.routing("random", 8, 7, DEV, E, TOP_K)
    x = moe_cases.hidden(8, 8, H, DEV, scale=8.0)
    ref, unclamped = _ref(weights, x, w, ids, limit), _ref(weights, x, w, ids)
    assert (ref - unclamped).norm() / ref.norm() > 0.1  # the clamp really bites
    assert _rel(fused(x, w, ids, limit), ref) < TOL
    assert _rel(fused(x, w, ids, None), unclamped) < TOL


@pytest.mark.parametrize("clamp", list(activation.SwigluClamp))
@pytest.mark.parametrize("impl", ["packed_copy", "humming_layout"])
def test_clamp_mode_is_the_one_built(weights, humming_layer, impl, clamp):
    """Issue 43: the CLAMP_GATE_OUTPUT define decides the mode; the default build (the one served)
    clamps after the SiLU. At a limit below most gates (1.0) the two modes differ by > 10x TOL."""
    assert humming_layer.clamp is activation.ROUTED_EXPERT_CLAMP is activation.SwigluClamp.GATE_OUTPUT
    if impl == "packed_copy":
        kernels = layouts.PackedLayoutDecode(**weights, top_k=TOP_K, clamp=clamp)
    else:
        layer = humming_layer if clamp is humming_layer.clamp else humming.HummingMxfp4Experts(**weights, clamp=clamp)
        kernels = layouts.HummingLayoutDecode(layer, TOP_K)
    other = next(m for m in activation.SwigluClamp if m is not clamp)
    w, ids = moe_cases.routing("random", 4, 13, DEV, E, TOP_K)
    x = moe_cases.hidden(4, 14, H, DEV, scale=8.0)
    ref, ref_other = _ref(weights, x, w, ids, 1.0, clamp), _ref(weights, x, w, ids, 1.0, other)
    assert (ref - ref_other).norm() / ref.norm() > 10 * TOL
    assert _rel(kernels(x, w, ids, 1.0), ref) < TOL, (impl, clamp)


@pytest.mark.parametrize("impl", ["packed_copy", "humming_layout"])
@pytest.mark.parametrize("codes", ["half_codes", "all_codes"])
def test_every_code_and_edge_scales(codes, impl):
    e, h, i, k = 4, 256, 128, 2  # humming pads N to 256: the smallest unpadded shapes
    g = torch.Generator(device=DEV).manual_seed(5)
    if codes == "half_codes":  # only +-0.5 (BF16 subnormals after the decode)
        pick = torch.tensor([0x11, 0x19, 0x91, 0x99], dtype=torch.uint8, device=DEV)
        rnd = lambda *s: pick[torch.randint(0, 4, s, device=DEV, generator=g)]  # noqa: E731
    else:
        rnd = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device=DEV, generator=g)  # noqa: E731
    scale_pick = torch.tensor([1, 100, 127, 130, 228], dtype=torch.uint8, device=DEV)
    sc = lambda *s: scale_pick[torch.randint(0, 5, s, device=DEV, generator=g)]  # noqa: E731
    tensors = {"w13_weight": rnd(e, 2 * i, h // 2), "w13_weight_scale": sc(e, 2 * i, h // 32),
               "w2_weight": rnd(e, h, i // 2), "w2_weight_scale": sc(e, h, i // 32)}
    # keep values finite in the reference: big scales only on the down projection's inputs'
    tensors["w13_weight_scale"].clamp_(max=130)
    if impl == "packed_copy":
        fused = layouts.PackedLayoutDecode(**tensors, top_k=k)
    else:  # top_k 2: 2-CTA clusters in down
        fused = layouts.HummingLayoutDecode(humming.HummingMxfp4Experts(**tensors), k)
    ids = torch.tensor([[0, 3], [1, 2], [3, 3]], dtype=torch.int32, device=DEV)
    w = torch.tensor([[0.7, 0.3], [1.0, 0.5], [0.25, 0.25]], device=DEV)
    x = moe_cases.hidden(3, 11, h, DEV) * 2.0 ** -40 if codes == "all_codes" else moe_cases.hidden(3, 11, h, DEV)
    out = fused(x.to(torch.bfloat16), w, ids)
    ref = reference.experts_reference(x.to(torch.bfloat16), tensors["w13_weight"], tensors["w2_weight"], w, ids,
                                None, w13_scale=tensors["w13_weight_scale"],
                                w2_scale=tensors["w2_weight_scale"])
    assert torch.isfinite(ref).all() and ref.norm() > 0
    assert _rel(out, ref) < TOL


def test_cuda_graph_replay_matches_eager(fused):
    w, ids = moe_cases.routing("random", 4, 3, DEV, E, TOP_K)
    x = moe_cases.hidden(4, 3, H, DEV)
    eager = fused(x, w, ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(x, w, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x, w, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    w2, ids2 = moe_cases.routing("random", 4, 4, DEV, E, TOP_K)
    ids.copy_(ids2)
    w.copy_(w2)
    graph.replay()  # new routing through the same graph
    torch.cuda.synchronize()
    assert torch.equal(out, fused(x, w, ids))
