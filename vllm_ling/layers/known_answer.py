"""Known-answer checks through vLLM quant methods: a scratch layer, the same method and kernel.

Each check takes the quant method a loaded layer really holds (or one about to be attached),
copies it, builds a small scratch layer through that copy's ``create_weights`` (so vLLM's
kernel selection runs again for the scratch shape, as it did for the layer), loads the
known-answer weights of :mod:`vllm_ling.ops.known_answer` into the checkpoint-layout
parameters, runs ``process_weights_after_loading`` (the repacking that serving does) and
``apply``. The loaded layers are never touched. Labels name what serves, read from the
method and its kernel object.
"""

from __future__ import annotations

import copy
import types

import torch

from vllm_ling.log import one_line
from vllm_ling.ops.moe.selection import MoePath
from vllm_ling.ops import known_answer as ka
from vllm_ling.selection import Feature, recorded


def dense_kernel_label(method, layer: torch.nn.Module | None = None) -> str:
    """What computes a dense linear: the method class and, for vLLM's FP8 method, its kernel and
    the block scales it reads; for a ``layer`` vllm-ling's W8A16 kernels serve, also the kernels it
    recorded for decode sizes."""
    kernel = getattr(method, "fp8_linear", None)
    name = type(method).__name__
    label = f"{name}/{type(kernel).__name__}" if kernel is not None else name
    scales = getattr(method, "block_scales", None)  # what the kernel reads, once layers are processed
    if scales:
        label += f" (block scales {scales})"
    decode = getattr(recorded(layer, Feature.DENSE_FP8), "decode", "") if layer is not None else ""
    return f"{label}; decode: {decode}" if decode else label


def _load_param(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype) if value.dtype != param.dtype else value)


class KernelMismatch(RuntimeError):
    """The scratch layer could not be served by the kernel the checked layer is served by."""


def _serve_with_the_same_kernel(scratch_method, method, layer: torch.nn.Module) -> None:
    """vLLM selects the block-FP8 kernel per weight shape: where the scratch shape got another
    kernel than the served layer, build the served one (vLLM's selection with ``force_kernel``)."""
    served = getattr(method, "fp8_linear", None)
    got = getattr(scratch_method, "fp8_linear", None)
    if served is None or got is None or type(got) is type(served):
        return
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel

    scratch_method.fp8_linear = init_fp8_linear_kernel(
        activation_quant_key=scratch_method.activation_quant_key,
        weight_quant_key=scratch_method.weight_quant_key, input_dtype=scratch_method.input_dtype,
        out_dtype=scratch_method.out_dtype, weight_shape=layer.weight.shape, force_kernel=type(served))
    if type(scratch_method.fp8_linear) is not type(served):
        raise KernelMismatch(f"vLLM cannot build {type(served).__name__} for the scratch layer "
                             f"(it chose {type(scratch_method.fp8_linear).__name__})")


def check_dense_fp8_method(method, device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.bfloat16) -> ka.KernelCheckResult:
    """Block-FP8 linear ``method`` (vLLM's ``Fp8LinearMethod`` or ours) on
    :func:`~vllm_ling.ops.known_answer.block_fp8_linear_problem`."""
    block = tuple(method.weight_block_size)
    scratch_method = copy.copy(method)  # create_weights re-selects the kernel on the copy only
    layer = torch.nn.Module()
    n, k = 2 * block[0], 2 * block[1]
    try:
        scratch_method.create_weights(layer, k, [n], k, n, dtype, weight_loader=_load_param)
        _serve_with_the_same_kernel(scratch_method, method, layer)
        # exact in FP8 for W8A16 and W8A8 kernels alike: no guess from the kernel object of
        # whether it quantizes activations (FlashInfer's takes BF16 and quantizes inside)
        problem = ka.block_fp8_linear_problem(block)
        _load_param(layer.weight, problem.weight)
        _load_param(layer.weight_scale_inv, problem.scale_inv)
        layer.to(device)
        scratch_method.process_weights_after_loading(layer)
    except Exception as exc:  # a kernel that cannot even prepare fails, named
        return ka.KernelCheckResult("dense_fp8", dense_kernel_label(method), False, float("inf"), 0.0,
                                    [f"scratch layer {n}x{k}: raised {one_line(exc)}"], 0.0)
    label = dense_kernel_label(scratch_method, layer)
    return ka.run_check("dense_fp8", label, problem.cases,
                        lambda inp: scratch_method.apply(layer, inp["x"].to(device=device, dtype=dtype)))


def moe_kernel_label(method) -> str:
    label = getattr(method, "description", type(method).__name__)
    status = getattr(method, "decode_status", None)
    return f"{label}; decode: {status}" if status else label


def check_moe_method(method, device: torch.device | str = "cpu") -> ka.KernelCheckResult:
    """vllm-ling's MXFP4 MoE ``method`` on a scratch expert layer. Where a decode path exists
    (humming on CUDA) both a decode-sized and a GEMM-sized batch run; the CPU reference has
    one path and runs the small sizes only."""
    scratch_method = copy.copy(method)
    scratch_method.humming_experts = None
    on_cpu = getattr(method, "backend", None) is MoePath.REFERENCE
    sizes = dict(hidden=64, intermediate=64, token_counts=(4,)) if on_cpu else {}
    layer = types.SimpleNamespace(layer_name="known-answer scratch experts", swiglu_limit=None)

    def build(tensors, top_k):
        for name, t in tensors.items():
            setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))
        layer.moe_config = types.SimpleNamespace(experts_per_token=top_k)
        scratch_method.process_weights_after_loading(layer)

        def experts(x, topk_weights, topk_ids, swiglu_limit):
            layer.swiglu_limit = swiglu_limit
            return scratch_method.apply(layer, x.to(torch.bfloat16), topk_weights, topk_ids, None, None)
        return experts

    try:
        result = ka.check_mxfp4_experts(build, moe_kernel_label(method), device,
                                        w4a8=bool(getattr(method, "w4a8", False)), **sizes)
    except Exception as exc:
        return ka.KernelCheckResult("moe_mxfp4", moe_kernel_label(method), False, float("inf"), 0.0,
                                    [f"scratch experts: raised {one_line(exc)}"], 0.0)
    result.kernel = moe_kernel_label(scratch_method)  # with the decode path it built
    return result


def check_head_method(method, device: torch.device | str = "cpu") -> ka.KernelCheckResult:
    """The FP8 LM head ``method`` (its prepared kernel, read from its state) on
    :func:`~vllm_ling.ops.known_answer.fp8_head_problem`, through ``method.apply``."""
    from vllm_ling.ops import lm_head as head_ops

    kernel = method.kernel
    problem = ka.fp8_head_problem()  # exact in FP8: one tolerance whether the kernel quantizes activations
    scratch_method = copy.copy(method)
    out_dtype = method.state.out_dtype if method.state is not None else torch.bfloat16
    try:
        scratch_method.state = head_ops.prepare_fp8_head(problem.weight.to(device), problem.scale.to(device),
                                                         kernel, out_dtype=out_dtype)
    except Exception as exc:
        return ka.KernelCheckResult("fp8_head", str(kernel), False, float("inf"), 0.0,
                                    [f"scratch head: raised {one_line(exc)}"], 0.0)
    return ka.run_check("fp8_head", str(kernel), problem.cases,
                        lambda inp: scratch_method.apply(None, inp["x"].to(device)))


def check_router_gate(gate, device: torch.device | str = "cpu") -> ka.KernelCheckResult:
    """The router GEMV path of a served gate (``vllm_ling::router_logits``, 1..MAX_ROWS tokens)
    on :func:`~vllm_ling.ops.known_answer.router_gemv_problem` at the gate's hidden size and
    expert count (the kernel's launch shape follows both, so the check runs each one the gate is
    served with), through a scratch gate holding the known weights (the served gate is not touched)."""
    from vllm_ling.layers import router_gate_cuda

    scratch = torch.nn.Module()
    key = router_gate_cuda.register_gate(scratch, "known-answer scratch gate")

    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scratch.weight = weight
        return torch.ops.vllm_ling.router_logits(x, key)

    return ka.check_router_gemv(forward, router_gate_cuda.KERNEL_LABEL, gate.input_size, device,
                                experts=gate.weight.shape[0])


def check_router_topk(runner, device: torch.device | str = "cpu") -> ka.KernelCheckResult:
    """The routing of a served MoE runner's router (vllm-ling's grouped top-k) on
    :func:`~vllm_ling.ops.known_answer.router_topk_problem` for its configuration, through a copy of
    the served router (its class and ``select_experts``) holding the known bias (the served router
    is not touched)."""
    from vllm_ling.layers import router_topk

    router = runner.router
    routing = ka.Routing(router.global_num_experts, router.num_expert_group, router.topk_group, router.top_k,
                         router.renormalize, router.routed_scaling_factor)
    scratch = copy.copy(router)
    scratch.capture_fn, scratch._routing_replay_out = None, None  # the served model's routing records stay its own

    def route(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scratch.e_score_correction_bias = bias
        return scratch.select_experts(hidden_states=logits.new_empty((logits.shape[0], 0)), router_logits=logits)

    return ka.check_router_topk(route, router_topk.KERNEL_LABEL, routing, device)


def check_kda_conv(layer, device: torch.device | str = "cpu") -> ka.KernelCheckResult:
    """A KDA layer's fused convolution (the function its forward calls) on
    :func:`~vllm_ling.ops.known_answer.check_kda_conv` at the layer's block width and conv width,
    on scratch inputs and state (the served conv state is not touched)."""
    from vllm_ling.layers import kda_fused_conv

    weight = getattr(layer, kda_fused_conv.WEIGHT_ATTR)
    return ka.check_kda_conv(kda_fused_conv.short_conv, kda_fused_conv.KERNEL_LABEL,
                             layer.projection_size_per_partition, kernel_width=weight.shape[-1], device=device)


def check_kda_decode(layer, device: torch.device | str = "cpu") -> ka.KernelCheckResult:
    """A KDA layer's one-launch decode (what its op launches) on
    :func:`~vllm_ling.ops.known_answer.check_kda_decode` at the layer's heads, head size, conv width and
    dtype, gate and served verify window (the check's own without speculation), with the gated output norm
    of the layer's epsilon where the launch applies it (``kda_output_norm``), on scratch pools (the served
    pools are not touched)."""
    from vllm_ling.layers import kda_decode, kda_fused_conv, kda_output_norm

    weight = getattr(layer, kda_fused_conv.WEIGHT_ATTR)
    # vLLM's layer keeps its draft tokens per verify window: DSpark's 9-token windows take the kernel's
    # streamed path, MTP's 4 its tile path
    spec_tokens = getattr(layer, "num_speculative_tokens", 0)
    window = {"num_spec": spec_tokens} if spec_tokens else {}
    return ka.check_kda_decode(kda_decode.launch, kda_decode.KERNEL_LABEL, layer.local_num_heads, layer.head_dim,
                               width=weight.shape[-1], conv_dtype=weight.dtype, **window,
                               norm_eps=float(layer.o_norm.eps) if kda_output_norm.active(layer) else None,
                               lower_bound=layer.lower_bound if layer.safe_gate else None, device=device)
