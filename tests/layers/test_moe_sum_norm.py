"""The MoE sum folded into the next residual norm (vllm_ling.layers.moe_sum_norm) among vLLM's own compile passes
(CPU, fake CUDA tensors): the graph a decoder layer makes, ``shared + routed`` then the IR op
``fused_add_rms_norm`` (``maybe_inplace``), functionalized, passed and lowered as vLLM does, calls
``vllm_ling::add2_rms_norm`` with both addends where vllm-ling's provider would serve the norm, and is left alone
elsewhere; the rewritten graph, run with the plain-PyTorch reference as the kernel, computes what the original
computes. The kernel itself is CUDA's (tests/ops/residual_norm, gpu marker): here the provider is marked supported
for the test only."""

from __future__ import annotations

import pytest
import torch

LING = "vllm_ling.add2_rms_norm.default"


def _norm_after_sum(a, b, residual, weight):  # the MoE runner's add, then the next layer's input norm
    from vllm import ir

    out, new_residual = ir.ops.fused_add_rms_norm.maybe_inplace(a + b, residual, weight, 1e-6, None)
    return out * 2, new_residual


def _graph(monkeypatch, step, priority: list[str], dtype=torch.bfloat16, hidden: int = 2560, rows: int = 3):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm import ir
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.compilation.passes.ir.lowering_pass import VllmIRLoweringPass
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range

    import vllm.ir.op as ir_op_module
    from vllm_ling.layers import residual_norm as layer
    from vllm_ling.layers.moe_sum_norm import MoeSumNormPass

    layer.register_residual_norm()
    op = ir.ops.fused_add_rms_norm
    monkeypatch.setattr(op.impls[layer.PROVIDER], "supported", True)  # CUDA's provider, on this CPU
    monkeypatch.setattr(ir_op_module, "_ENABLE_TORCH_WRAP", True)  # as vLLM compiles: the op in the graph
    with FakeTensorMode():
        a, b, residual = (torch.empty(rows, hidden, dtype=dtype, device="cuda") for _ in range(3))
        weight = torch.empty(hidden, dtype=dtype, device="cuda")
        gm = make_fx(step)(a, b, residual, weight)
        config = VllmConfig()
        with set_current_vllm_config(config), op.set_priority(priority), pass_context(Range(1, 8)):
            VllmIRInplaceFunctionalizationPass(config)(gm.graph)
            MoeSumNormPass()(gm.graph)
            VllmIRLoweringPass(config)(gm.graph)
    gm.recompile()
    return gm


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_the_sum_goes_into_the_norm_where_the_provider_serves_it(monkeypatch):
    targets = _targets(_graph(monkeypatch, _norm_after_sum, ["vllm_ling", "native"]))
    assert targets.count(LING) == 1
    assert "aten.add.Tensor" not in targets and "vllm_ling.add_rms_norm.default" not in targets
    assert not any(t.startswith("vllm_ir.") for t in targets)


def test_vllms_default_priority_keeps_the_add_and_vllms_norm(monkeypatch):
    targets = _targets(_graph(monkeypatch, _norm_after_sum, ["native"]))
    assert not any("vllm_ling" in t for t in targets)


def test_rows_the_kernel_does_not_take_keep_the_add(monkeypatch):
    targets = _targets(_graph(monkeypatch, _norm_after_sum, ["vllm_ling", "native"], hidden=2564))
    assert not any("vllm_ling" in t for t in targets)


def test_a_sum_read_elsewhere_is_left_to_the_one_addend_norm(monkeypatch):
    def sum_also_returned(a, b, residual, weight):
        from vllm import ir

        x = a + b
        out, new_residual = ir.ops.fused_add_rms_norm.maybe_inplace(x.clone(), residual, weight, 1e-6, None)
        return out, new_residual, x

    targets = _targets(_graph(monkeypatch, sum_also_returned, ["vllm_ling", "native"]))
    assert LING not in targets and "aten.add.Tensor" in targets


def test_a_scaled_sum_is_not_folded(monkeypatch):
    def scaled(a, b, residual, weight):
        from vllm import ir

        return ir.ops.fused_add_rms_norm.maybe_inplace(torch.add(a, b, alpha=2), residual, weight, 1e-6, None)

    assert LING not in _targets(_graph(monkeypatch, scaled, ["vllm_ling", "native"]))


def test_the_rewritten_graph_computes_what_the_original_computes(monkeypatch):
    """The folded graph run on CPU rows with the reference standing in for the CUDA kernel: the addends reach the
    kernel as x and x2, the residual and weight in their places (a swapped argument is O(1) off)."""
    from vllm_ling.ops.residual_norm import kernel, reference

    def kernel_as_reference(x, residual, weight, eps, x2=None):
        assert x2 is not None  # only the two-addend op runs in this graph
        return reference.add2_rms_norm(x, x2, residual, weight, eps)

    gm = _graph(monkeypatch, _norm_after_sum, ["vllm_ling", "native"], rows=5)
    assert _targets(gm).count(LING) == 1
    monkeypatch.setattr(kernel, "add_rms_norm_cuda", kernel_as_reference)
    g = torch.Generator().manual_seed(0)
    a, b = ((4 * torch.randn(5, 2560, generator=g)).bfloat16() for _ in range(2))
    residual = torch.randn(5, 2560, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(2560, generator=g)).bfloat16()
    got_out, got_residual = gm(a, b, residual, weight)
    want_out, want_residual = reference.add_rms_norm((a.float() + b.float()).bfloat16(), residual, weight, 1e-6)
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(got_out, want_out * 2)


def test_the_pass_has_a_stable_uuid_for_vllms_compile_cache():
    from vllm_ling.layers.moe_sum_norm import MoeSumNormPass

    assert MoeSumNormPass().uuid() == MoeSumNormPass().uuid()
    from vllm.config.utils import normalize_value

    # vLLM hashes inductor_compile_config into its compile cache key: the pass by its uuid, not refused
    assert MoeSumNormPass().uuid() in str(normalize_value({"post_grad_custom_post_pass": MoeSumNormPass()}))


@pytest.mark.parametrize("priority", [["vllm_ling", "native"], ["native"]])
def test_a_norm_without_a_sum_before_it_is_untouched(monkeypatch, priority):
    def plain(a, b, residual, weight):
        from vllm import ir

        return ir.ops.fused_add_rms_norm.maybe_inplace(a * b, residual, weight, 1e-6, None)

    assert LING not in _targets(_graph(monkeypatch, plain, priority))


def test_a_norm_the_dispatcher_cannot_be_asked_about_is_left_to_the_lowering(monkeypatch):
    """A dispatcher error (or a node without a fake value) skips the fold rather than failing the compilation."""
    from vllm import ir

    def broken(*args, **kwargs):
        raise RuntimeError("no provider")

    monkeypatch.setattr(ir.ops.fused_add_rms_norm, "dispatch", broken, raising=False)
    from vllm_ling.layers import moe_sum_norm

    graph = __import__("torch").fx.Graph()
    a, b, r, w = (graph.placeholder(n) for n in "abrw")
    x = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    norm = graph.call_function(torch.ops.vllm_ir.fused_add_rms_norm.default, (x, r, w, 1e-6, None))
    graph.output((norm,))
    for node in (a, b, r, w, x):
        node.meta["val"] = torch.empty(2, 8)
    moe_sum_norm.MoeSumNormPass()(graph)
    assert [n.target for n in graph.nodes if n.op == "call_function"] == \
        [torch.ops.aten.add.Tensor, torch.ops.vllm_ir.fused_add_rms_norm.default]
    del w.meta["val"]
    monkeypatch.undo()
    moe_sum_norm.MoeSumNormPass()(graph)  # no fake value for the weight: left alone, no KeyError
    assert torch.ops.aten.add.Tensor in [n.target for n in graph.nodes]
