"""The MoE's shared + routed sum folded into the next residual norm: a post-grad pass in vLLM's pass manager.

vLLM's MoE runner adds the shared experts' output to the routed experts' in Python after its opaque MoE op, and
the next decoder layer's input norm (or the final norm) takes that sum as its ``x``. Inductor compiles the add as
a pointwise kernel of its own, launched between the routed down kernel and vllm-ling's norm, which waits for it:
about 1.2 us of the decode chain per MoE layer (lease 2026-12-08a, ``benchmarks/results/gpu_serving_h200.md``).
Where the IR op ``fused_add_rms_norm`` would lower to vllm-ling's provider, this pass hands the two addends to
``vllm_ling::add2_rms_norm`` instead, which adds them (rounded to BF16 first, as the graph's add rounds) inside the
norm's launch. It runs among vLLM's post-grad passes before the IR lowering (the config hook installs it as
``inductor_compile_config["post_grad_custom_post_pass"]``: :mod:`vllm_ling.runtime.residual_norm`); the two-addend
op counts its calls, so after warm-up each worker can say how many norms the compiled model folded.
"""

from __future__ import annotations

import torch
from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass
from vllm.compilation.passes.ir.utils import get_ir_op

from vllm_ling.layers.residual_norm import PROVIDER

def _sum_of_two(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two addends where ``node`` is ``a + b`` of rows like its own (same shape and dtype, no scaling) that
    nothing else reads."""
    if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor or node.kwargs:
        return None
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args) or len(node.users) != 1:
        return None
    out = node.meta.get("val")
    for addend in node.args:
        val = addend.meta.get("val")
        if out is None or val is None or val.shape != out.shape or val.dtype != out.dtype:
            return None
    return node.args[0], node.args[1]


def _served_by_provider(ir_op, node: fx.Node) -> bool:
    """Whether vLLM's dispatcher picks vllm-ling's provider for this norm's fake tensors (the IR lowering's own
    question). A node it cannot ask about (no fake value, a dispatcher error) is left to the lowering: a missed
    fold costs one kernel, a failed compilation the server; after warm-up the report counts what was folded."""
    if any(isinstance(arg, fx.Node) and arg.meta.get("val") is None for arg in node.args):
        return False
    try:
        return ir_op.dispatch(*fx.map_arg(node.args, lambda arg: arg.meta["val"])).provider == PROVIDER
    except Exception:  # noqa: BLE001 - see above: never fail the compilation over a fold
        return False


class MoeSumNormPass(InductorPass):
    """``fused_add_rms_norm(a + b, residual, weight, eps)`` -> ``vllm_ling::add2_rms_norm(a, b, residual, weight,
    eps)``, where vLLM's dispatcher would pick vllm-ling's provider for these rows (the same question the IR
    lowering asks, on the nodes' fake tensors)."""

    def __call__(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            ir_op = get_ir_op(node)
            if ir_op is None or ir_op.name != "fused_add_rms_norm" or node.kwargs or len(node.args) < 4:
                continue
            x, residual, weight, eps = node.args[:4]
            if (len(node.args) > 4 and node.args[4] is not None) or not isinstance(weight, fx.Node) \
                    or not isinstance(x, fx.Node):
                continue
            addends = _sum_of_two(x)
            if addends is None or not _served_by_provider(ir_op, node):
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.vllm_ling.add2_rms_norm.default,
                                            (*addends, residual, weight, eps))
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            graph.erase_node(x)

    def uuid(self) -> str:
        return InductorPass.hash_source(self, _sum_of_two, _served_by_provider)

