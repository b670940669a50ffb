"""The known-answer family: every kernel that serves a quantized or custom op, found on the loaded
modules (the census: the attached quant method and kernel object, never the platform), run once on
a scratch layer through the same method (:mod:`vllm_ling.layers.known_answer`; the CPU KDA ops
through the functions the layer calls) against the independent answers of
:mod:`vllm_ling.ops.known_answer`: every distinct dense block-FP8 method/kernel, every distinct
vllm-ling MXFP4 MoE configuration, the FP8 LM head's prepared kernel, the plain-PyTorch KDA ops
where the CPU KDA layer serves, the router GEMV per hidden size and expert count it serves, and the
router top-k per routing configuration it serves, the fused KDA convolution per block width, and
the one-launch KDA decode per head count, head size, conv width and gate.
The result is the report's ``kernel_checks`` section and its ``kernel_known_answers`` row.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from vllm_ling.log import raised
from vllm_ling.ops.known_answer import KernelCheckResult, check_kda, skipped_result
from vllm_ling.models.kda_decode import KdaDecode
from vllm_ling.models.kda_fused_conv import KdaConv
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, VLLM_ROUTED_EXPERT_CLAMP
from vllm_ling.ops.small_gemv.selection import GemvPath
from vllm_ling.options import RouterTopk, opt_out_setting
from vllm_ling.runtime.verification.census import Census
from vllm_ling.runtime.verification.checks import Check
from vllm_ling.selection import Feature

KDA_CPU_KERNEL = "plain-PyTorch KDA (vllm_ling.ops.kda: chunked prefill, recurrent decode)"
# vLLM's own MoE method (the upstream composition) also computes the routed SwiGLU clamp
# differently from ours: the row says so, so a user comparing the two knows why logits differ.
VLLM_MOE_UNCHECKED = (
    "vLLM's own MoE method (opted out): no known-answer runner. Its routed experts clamp the SwiGLU gate "
    f"{VLLM_ROUTED_EXPERT_CLAMP.where}, {VLLM_ROUTED_EXPERT_CLAMP.formula} (vLLM 0.32); vllm-ling clamps "
    f"{ROUTED_EXPERT_CLAMP.where}, {ROUTED_EXPERT_CLAMP.formula}, as Ling was trained (inclusionAI's SGLang, "
    "llama.cpp bailingmoe3): logits differ slightly on the layers with a limit "
    "(README: \"The routed experts' SwiGLU clamp\")")
CHECK_NAME = "kernel_known_answers"
EXPECTED = "every serving kernel matches its known answers"
FIX = ("a kernel computes wrong numbers on this machine (named above with the inputs that failed): force "
       f"another kernel where one exists (VLLM_LING_LM_HEAD_KERNEL, {opt_out_setting('VLLM_LING_MOE_DECODE')}, "
       f"{opt_out_setting('VLLM_LING_ROUTER_GEMV')}, {opt_out_setting('VLLM_LING_ROUTER_TOPK')}, "
       f"{opt_out_setting('VLLM_LING_KDA_FUSED_CONV')}, {opt_out_setting('VLLM_LING_KDA_DECODE')}, "
       f"{opt_out_setting('VLLM_LING_KDA_OUTPUT_NORM')}), "
       "install the tested versions, or serve anyway with "
       "VLLM_LING_VERIFY=warn")


def _device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters(recurse=False):
        return p.device
    return torch.device("cpu")


def _block_fp8_methods(census: Census) -> list[tuple[str, Any, torch.nn.Module]]:
    """(label, method, layer) of every block-FP8 dense linear on a linear method (any method serving
    block-FP8 weights carries ``weight_block_size``: vLLM's, ours, or a later one)."""
    from vllm.model_executor.layers.linear import LinearMethodBase

    from vllm_ling.layers.known_answer import dense_kernel_label

    return [(dense_kernel_label(m), m, e.module) for e in census.of(Feature.DENSE_FP8)
            if isinstance(m := getattr(e.module, "quant_method", None), LinearMethodBase)
            and getattr(m, "weight_block_size", None) is not None]


def dense_fp8_kernels(census: Census) -> dict[str, int]:
    """Block-FP8 dense linears per serving method/kernel (read from the attached objects)."""
    counts: dict[str, int] = {}
    for label, _, _ in _block_fp8_methods(census):
        counts[label] = counts.get(label, 0) + 1
    return counts


def _guarded(name: str, kernel: str, check: Callable[[], KernelCheckResult]) -> KernelCheckResult:
    """``check()``, where raising before its cases run (building the problem, preparing the scratch
    layer) is that kernel's failure, named with where it was raised; the other kernels are still checked."""
    t0 = time.perf_counter()
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - a check's exception is its failure, never a crash
        return KernelCheckResult(name, kernel, False, math.inf, 0.0, [f"preparing the check raised {raised(exc)}"],
                                 time.perf_counter() - t0)


def run_kernel_checks(census: Census) -> list[KernelCheckResult]:
    """One known-answer result per distinct serving kernel of the loaded models."""
    from vllm_ling.layers import kda_cpu, kda_decode, kda_fused_conv, kda_output_norm, router_gate_cuda, router_topk
    from vllm_ling.layers import known_answer as layer_checks
    from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod
    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod

    dense: dict[str, tuple[Any, torch.device]] = {}
    for label, m, layer in _block_fp8_methods(census):
        dense.setdefault(label, (m, _device(layer)))
    moe: dict[tuple, tuple[Any, torch.device]] = {}
    unchecked: dict[str, str] = {}
    for e in census.of(Feature.MOE):
        qm = e.module.quant_method
        if isinstance(qm, LingMxfp4MoEMethod):
            key = (qm.backend, qm.w4a8, qm.decode, qm.decode_max_tokens, qm.decode_status)
            moe.setdefault(key, (qm, e.module.w13_weight.device))
        else:
            unchecked[f"vllm:{type(qm).__name__}"] = VLLM_MOE_UNCHECKED
    router: dict[tuple, tuple[Any, torch.device]] = {}
    for e in census.of(Feature.ROUTER_GEMV):  # the launch shape follows hidden size and expert count
        if e.served.key[0] is GemvPath.LING:
            router.setdefault((e.module.input_size, e.module.weight.shape[0], _device(e.module)),
                              (e.module, _device(e.module)))
    topk: dict[tuple, tuple[Any, torch.device]] = {}
    for e in census.of(Feature.ROUTER_TOPK):  # one per routing configuration the kernel serves
        if e.served.key[0] is RouterTopk.LING:
            r = e.module.router
            dev = r.e_score_correction_bias.device  # the runner holds no parameter of its own: the router's bias
            topk.setdefault((r.global_num_experts, r.num_expert_group, r.topk_group, r.top_k, r.renormalize,
                             r.routed_scaling_factor, dev), (e.module, dev))
    conv: dict[tuple, tuple[Any, torch.device]] = {}
    for e in census.of(Feature.KDA_FUSED_CONV):  # one per block width and conv width
        if e.served.key[0] is KdaConv.FUSED:
            w = e.module.ling_qkv_conv_weight
            conv.setdefault((e.module.projection_size_per_partition, w.shape[-1], w.device), (e.module, w.device))
    decode: dict[tuple, tuple[Any, torch.device]] = {}
    for e in census.of(Feature.KDA_DECODE):  # one per head count, head size, conv width, gate and output norm
        if e.served.key[0] is KdaDecode.LING:
            m = e.module
            w = getattr(m, kda_fused_conv.WEIGHT_ATTR)
            decode.setdefault((m.local_num_heads, m.head_dim, w.shape[-1], w.dtype, m.safe_gate, m.lower_bound,
                               kda_output_norm.active(m), w.device), (m, w.device))
    results = [_guarded("dense_fp8", label, lambda qm=qm, dev=dev: layer_checks.check_dense_fp8_method(qm, dev))
               for label, (qm, dev) in dense.items()]
    results += [_guarded("moe_mxfp4", f"{type(qm).__name__} {key}",
                         lambda qm=qm, dev=dev: layer_checks.check_moe_method(qm, dev))
                for key, (qm, dev) in moe.items()]
    results += [_guarded("router_gemv", router_gate_cuda.KERNEL_LABEL,
                         lambda gate=gate, dev=dev: layer_checks.check_router_gate(gate, dev))
                for gate, dev in router.values()]
    results += [_guarded("router_topk", router_topk.KERNEL_LABEL,
                         lambda runner=runner, dev=dev: layer_checks.check_router_topk(runner, dev))
                for runner, dev in topk.values()]
    results += [_guarded("kda_conv", kda_fused_conv.KERNEL_LABEL,
                         lambda layer=layer, dev=dev: layer_checks.check_kda_conv(layer, dev))
                for layer, dev in conv.values()]
    results += [_guarded("kda_decode", kda_decode.KERNEL_LABEL,
                         lambda layer=layer, dev=dev: layer_checks.check_kda_decode(layer, dev))
                for layer, dev in decode.values()]
    heads = [e.module for e in census.of(Feature.FP8_HEAD) if isinstance(e.module.quant_method, Fp8LmHeadMethod)]
    results += [_guarded("fp8_head", type(h.quant_method).__name__,
                         lambda h=h: layer_checks.check_head_method(h.quant_method, h.weight.device))
                for h in heads[:1]]
    if any(isinstance(e.module, kda_cpu.cpu_kda_class()) for e in census.of(Feature.KDA_MERGED_IN_PROJ)):
        # the functions the layer calls, looked up as it looks them up
        results.append(_guarded("kda", KDA_CPU_KERNEL, lambda: check_kda(
            kda_cpu.kda_ops.kda_prefill_pooled, kda_cpu.kda_ops.kda_decode_pooled, KDA_CPU_KERNEL)))
    return results + [skipped_result("moe_mxfp4", k, why) for k, why in unchecked.items()]


def summary(results: list[KernelCheckResult]) -> tuple[bool, str]:
    """(all passed, one line naming every failure's kernel, inputs and max error)."""
    failed = [r for r in results if not r.passed]
    if failed:
        return False, " | ".join(r.message() for r in failed)
    checked = [r for r in results if not r.skipped]
    return True, (f"{len(checked)} kernel(s) match their known answers: "
                  + ", ".join(f"{r.name} [{r.kernel}]" for r in checked)) if checked else "no kernels to check"


def _dense_path(census: Census) -> dict[str, str] | None:
    """The one kernel and reason every dense block-FP8 linear recorded, where they all agree."""
    picks = {(s.choice, s.reason) for e in census.of(Feature.DENSE_FP8) if (s := e.recorded) is not None}
    if len(picks) != 1:
        return None
    (choice, reason), = picks
    return {"kernel": choice.value, "reason": reason}


def report_section(census: Census) -> dict[str, Any]:
    """The report's ``kernel_checks`` entry: verdict, one-line summary, per-kernel results, wall
    time, and what serves the dense block-FP8 linears (read from the modules and their records)."""
    t0 = time.perf_counter()
    try:
        results = run_kernel_checks(census)
    except Exception as exc:  # finding the kernels failed: the check fails, the server does not crash
        results = [KernelCheckResult(CHECK_NAME, "finding the serving kernels", False, float("inf"), 0.0,
                                     [f"raised {raised(exc)}"], 0.0)]
    ok, line = summary(results)
    return {"passed": ok, "summary": line, "seconds": round(time.perf_counter() - t0, 4),
            "results": [r.as_dict() for r in results],
            "dense_fp8": {"kernels": dense_fp8_kernels(census), "path_choice": _dense_path(census)}}


def check(section: dict[str, Any]) -> Check:
    return Check(CHECK_NAME, section["passed"], EXPECTED, section["summary"], FIX)
