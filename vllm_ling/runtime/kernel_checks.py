"""Startup known-answer checks of every kernel that serves a quantized or custom op.

Run in each worker after loading (from verification). The kernels are found on the loaded
target and draft modules, from the quant method (and kernel object) actually attached, never
from the platform: every distinct dense block-FP8 method/kernel, every distinct vllm-ling
MXFP4 MoE configuration, the FP8 LM head's prepared kernel, the plain-PyTorch KDA ops
when the CPU KDA layer serves, and the router GEMV per hidden size of the gates it serves.
Each runs once on a scratch layer through the same method (:mod:`vllm_ling.layers.known_answer`;
KDA through the ops functions the layer calls) and is compared with the independent answers of
:mod:`vllm_ling.ops.known_answer`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_ling.log import one_line
from vllm_ling.options import opt_out_setting
from vllm_ling.ops.known_answer import KernelCheckResult, check_kda, skipped_result

KDA_CPU_KERNEL = "plain-PyTorch KDA (vllm_ling.ops.kda: chunked prefill, recurrent decode)"


def _modules(target, draft) -> list[tuple[str, torch.nn.Module]]:
    mods = [("target." + n, m) for n, m in target.named_modules()]
    if draft is not None:
        mods += [("draft." + n, m) for n, m in draft.named_modules()]
    return mods


def _device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters(recurse=False):
        return p.device
    return torch.device("cpu")


def _is_block_fp8_method(method) -> bool:
    """Any linear method serving block-FP8 weights (vLLM's Fp8LinearMethod with block scales,
    ours, or a later one with vLLM's parameters): they all carry ``weight_block_size``."""
    from vllm.model_executor.layers.linear import LinearMethodBase

    return isinstance(method, LinearMethodBase) and getattr(method, "weight_block_size", None) is not None


def dense_fp8_kernels(target, draft) -> dict[str, int]:
    """Block-FP8 dense linears per serving method/kernel (read from the attached objects)."""
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_ling.layers.known_answer import dense_kernel_label

    counts: dict[str, int] = {}
    for _, m in _modules(target, draft):
        qm = getattr(m, "quant_method", None)
        if isinstance(m, LinearBase) and _is_block_fp8_method(qm):
            label = dense_kernel_label(qm)
            counts[label] = counts.get(label, 0) + 1
    return counts


def run_kernel_checks(target, draft) -> list[KernelCheckResult]:
    """One known-answer result per distinct serving kernel of the loaded models."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_ling.layers import known_answer as layer_checks
    from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod
    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod

    from vllm_ling.layers import kda_cpu

    dense: dict[str, tuple[Any, torch.device]] = {}
    kda_serves = False
    moe: dict[tuple, tuple[Any, torch.device]] = {}
    router: dict[tuple, tuple[Any, torch.device]] = {}
    unchecked: dict[str, str] = {}
    for _, m in _modules(target, draft):
        qm = getattr(m, "quant_method", None)
        if isinstance(m, LinearBase) and _is_block_fp8_method(qm):
            dense.setdefault(layer_checks.dense_kernel_label(qm), (qm, _device(m)))
        elif isinstance(m, kda_cpu.cpu_kda_class()):
            kda_serves = True
        elif isinstance(m, RoutedExperts):
            if isinstance(qm, LingMxfp4MoEMethod):
                key = (qm.backend, qm.w4a8, qm.decode, qm.decode_max_tokens, qm.decode_status)
                moe.setdefault(key, (qm, m.w13_weight.device))
            else:
                unchecked[f"vllm:{type(qm).__name__}"] = "vLLM's own MoE method (opted out): no known-answer runner"
        elif getattr(m, "ling_router_gemv", False):  # vllm-ling's GateLinear on its kernel path
            # the launch shape follows hidden size and expert count: one check per pair
            router.setdefault((m.input_size, m.weight.shape[0], _device(m)), (m, _device(m)))
    results = [layer_checks.check_dense_fp8_method(qm, dev) for qm, dev in dense.values()]
    results += [layer_checks.check_moe_method(qm, dev) for qm, dev in moe.values()]
    results += [layer_checks.check_router_gate(gate, dev) for gate, dev in router.values()]
    head = getattr(target, "lm_head", None)
    if isinstance(getattr(head, "quant_method", None), Fp8LmHeadMethod):  # PPMissingLayer: no head here
        results.append(layer_checks.check_head_method(head.quant_method, head.weight.device))
    if kda_serves:  # the functions the layer calls, looked up as it looks them up
        results.append(check_kda(kda_cpu.kda_ops.kda_prefill_pooled, kda_cpu.kda_ops.kda_decode_pooled,
                                 KDA_CPU_KERNEL))
    results += [skipped_result("moe_mxfp4", k, why) for k, why in unchecked.items()]
    return results


def timed_kernel_checks(target, draft) -> tuple[list[KernelCheckResult], float]:
    t0 = time.perf_counter()
    results = run_kernel_checks(target, draft)
    return results, time.perf_counter() - t0


def summary(results: list[KernelCheckResult]) -> tuple[bool, str]:
    """(all passed, one line naming every failure's kernel, inputs and max error)."""
    failed = [r for r in results if not r.passed]
    if failed:
        return False, " | ".join(r.message() for r in failed)
    checked = [r for r in results if not r.skipped]
    return True, (f"{len(checked)} kernel(s) match their known answers: "
                  + ", ".join(f"{r.name} [{r.kernel}]" for r in checked)) if checked else "no kernels to check"


CHECK_NAME = "kernel_known_answers"
EXPECTED = "every serving kernel matches its known answers"
FIX = ("a kernel computes wrong numbers on this machine (named above with the inputs that failed): force "
       f"another kernel where one exists (VLLM_LING_LM_HEAD_KERNEL, {opt_out_setting('VLLM_LING_MOE_DECODE')}, "
       f"{opt_out_setting('VLLM_LING_ROUTER_GEMV')}), install the tested versions, or serve anyway with "
       "VLLM_LING_VERIFY=warn")


def report_section(target, draft) -> dict[str, Any]:
    """The report's ``kernel_checks`` entry: verdict, one-line summary, per-kernel results,
    wall time, and what serves the dense block-FP8 linears (read from the modules)."""
    from vllm_ling.layers.dense_fp8_path import last_choice

    try:
        results, seconds = timed_kernel_checks(target, draft)
    except Exception as exc:  # finding the kernels failed: the check fails, the server does not crash
        results = [KernelCheckResult(CHECK_NAME, "finding the serving kernels", False, float("inf"), 0.0,
                                     [f"raised {one_line(exc)}"], 0.0)]
        seconds = 0.0
    ok, line = summary(results)
    choice = last_choice()
    return {"passed": ok, "summary": line, "seconds": round(seconds, 4),
            "results": [r.as_dict() for r in results],
            "dense_fp8": {"kernels": dense_fp8_kernels(target, draft),
                          "path_choice": None if choice is None else
                          {"kernel": choice.kernel.value, "reason": choice.reason}}}


def table_lines(section: dict[str, Any]) -> list[str]:
    """Rows for the startup INFO table."""
    lines = [f"known-answer kernel checks ({section['seconds']:.2f} s):"]
    for r in section["results"]:
        if r["skipped"]:
            verdict = f"not checked: {r['skipped']}"
        else:
            err = "inf" if r["max_error"] is None else f"{r['max_error']:.3g}"
            verdict = (f"{'ok' if r['passed'] else 'FAILED'}, max rel. error {err} "
                       f"(tol {r['tolerance']:.3g}), {r['cases']} cases, {r['seconds']:.2f} s")
            if not r["passed"]:
                verdict += "; failing: " + "; ".join(r["failing_inputs"])
        lines.append(f"  {r['name']} [{r['kernel']}]: {verdict}")
    dense = section["dense_fp8"]
    if dense["kernels"]:
        lines.append("  dense block-FP8 linears: " + ", ".join(f"{n} x {k}" for k, n in sorted(dense["kernels"].items()))
                     + (f" ({dense['path_choice']['reason']})" if dense["path_choice"] else ""))
    return lines
