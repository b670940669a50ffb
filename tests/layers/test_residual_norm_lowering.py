"""vLLM's own compile passes put vllm-ling's residual norm into the graph (CPU, fake CUDA tensors): the IR op
``fused_add_rms_norm`` as a decoder layer calls it (``maybe_inplace``), functionalized and lowered by vLLM's
passes with vllm-ling's provider first in the priority, becomes ``vllm_ling::add_rms_norm``; with vLLM's default
priority, or rows the kernel does not take, it stays vLLM's. The kernel itself is CUDA's
(tests/ops/residual_norm, gpu marker): here the provider is marked supported for the test only."""

from __future__ import annotations

import pytest
import torch

VLLM_OP = "vllm_ir.fused_add_rms_norm"


def _lowered(monkeypatch, priority: list[str], dtype=torch.bfloat16, hidden: int = 2560) -> tuple[str, dict]:
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

    layer.register_residual_norm()
    op = ir.ops.fused_add_rms_norm
    monkeypatch.setattr(op.impls[layer.PROVIDER], "supported", True)  # CUDA's provider, on this CPU
    monkeypatch.setattr(ir_op_module, "_ENABLE_TORCH_WRAP", True)  # as vLLM compiles: the op in the graph

    def decoder_norm(x, residual, weight):  # what vLLM's RMSNorm.forward_native calls with a residual
        out, new_residual = op.maybe_inplace(x, residual, weight, 1e-6, None)
        return out * 2, new_residual

    with FakeTensorMode():
        x, residual = (torch.empty(3, hidden, dtype=dtype, device="cuda") for _ in range(2))
        weight = torch.empty(hidden, dtype=dtype, device="cuda")
        gm = make_fx(decoder_norm)(x, residual, weight)
        config = VllmConfig()
        with set_current_vllm_config(config), op.set_priority(priority), pass_context(Range(1, 8)):
            VllmIRInplaceFunctionalizationPass(config)(gm.graph)
            lowering = VllmIRLoweringPass(config)
            lowering(gm.graph)
    targets = " ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return targets, dict(lowering.selected_impls)


def test_the_provider_first_lowers_to_vllm_lings_op(monkeypatch):
    targets, picked = _lowered(monkeypatch, ["vllm_ling", "native"])
    assert "vllm_ling.add_rms_norm" in targets and VLLM_OP not in targets
    assert list(picked["fused_add_rms_norm"].values()) == ["vllm_ling"]


def test_vllms_default_priority_keeps_vllms_norm(monkeypatch):
    targets, picked = _lowered(monkeypatch, ["native"])
    assert "vllm_ling" not in targets and VLLM_OP not in targets  # native: traced into aten ops
    assert list(picked["fused_add_rms_norm"].values()) == ["native"]


@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 2560), (torch.bfloat16, 2564)])
def test_rows_the_kernel_does_not_take_go_to_the_next_provider(monkeypatch, dtype, hidden):
    targets, picked = _lowered(monkeypatch, ["vllm_ling", "native"], dtype=dtype, hidden=hidden)
    assert "vllm_ling" not in targets
    assert list(picked["fused_add_rms_norm"].values()) == ["native"]
