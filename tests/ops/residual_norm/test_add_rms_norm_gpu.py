"""The residual add + RMSNorm kernel (vllm_ling.ops.residual_norm) against the plain-PyTorch reference and
vLLM's native IR op, and served through vLLM's dispatcher. GPU only: run on the device with
`python -m pytest -m gpu tests/ops/residual_norm` (the lease's kernel suites, scripts/h200_session.sh); without
vLLM installed (humming alone, ../shared/tools/device-wheels.sh) the kernel's own tests run and those through
vLLM's IR op skip."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from vllm_ling.ops.residual_norm.reference import NORM_ATOL, NORM_RTOL

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu marker)")]

CONFIG = json.loads(resources.files("vllm_ling").joinpath("data/ling3_flash_fp4_config.json").read_text())
HIDDEN, EPS = CONFIG["hidden_size"], CONFIG["rms_norm_eps"]


def _rows(tokens: int, hidden: int, seed: int, scale: float = 4.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (scale * torch.randn(tokens, hidden, generator=g)).to(torch.bfloat16).cuda()
    residual = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).cuda()
    return x, residual, weight


@pytest.mark.parametrize("tokens", [1, 2, 4, 33, 2048])
@pytest.mark.parametrize("hidden", [HIDDEN, 256, 2048, 8192, 12288])
def test_matches_the_reference(tokens, hidden):
    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add_rms_norm

    x, residual, weight = _rows(tokens, hidden, seed=tokens + hidden)
    out, new_residual = add_rms_norm_cuda(x, residual, weight, EPS)
    want_out, want_residual = add_rms_norm(x, residual, weight, EPS)
    torch.cuda.synchronize()
    assert torch.equal(new_residual, want_residual)  # fp32 sum rounded once: exact
    torch.testing.assert_close(out.float(), want_out.float(), rtol=NORM_RTOL, atol=NORM_ATOL)
    # and not a copy of its input: the rows are normalised (mean square about 1 before the weight)
    assert abs((out.float() / weight.float()).square().mean().item() - 1) < 0.05


@pytest.mark.parametrize("tokens", [1, 4, 67, 2048])
def test_two_addends_match_the_graphs_sum_then_norm(tokens):
    """x + x2 rounded to BF16 first (the MoE's shared + routed outputs as the graph adds them), then the norm:
    the residual exact, and a kernel that skipped the rounding or the second addend is caught."""
    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add2_rms_norm, add_rms_norm

    x, residual, weight = _rows(tokens, HIDDEN, seed=tokens)
    x2 = _rows(tokens, HIDDEN, seed=tokens + 1000)[0]
    out, new_residual = add_rms_norm_cuda(x, residual, weight, EPS, x2=x2)
    want_out, want_residual = add2_rms_norm(x, x2, residual, weight, EPS)
    torch.cuda.synchronize()
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=NORM_RTOL, atol=NORM_ATOL)
    assert not torch.equal(new_residual, add_rms_norm(x, residual, weight, EPS)[1])  # x2 was added
    unrounded = (x.float() + x2.float() + residual.float()).to(torch.bfloat16)
    assert not torch.equal(new_residual, unrounded)  # the sum was rounded before the residual joined it


def test_two_addends_read_strided_rows():
    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add2_rms_norm

    wide, residual, weight = _rows(3, 2 * HIDDEN, seed=21)
    x, x2 = wide[:, :HIDDEN], wide[:, HIDDEN:]
    got = add_rms_norm_cuda(x, residual[:, :HIDDEN], weight[:HIDDEN], EPS, x2=x2)
    want = add2_rms_norm(x, x2, residual[:, :HIDDEN], weight[:HIDDEN], EPS)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=NORM_RTOL, atol=NORM_ATOL)


def test_matches_vllms_native_op():
    pytest.importorskip("vllm")
    from vllm import ir

    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda

    x, residual, weight = _rows(4, HIDDEN, seed=7)
    want_out, want_residual = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), residual.clone(),
                                                                                   weight, EPS)
    out, new_residual = add_rms_norm_cuda(x, residual, weight, EPS)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=NORM_RTOL, atol=NORM_ATOL)


def test_strided_rows_and_a_view_of_a_wider_tensor():
    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add_rms_norm

    wide, residual, weight = _rows(3, 2 * HIDDEN, seed=3)
    x = wide[:, HIDDEN:]  # row stride 2 * HIDDEN
    out, new_residual = add_rms_norm_cuda(x, residual[:, :HIDDEN], weight[:HIDDEN], EPS)
    want_out, want_residual = add_rms_norm(x, residual[:, :HIDDEN], weight[:HIDDEN], EPS)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=NORM_RTOL, atol=NORM_ATOL)


def test_captured_in_a_cuda_graph_with_programmatic_launch():
    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add_rms_norm

    x, residual, weight = _rows(1, HIDDEN, seed=11)
    add_rms_norm_cuda(x, residual, weight, EPS)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mid = x * 2  # a kernel before (the norm waits for it) ...
        out, new_residual = add_rms_norm_cuda(mid, residual, weight, EPS)
        after = out + 1  # ... and after (it launches early and must still see the norm's output)
    x.copy_(_rows(1, HIDDEN, seed=12)[0])
    graph.replay()
    torch.cuda.synchronize()
    want_out, want_residual = add_rms_norm(x * 2, residual, weight, EPS)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(after.float(), (want_out + 1).float(), rtol=NORM_RTOL, atol=1e-2)


def test_vllms_dispatcher_serves_the_provider_when_it_is_first():
    pytest.importorskip("vllm")
    from vllm import ir

    from vllm_ling.layers import residual_norm as layer

    layer.register_residual_norm()
    x, residual, weight = _rows(2, HIDDEN, seed=5)
    op = ir.ops.fused_add_rms_norm
    with op.set_priority([layer.PROVIDER, "native"]):
        assert op.dispatch(x, residual, weight, EPS).provider == layer.PROVIDER
        assert op.dispatch(x.float(), residual.float(), weight.float(), EPS).provider == "native"  # fp32: not ours
        before = layer.calls()
        out, new_residual = op(x, residual, weight, EPS)
        assert layer.calls() == before + 1
    want_out, want_residual = op.impls["native"].impl_fn(x.clone(), residual.clone(), weight, EPS)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=NORM_RTOL, atol=NORM_ATOL)


def test_torch_compile_lowers_the_op_into_the_graph():
    """The provider traced by torch.compile (the op is opaque to Inductor) computes as eager does."""
    pytest.importorskip("vllm")
    from vllm import ir

    from vllm_ling.layers import residual_norm as layer

    layer.register_residual_norm()
    x, residual, weight = _rows(4, HIDDEN, seed=9)

    def step(a, r):
        out, new_r = torch.ops.vllm_ling.add_rms_norm(a, r, weight, EPS)
        return out * 2, new_r

    compiled = torch.compile(step, fullgraph=True)
    before = layer.calls()
    got = compiled(x, residual)
    assert layer.calls() > before
    want = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), residual.clone(), weight, EPS)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].float(), (want[0] * 2).float(), rtol=NORM_RTOL, atol=1e-2)


def test_warmup_builds_and_checks_the_kernel_for_lings_width():
    from vllm_ling.ops.residual_norm.warmup import warmup_kernels

    result = warmup_kernels(HIDDEN)
    assert result["kernel"] == f"ling_add_rms_norm (hidden {HIDDEN}, one and two addends)"
    with pytest.raises(ValueError, match="hidden size 2568"):
        warmup_kernels(2568)


def test_the_startup_known_answers_pass_with_one_and_two_addends():
    pytest.importorskip("vllm")
    from vllm import ir

    from vllm_ling.layers import residual_norm as layer
    from vllm_ling.runtime.verification.residual_norm import known_answers

    layer.register_residual_norm()
    with ir.ops.fused_add_rms_norm.set_priority([layer.PROVIDER, "native"]):
        passed, detail = known_answers(HIDDEN, EPS, torch.device("cuda"))
    assert passed and "one and two addends" in detail, detail
